"""Turns that start together, in one process (no HTTP): each conversation's time
to first token when N arrive at once, with new conversations' common head run
once in one sequence (engine/one_sequence.py) and without (side by side,
padded: the rows' prompts computed whole), alternating, on the real SmolLM2.

Each repetition opens a fresh manager per mode, sends N conversations of
``concurrency.py``'s chat shape (one short system prompt, a question each,
48-token replies) for ``--turns`` turns, all N turns of a round started
together, and records each turn's time to first token and the engine's
counters. Turn 1 is where the head is shared; later turns (pasts of their own)
run side by side in both modes, and stand as the control.

    python benchmarks/first_turns.py                     # 1, 2, 4 and 8 at once, 3 repetitions
    python benchmarks/first_turns.py --concurrency 4 --repetitions 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from concurrency import CHAT_SYSTEM, conversation
from kvchat import SessionManager
from kvchat.pretrained import load_pretrained, smollm2_path
from machine import describe
from tqdm import tqdm

MODES = ("one sequence", "side by side")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    return parser.parse_args(argv)


def _round(manager, histories, reply_tokens) -> list[float]:
    """One turn of every conversation, started together: each one's TTFT (ms)."""
    ttft = [0.0] * len(histories)
    barrier = threading.Barrier(len(histories))

    def turn(i):
        barrier.wait()
        started, first, pieces = time.perf_counter(), None, []
        # Every reply is reply_tokens long in both modes (no early end of
        # turn), so the modes' later turns carry as many tokens.
        stream = manager.stream_chat(
            f"c{i}", histories[i], max_new_tokens=reply_tokens, min_new_tokens=reply_tokens
        )
        for piece in stream:
            if first is None and piece:
                first = time.perf_counter()
            pieces.append(piece)
        if first is None:
            raise RuntimeError(f"conversation {i}'s reply streamed no text")
        ttft[i] = (first - started) * 1e3
        histories[i].append({"role": "assistant", "content": "".join(pieces)})

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(histories))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ttft


def run_once(model, tokenizer, mode: str, n: int, args) -> dict:
    manager = SessionManager(model, tokenizer)
    # The switch the engine reads (engine/loop.py ``as_one``): off runs every
    # group of prompts side by side, as before one_sequence.py.
    manager._engine._loop.as_one &= mode == MODES[0]
    try:
        # A warm-up on a prompt no conversation shares: first-call costs land here.
        manager.chat("warm-up", [{"role": "user", "content": "Warm up. " * 30}], max_new_tokens=2)
        manager.wait_settled()
        histories = {}
        for i in range(n):
            system, _ = conversation("chat", i, args.turns)
            histories[i] = [{"role": "system", "content": system}]
        turns = []
        for t in range(args.turns):
            for i in range(n):
                histories[i].append(
                    {"role": "user", "content": conversation("chat", i, args.turns)[1][t]}
                )
            turns.append(_round(manager, histories, args.reply_tokens))
            manager.wait_settled()  # the reading time between turns
        stats = manager.stats()
        return {
            "mode": mode,
            "concurrency": n,
            "ttft_ms": turns,
            "head_tokens_run_once": stats.head_tokens_run_once,
            "prompts_prefilled_together": stats.prompts_prefilled_together,
        }
    finally:
        manager.close()


def summarize(runs: list[dict]) -> list[dict]:
    """Per (concurrency, mode, turn): the median over repetitions of the
    round's slowest first token, and of its mean."""
    rows = {}
    for run in runs:
        for t, ttft in enumerate(run["ttft_ms"]):
            key = (run["concurrency"], run["mode"], t + 1)
            rows.setdefault(key, []).append((max(ttft), statistics.mean(ttft)))
    return [
        {
            "concurrency": n,
            "mode": mode,
            "turn": turn,
            "slowest_ms": statistics.median(v[0] for v in values),
            "mean_ms": statistics.median(v[1] for v in values),
        }
        for (n, mode, turn), values in sorted(rows.items())
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(smollm2_path())
    runs = []
    total = args.repetitions * len(args.concurrency) * len(MODES)
    with tqdm(total=total, desc="first turns", unit="run") as bar:
        for repetition in range(args.repetitions):
            for n in args.concurrency:
                # Alternating, and in the other order every other repetition,
                # so the machine's drift falls on both modes alike.
                modes = MODES if repetition % 2 == 0 else MODES[::-1]
                for mode in modes:
                    runs.append(
                        {**run_once(model, tokenizer, mode, n, args), "repetition": repetition}
                    )
                    bar.update()
    summary = summarize(runs)
    result = {
        "machine": describe(),
        "settings": vars(args),
        "system": CHAT_SYSTEM,
        "runs": runs,
        "summary": summary,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "first-turns-smollm2-cpu.json"
    path.write_text(json.dumps(result, indent=2))
    print(
        f"\nSmolLM2, {args.turns} turns of {args.reply_tokens}-token replies, all conversations' "
        f"turns started together; median of {args.repetitions} (ms):"
    )
    print(f"{'conv':>4}  {'turn':>4}  {'mode':<13} {'slowest TTFT':>12} {'mean TTFT':>10}")
    for row in summary:
        print(
            f"{row['concurrency']:>4}  {row['turn']:>4}  {row['mode']:<13} "
            f"{row['slowest_ms']:>12.0f} {row['mean_ms']:>10.0f}"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
