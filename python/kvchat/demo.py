"""``python -m kvchat.demo``: replays a multi-turn chat on the embedded tiny
model through plain ``model.generate`` and through kvchat, and prints a
per-turn latency table."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .manager import SessionManager
from .prompting import render_prompt
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


@dataclass
class DemoRow:
    turn: int
    prompt_tokens: int
    reused: int
    prefilled: int
    plain_ms: float
    kvchat_ms: float
    same_tokens: bool


def replay(
    turns: int = 10,
    max_new_tokens: int = 24,
    family: str = "llama",
    size: str = "small",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> list[DemoRow]:
    """Runs the replay; both paths see the same conversation every turn."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(family, size, dtype=dtype, tokenizer=tokenizer)
    manager = SessionManager(model, tokenizer)
    generate_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    model.generate(
        render_prompt(tokenizer, [{"role": "user", "content": "warm up"}])[None], **generate_kwargs
    )

    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    rows = []
    for turn in tqdm(range(turns), desc="replaying turns", unit="turn", disable=not progress):
        messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
        prompt = render_prompt(tokenizer, messages)
        timer = FirstTokenTimer()
        plain = model.generate(prompt[None], **timer.attach(generate_kwargs))
        plain_ids = plain[0, prompt.numel() :]
        manager.chat("demo", messages, **generate_kwargs)
        report = manager.last_turn("demo")
        rows.append(
            DemoRow(
                turn + 1,
                prompt.numel(),
                report.reused_tokens,
                report.prefilled_tokens,
                timer.prefill_ms,
                report.prefill_ms,
                report.output_ids == tuple(plain_ids.tolist()),
            )
        )
        reply = tokenizer.decode(plain_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    return rows


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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    args = parser.parse_args(argv)
    rows = replay(args.turns, args.max_new_tokens, args.family, args.size)
    print(
        f"kvchat demo: tiny random {args.family} ({args.size}), float32, CPU, "
        f"{args.turns} turns, greedy, {args.max_new_tokens} new tokens per turn"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
