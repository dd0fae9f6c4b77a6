"""Multi-turn latency: baseline vs hf-reuse vs kvchat vs the limit, side by side.

    python benchmarks/multiturn.py --model smollm2-135m --turns 10

Every turn of every session runs through each mode on the same conversation,
one mode after the other, so the ratios come from one run on one machine.
Writes CSV, JSON and a PNG plot to --out. A kvchat mode's CSV rows count in
``compiles`` the frames torch.compile compiled during that turn; the JSON
summary sums them as ``compiles_turn_1`` and ``compiles_later_turns``, and the
table prints them for a mode that compiled.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import first_turn
import torch
from kvchat.prompting import render_prompt
from kvchat.tiny import words_only
from modes import Baseline, HfReuse, Kvchat, Limit, StaticCompiled, recurrent_only
from tqdm import tqdm
from workload import PRESETS, TINY, load_model, make_conversation

MODES = ("baseline", "hf-reuse", "kvchat", "limit", "static+compile", "kvchat+compile")
# The compiled modes (docs/compiled-decode.md) run only when asked (--modes):
# their first turns compile, which takes minutes on a CPU.
DEFAULT_MODES = MODES[:4]
# What the client sends back after each reply (--replies): "words", replies
# kept to whole-word tokens, so they re-tokenize as generated; "raw", the
# model's own tokens, which mostly do not; "agent", raw replies in an agent
# loop: every third reply is read as a tool call (sent back as tool_calls, then
# the tool's result), every third carries a reasoning block the template drops
# from history, the rest go back as they came.
REPLIES = ("words", "raw", "agent")
# ChatML with tool calls (kvchat.tiny's), dropping <think> blocks from history
# as Qwen3's template does.
_THINK = (
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
)
SHAPES = {
    # (system, user, reply) token ranges
    "chat": ((300, 1000), (20, 200), (50, 300)),
    "short": ((120, 200), (10, 40), (8, 24)),
    # An agent loop: a long system prompt, tool results, short replies (calls).
    "agent": ((300, 1000), (20, 200), (8, 32)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=TINY,
        help=f"{TINY!r} (embedded), a preset {sorted(PRESETS)}, or a local checkpoint directory",
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=1, help="conversations, interleaved")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="replay that many sets of new conversations, each from a fresh start; "
        "per-turn times are their mean",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the kvchat mode decodes compiled (SessionManager(compile=True)), so every "
        "kvchat ratio is the compiled path's; the first turn's decode compiles",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replies", choices=REPLIES, default="words")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--first-turn-pairs",
        type=int,
        default=8,
        help="new conversations whose first turn runs through plain generate and kvchat back "
        "to back (first_turn.py); the turn-1 ratio is their median (0: skip)",
    )
    parser.add_argument(
        "--checkpoints",
        choices=["last", "every"],
        default="last",
        help="kvchat's checkpoint placement (SessionManager(checkpoints=...))",
    )
    args = parser.parse_args(argv)
    if args.turns < 1 or args.sessions < 1 or args.repeats < 1:
        parser.error("--turns, --sessions and --repeats must be >= 1")
    if args.first_turn_pairs < 0:
        parser.error("--first-turn-pairs must be >= 0")
    if "baseline" not in args.modes:
        parser.error("--modes must include baseline: the other modes are checked against it")
    return args


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype, args.device, args.seed)
    if args.replies == "agent":
        tokenizer.chat_template = _agent_template(tokenizer.chat_template)
    if "hf-reuse" in args.modes and recurrent_only(model):
        # transformers' recipe hands a cache back to generate, which cannot
        # count or crop a cache of recurrent layers alone.
        raise SystemExit(
            f"--modes hf-reuse needs a cache that can be cropped, and {args.model}'s holds "
            "recurrent layers alone; leave it out (--modes baseline kvchat limit)"
        )
    suppress = None
    if args.replies == "words":
        suppress = words_only(tokenizer, model.config.get_text_config().vocab_size)
    # Warm up kernels and allocators outside the measurement.
    warm = render_prompt(tokenizer, [{"role": "user", "content": "hello"}])
    model.generate(warm[None].to(model.device), max_new_tokens=4, do_sample=False)
    rows = []
    steps = tqdm(total=args.repeats * args.turns * args.sessions, desc="turns", unit="turn")
    for repeat in range(args.repeats):
        # Fresh modes (a new SessionManager) and new conversations each repeat,
        # so every repeat's turn 1 is a cold first turn.
        rows += _replay(args, model, tokenizer, suppress, repeat, steps)
    steps.close()
    summary = summarize(rows, args.turns)
    if args.first_turn_pairs and "kvchat" in args.modes:
        extra = {"no_repeat_ngram_size": 3}
        if suppress is not None:
            extra["suppress_tokens"] = suppress
        print(f"turn 1 in {args.first_turn_pairs} pairs (first_turn.py)", flush=True)
        pairs = first_turn.paired(
            model,
            tokenizer,
            args.first_turn_pairs,
            SHAPES[args.shape],
            args.seed,
            extra,
            checkpoints=args.checkpoints,
            compile=args.compile,
        )
        summary["kvchat"]["turn1_pairs"] = pairs
        summary["ratios"]["turn-1 TTFT kvchat / baseline, paired median"] = pairs["median"]
    return dict(config=_config(args, model), rows=rows, summary=summary)


def _replay(args, model, tokenizer, suppress, repeat: int, steps) -> list[dict]:
    """Every turn of args.sessions conversations through each mode, interleaved."""
    seed = args.seed + repeat * args.sessions
    system_range, user_range, reply_range = SHAPES[args.shape]
    conversations = [
        make_conversation(tokenizer, seed + s, args.turns, system_range, user_range, reply_range)
        for s in range(args.sessions)
    ]
    # One shared system prompt, as an app serving many users has.
    system = {"role": "system", "content": conversations[0].system}
    system_ids = torch.tensor(
        tokenizer(
            tokenizer.apply_chat_template([system], tokenize=False), add_special_tokens=False
        )["input_ids"]
    )
    # Built only when asked: each kvchat mode probes the model once.
    factories = {
        "baseline": lambda: Baseline(model, tokenizer),
        "hf-reuse": lambda: HfReuse(model, tokenizer, system_ids),
        "kvchat": lambda: Kvchat(
            model, tokenizer, args.sessions, checkpoints=args.checkpoints, compile=args.compile
        ),
        "limit": lambda: Limit(model, tokenizer),
        "static+compile": lambda: StaticCompiled(model, tokenizer),
        "kvchat+compile": lambda: Kvchat(
            model,
            tokenizer,
            args.sessions,
            name="kvchat+compile",
            checkpoints=args.checkpoints,
            compile=True,
        ),
    }
    modes = {name: factories[name]() for name in args.modes}
    histories = {f"s{s}": [system] for s in range(args.sessions)}
    following = {session: "user" for session in histories}  # the role of each next message
    rows = []
    for turn in range(args.turns):
        for s, session in enumerate(histories):
            conversation = conversations[s]
            new = {"role": following[session], "content": conversation.user_turns[turn]}
            if new["role"] == "tool":
                new["tool_call_id"] = f"call_{turn - 1}"
            messages = histories[session] + [new]
            prompt = render_prompt(tokenizer, messages)
            reply_len = conversation.reply_tokens[turn]
            generate_kwargs = dict(
                max_new_tokens=reply_len,
                min_new_tokens=reply_len,
                do_sample=False,
                # A random model loops, which a trained one rarely does; a loop
                # would trip kvchat's repetition check and re-prefill the reply.
                no_repeat_ngram_size=3,
            )
            if suppress is not None:
                generate_kwargs["suppress_tokens"] = suppress
            reference = None
            for name, mode in modes.items():
                m = mode.turn(session, messages, prompt, generate_kwargs, reference)
                if reference is None:
                    reference = m.output_ids
                same = m.output_ids == reference[: len(m.output_ids)]
                rows.append(
                    dict(
                        mode=name,
                        session=session,
                        repeat=repeat,
                        turn=turn + 1,
                        prompt_tokens=prompt.numel(),
                        prefilled=m.prefilled,
                        reused=m.reused,
                        ttft_ms=round(m.ttft_ms, 3),
                        decode_tps=None if m.decode_tps is None else round(m.decode_tps, 2),
                        held_mib=round(m.held_bytes / 2**20, 2),
                        peak_mib=round(m.peak_bytes / 2**20, 2),
                        same_tokens=same,
                        settle_ms=round(m.settle_ms, 3),
                        compiles=m.compiles,
                    )
                )
            reply = tokenizer.decode(reference, skip_special_tokens=True)
            sent, following[session] = _sent_back(args.replies, turn, reply)
            histories[session] = messages + [sent]
            if sent != {"role": "assistant", "content": reply}:
                for mode in modes.values():
                    mode.sent_back(session, histories[session])
                if "kvchat" in modes:  # settled again, on what was sent
                    rows[-len(modes) + list(modes).index("kvchat")]["settle_ms"] += round(
                        modes["kvchat"].settled(), 3
                    )
            steps.update()
    return rows


def _agent_template(template: str) -> str:
    """The tokenizer's ChatML template, dropping <think> blocks from history."""
    plain = "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>"
    if plain not in template:
        raise SystemExit("--replies agent needs kvchat.tiny's ChatML template")
    dropping = "{% else %}" + _THINK + "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>"
    return template.replace(plain, dropping)


def _sent_back(replies: str, turn: int, reply: str) -> tuple[dict, str]:
    """(the assistant message the client sends back, the next message's role)."""
    if replies == "agent" and turn % 3 == 0:
        call = {"name": "search", "arguments": {"query": reply[:40]}}
        calls = [{"id": f"call_{turn}", "type": "function", "function": call}]
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool"
    if replies == "agent" and turn % 3 == 1:
        thought = f"<think>The user asked something; step {turn}.</think>\n"
        return {"role": "assistant", "content": thought + reply}, "user"
    return {"role": "assistant", "content": reply}, "user"


def _config(args, model) -> dict:
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.update(
        command="python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        parameters=sum(p.numel() for p in model.parameters()),
        torch=torch.__version__,
        machine=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else None,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    return config


def summarize(rows: list[dict], turns: int) -> dict:
    """Per mode: totals, the last turn, and ratios against baseline and limit."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        last = [r for r in mine if r["turn"] == turns]
        decode = [r["decode_tps"] for r in mine if r["decode_tps"]]
        out[mode] = dict(
            ttft_last_turn_ms=sum(r["ttft_ms"] for r in last) / len(last),
            ttft_total_ms=sum(r["ttft_ms"] for r in mine),
            hit_rate=sum(r["reused"] for r in mine)
            / max(sum(r["reused"] + r["prefilled"] for r in mine), 1),
            decode_tps_mean=sum(decode) / len(decode) if decode else None,
            peak_mib_max=max(r["peak_mib"] for r in mine),
            held_mib_last=max(r["held_mib"] for r in last),
            same_tokens_all=all(r["same_tokens"] for r in mine),
            # kvchat: prefill time settling spent between turns, off their path
            settle_ms_mean=sum(r.get("settle_ms", 0.0) for r in mine) / len(mine),
            # kvchat, compiled: what torch.compile compiled on turn 1 and after
            # (the promise: nothing after a shape has been seen)
            compiles_turn_1=sum(r.get("compiles", 0) for r in mine if r["turn"] == 1),
            compiles_later_turns=sum(r.get("compiles", 0) for r in mine if r["turn"] > 1),
        )
    if "kvchat" in out:
        k = out["kvchat"]["ttft_last_turn_ms"]
        out["ratios"] = {
            f"last-turn TTFT {m} / kvchat": out[m]["ttft_last_turn_ms"] / k
            for m in out
            if m not in ("kvchat", "ratios")
        }
        kvchat = _per_turn(rows, "kvchat")
        # Turn 1 has nothing to reuse: kvchat against plain generate there, and
        # against each other mode over the turns that could reuse.
        out["ratios"]["turn-1 TTFT kvchat / baseline"] = kvchat[1] / _per_turn(rows, "baseline")[1]
        repeats = sorted({r.get("repeat", 0) for r in rows})
        if len(repeats) > 1:  # the spread behind that mean
            out["kvchat"]["turn1_vs_baseline_each_repeat"] = [
                _per_turn(mine, "kvchat")[1] / _per_turn(mine, "baseline")[1]
                for mine in ([r for r in rows if r["repeat"] == k] for k in repeats)
            ]
        if turns > 1:
            for m in ("limit", "hf-reuse"):
                if m in out:
                    other = _per_turn(rows, m)
                    out["ratios"][f"turns 2-{turns} TTFT kvchat / {m}"] = sum(
                        kvchat[t] for t in range(2, turns + 1)
                    ) / sum(other[t] for t in range(2, turns + 1))
        if "hf-reuse" in out:
            by_turn = _per_turn(rows, "kvchat"), _per_turn(rows, "hf-reuse")
            out["ratios"]["worst turn TTFT kvchat / hf-reuse"] = max(
                by_turn[0][t] / by_turn[1][t] for t in by_turn[0]
            )
    return out


def _per_turn(rows, mode) -> dict[int, float]:
    turns = {}
    for r in rows:
        if r["mode"] == mode:
            turns.setdefault(r["turn"], []).append(r["ttft_ms"])
    return {t: sum(v) / len(v) for t, v in turns.items()}


def format_table(result: dict) -> str:
    rows, summary = result["rows"], result["summary"]
    modes = [m for m in summary if m != "ratios"]
    turns = sorted({r["turn"] for r in rows})
    lines = [" turn " + "".join(f"{m + ' TTFT ms':>18}" for m in modes)]
    per_turn = {m: _per_turn(rows, m) for m in modes}
    for t in turns:
        lines.append(f"{t:>5} " + "".join(f"{per_turn[m][t]:>18.1f}" for m in modes))
    lines.append("")
    header = (
        f"{'mode':<10}{'hit rate':>9}{'decode tok/s':>14}{'peak MiB':>10}{'same':>6}"
        f"{'settle ms/turn':>16}"
    )
    lines.append(header)
    for m in modes:
        s = summary[m]
        tps = "-" if s["decode_tps_mean"] is None else f"{s['decode_tps_mean']:.1f}"
        # Runs recorded before settling have no settle time.
        settle = s.get("settle_ms_mean")
        lines.append(
            f"{m:<10}{s['hit_rate']:>9.0%}{tps:>14}{s['peak_mib_max']:>10.1f}"
            f"{'yes' if s['same_tokens_all'] else 'NO':>6}"
            f"{'-' if settle is None else f'{settle:.1f}':>16}"
        )
    lines.append("")
    for name, value in summary.get("ratios", {}).items():
        lines.append(f"{name}: {value:.2f}")
    each = summary.get("kvchat", {}).get("turn1_vs_baseline_each_repeat")
    if each:
        lines.append(
            "turn-1 TTFT kvchat / baseline, each repeat: " + ", ".join(f"{v:.2f}" for v in each)
        )
    pairs = summary.get("kvchat", {}).get("turn1_pairs")
    if pairs:
        lines.append(
            f"turn-1 TTFT kvchat / plain generate, {pairs['pairs']} pairs: "
            + ", ".join(f"{v:.2f}" for v in pairs["each"])
            + f" (same tokens: {'yes' if pairs['same_tokens'] else 'NO'})"
        )
    for m in modes:  # what a compiled kvchat mode compiled, and when
        first = summary[m].get("compiles_turn_1", 0)
        later = summary[m].get("compiles_later_turns", 0)
        if first or later:
            lines.append(f"{m}: torch.compile compiled {first} frames on turn 1, {later} after")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, config = result["rows"], result["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in result["summary"]:
        if mode == "ratios":
            continue
        per_turn = _per_turn(rows, mode)
        ax.plot(list(per_turn), list(per_turn.values()), marker="o", label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{config['model']}, {config['dtype']}, {config['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    replies = "" if args.replies == "words" else f"-{args.replies}"
    stem = args.out / f"multiturn-{Path(args.model).name}{replies}-{args.device}"
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2, default=asdict))
    if not args.no_plot:
        plot(result, Path(f"{stem}.png"))
    print(format_table(result))
    print(f"\nwrote {stem}.csv, .json" + ("" if args.no_plot else ", .png"))
    return result


if __name__ == "__main__":
    main()
