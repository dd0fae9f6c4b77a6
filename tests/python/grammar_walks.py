"""What the tool-call tests share without a model: the tools they call and
a seeded random walk through a grammar (any allowed token, as a model might
pick), for ``exact/test_grammar.py`` and ``unit/test_streamed_calls.py``."""

from __future__ import annotations

import random

import numpy as np
from kvchat.agents.grammar import Grammars
from kvchat.tiny import tiny_tokenizer

# Two tools of enums and booleans: any walk through them closes in a few tokens.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather.",  # gpt-oss's template reads it
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
                "required": ["unit", "hourly"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "local"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def tiny_grammars() -> Grammars:
    """Grammars for the tiny tokenizer, no model needed."""
    tokenizer = tiny_tokenizer()
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def walk(grammars: Grammars, grammar: str, seed: int, limit: int = 1000, close="") -> str:
    """The text of a random walk through ``grammar`` to its end. ``close``: a
    text the walk sometimes writes when the grammar allows it (where free
    text ends at a tag, as a model ends it; random tokens never spell it)."""
    tokenizer = grammars._tokenizer
    processor = grammars.processor(grammar, "x")
    matcher, rng, out = processor._matcher, random.Random(seed), []
    closing = tokenizer(close, add_special_tokens=False)["input_ids"] if close else []
    for _ in range(limit):
        if closing and rng.random() < 0.1 and matcher.validate_tokens(closing) == len(closing):
            assert matcher.consume_tokens(closing)
            out += closing
            continue
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: len(tokenizer)])
        assert allowed.size, matcher.get_error()
        if tokenizer.eos_token_id in allowed and (allowed.size == 1 or rng.random() < 0.8):
            return tokenizer.decode(out)
        token = int(rng.choice([t for t in allowed if t != tokenizer.eos_token_id]))
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(f"the walk did not end: {tokenizer.decode(out)!r}")
