"""Hybrid models against the attention preset: multi-turn TTFT, one run.

    python benchmarks/hybrid.py --turns 10

Runs benchmarks/multiturn.py for each model in turn (the same conversation
shape and seed), then prints one table of the ratios that matter for a model
whose layers cannot crop (conv, DeltaNet, Mamba2): the first turn against
plain generate, the later turns against the limit (one forward over only the
new tokens), and the last turn against the baseline. Each model's CSV and JSON
go to --out as multiturn.py writes them, plus hybrid-<device>.json and a plot.
With --compile, a line per model gives what torch.compile compiled in kvchat's
turns: "kvchat's compiles: turn 1 N, turns 2+ M" (the JSON's "compiles",
[N, M]; the promise: M is 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import multiturn

DEFAULT_MODELS = ["smollm2-135m", "lfm2-350m", "qwen3.5-0.8b", "falcon-h1-0.5b"]
# What kvchat must reach (with settling on; benchmarks/RESULTS.md), printed
# beside the ratios.
TARGETS = {
    "turn 1: kvchat / plain generate": ("<=", 1.05),
    "later turns: kvchat / limit": ("<=", 1.10),
    "last turn: baseline / kvchat": (">=", 5.0),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--shape", choices=sorted(multiturn.SHAPES), default="agent")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoints", choices=["last", "every"], default="last")
    parser.add_argument("--replies", choices=multiturn.REPLIES, default="words")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="sets of new conversations per model (multiturn.py)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="kvchat decodes compiled (multiturn.py --compile; docs/compiled-decode.md)",
    )
    parser.add_argument(
        "--first-turn-pairs",
        type=int,
        default=8,
        help="first turns run back to back through plain generate and kvchat (first_turn.py)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be >= 2: the later turns are what reuse")
    return args


def ratios(result: dict, turns: int) -> dict:
    r = result["summary"]["ratios"]
    # Turn 1 from back-to-back pairs (first_turn.py) where they ran; the
    # replay's single turn-1 sample per repeat is mostly this machine's noise.
    paired = r.get("turn-1 TTFT kvchat / baseline, paired median")
    row = {
        "turn 1: kvchat / plain generate": r["turn-1 TTFT kvchat / baseline"]
        if paired is None
        else paired,
        "turn 1 in the replay": r["turn-1 TTFT kvchat / baseline"],
        "later turns: kvchat / limit": r[f"turns 2-{turns} TTFT kvchat / limit"],
        "later turns: kvchat / hf-reuse": r[f"turns 2-{turns} TTFT kvchat / hf-reuse"],
        "last turn: baseline / kvchat": r["last-turn TTFT baseline / kvchat"],
    }
    # kvchat's tokens against plain generate's (hf-reuse continues from the
    # wrong ids when a reply does not re-tokenize, and so differs there).
    row["same tokens"] = result["summary"]["kvchat"]["same_tokens_all"]
    row["hit rate"] = result["summary"]["kvchat"]["hit_rate"]
    row["settle ms"] = result["summary"]["kvchat"]["settle_ms_mean"]
    row["compiles"] = (
        result["summary"]["kvchat"].get("compiles_turn_1", 0),
        result["summary"]["kvchat"].get("compiles_later_turns", 0),
    )
    row["turn 1 each repeat"] = result["summary"]["kvchat"].get("turn1_vs_baseline_each_repeat")
    pairs = result["summary"]["kvchat"].get("turn1_pairs")
    row["turn 1 each pair"] = None if pairs is None else pairs["each"]
    row["same tokens"] = row["same tokens"] and (pairs is None or pairs["same_tokens"])
    return row


def meets(name: str, value: float) -> str:
    if name not in TARGETS:
        return ""
    op, bound = TARGETS[name]
    ok = value <= bound if op == "<=" else value >= bound
    return "" if ok else " (misses)"


def format_table(rows: dict[str, dict]) -> str:
    extra = (
        "same tokens",
        "hit rate",
        "settle ms",
        "compiles",
        "turn 1 each repeat",
        "turn 1 each pair",
    )
    names = [k for k in next(iter(rows.values())) if k not in extra]
    lines = [
        f"| model | {' | '.join(names)} | kvchat hit rate | settle ms / turn | same tokens |",
        "|---|" + "---:|" * (len(names) + 2) + ":---:|",
    ]
    for model, row in rows.items():
        cells = [f"{row[n]:.2f}×{meets(n, row[n])}" for n in names]
        lines.append(
            f"| {model} | {' | '.join(cells)} | {row['hit rate']:.0%} | {row['settle ms']:.0f} | "
            f"{'yes' if row['same tokens'] else 'NO'} |"
        )
    lines.append("")
    for model, row in rows.items():
        if row.get("turn 1 each repeat"):
            each = ", ".join(f"{v:.2f}" for v in row["turn 1 each repeat"])
            lines.append(f"{model}, turn 1 kvchat / plain generate in each repeat: {each}")
        if row.get("turn 1 each pair"):
            each = ", ".join(f"{v:.2f}" for v in row["turn 1 each pair"])
            lines.append(f"{model}, turn 1 kvchat / plain generate in each pair: {each}")
        first, later = row.get("compiles", (0, 0))
        if first or later:
            lines.append(f"{model}, kvchat's compiles: turn 1 {first}, turns 2+ {later}")
    lines.append(
        "targets: " + ", ".join(f"{name} {op} {bound}" for name, (op, bound) in TARGETS.items())
    )
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6), squeeze=False)
    for ax, (model, result) in zip(axes[0], results.items(), strict=True):
        for mode in ("baseline", "hf-reuse", "kvchat", "limit"):
            if mode in result["summary"]:
                per_turn = multiturn._per_turn(result["rows"], mode)
                ax.plot(list(per_turn), list(per_turn.values()), marker="o", label=mode)
        ax.set_title(model)
        ax.set_xlabel("turn")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time to first token (ms)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results, rows = {}, {}
    for model in args.models:
        print(f"\n=== {model} ===", flush=True)
        result = multiturn.main(
            [
                f"--model={model}",
                f"--turns={args.turns}",
                f"--shape={args.shape}",
                f"--dtype={args.dtype}",
                f"--device={args.device}",
                f"--checkpoints={args.checkpoints}",
                f"--seed={args.seed}",
                f"--repeats={args.repeats}",
                f"--replies={args.replies}",
                f"--out={args.out}",
                f"--first-turn-pairs={args.first_turn_pairs}",
                "--no-plot",
                *(["--compile"] if args.compile else []),
            ]
        )
        results[model], rows[model] = result, ratios(result, args.turns)
    table = format_table(rows)
    print(f"\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    replies = "" if args.replies == "words" else f"-{args.replies}"
    stem = args.out / f"hybrid{replies}-{args.device}"
    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    summary = dict(command=command, config=vars(args) | {"out": str(args.out)}, ratios=rows)
    Path(f"{stem}.json").write_text(json.dumps(summary, indent=2))
    plot(results, Path(f"{stem}.png"))
    print(f"\nwrote {stem}.json, .png")
    return summary


if __name__ == "__main__":
    main()
