"""Many sessions over one long system prompt: with and without prefix sharing.

For each mode the same sessions run the same turns, round-robin, through one
SessionManager. Reported side by side: the first turn's time to first token
for sessions 2..N (the ones that can start from another's prefix), the tokens
prefilled, and the resident cache bytes at the end. Both modes must produce
the same tokens.

    python benchmarks/sharing.py --model smollm2-135m --sessions 16 --system-tokens 1000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
from kvchat import SessionManager
from tqdm import tqdm
from workload import PRESETS, TINY, _text_of, load_model

MAX_NEW = 8


def run(model, tokenizer, system: str, sessions: int, turns: int, share: bool) -> dict:
    mgr = SessionManager(model, tokenizer, max_sessions=sessions, share_prefixes=share)
    rng = random.Random(1)
    conversations = {s: [{"role": "system", "content": system}] for s in range(sessions)}
    first_ttft, outputs, prefilled = [], [], 0
    label = "sharing" if share else "private"
    for turn in tqdm(range(turns), desc=label, unit="round"):
        for s in range(sessions):
            messages = conversations[s]
            messages.append({"role": "user", "content": _text_of(tokenizer, rng, 30)})
            reply = mgr.chat(f"s{s}", messages, max_new_tokens=MAX_NEW)
            report = mgr.last_turn(f"s{s}")
            if turn == 0 and s > 0:
                first_ttft.append(report.prefill_ms)
            prefilled += report.prefilled_tokens
            outputs.append(report.output_ids)
            messages.append({"role": "assistant", "content": reply})
            mgr.wait_settled()  # the user's reading time (settling waits settle_delay otherwise)
    stats = mgr.stats()
    return {
        "mode": label,
        "first_turn_ttft_ms_median": statistics.median(first_ttft),
        "prefilled_tokens": prefilled,
        "resident_bytes": stats.resident_bytes,
        "shared_prefixes": stats.shared_prefixes,
        "prefix_shares": stats.prefix_shares,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help=f"{TINY}, {sorted(PRESETS)} or a path"
    )
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sharing.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    system = _text_of(tokenizer, random.Random(0), args.system_tokens)
    runs = [
        run(model, tokenizer, system, args.sessions, args.turns, share) for share in (False, True)
    ]
    private, shared = runs
    same = private["outputs"] == shared["outputs"]

    mib = 2**20
    print(
        f"\n{args.sessions} sessions, {args.turns} turns, a {args.system_tokens}-token system "
        f"prompt, {args.model} {args.dtype} on {args.device}"
    )
    print(f"{'mode':8} {'TTFT turn 1 (s2..N) ms':>23} {'prefilled':>10} {'resident MiB':>13}")
    for r in runs:
        print(
            f"{r['mode']:8} {r['first_turn_ttft_ms_median']:23.1f} {r['prefilled_tokens']:10d} "
            f"{r['resident_bytes'] / mib:13.1f}"
        )
    ttft_ratio = private["first_turn_ttft_ms_median"] / shared["first_turn_ttft_ms_median"]
    mem_ratio = private["resident_bytes"] / shared["resident_bytes"]
    print(
        f"sharing: first-turn TTFT {ttft_ratio:.1f}x faster, {mem_ratio:.1f}x less resident "
        f"memory; same tokens: {'yes' if same else 'NO'}"
    )

    record = {
        "args": vars(args),
        "same_tokens": same,
        "ttft_ratio": ttft_ratio,
        "memory_ratio": mem_ratio,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    if not same:
        raise SystemExit("sharing changed the generated tokens")


if __name__ == "__main__":
    main()
