"""The grammars constrained turns run under, without a model: a seeded random
walk through each grammar (any allowed token, as a model might pick) writes
text that the same format's parser reads back as calls of the given tools
with arguments their schemas allow, or as the JSON the schema allows."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from kvchat.agents import ToolCall, ToolCallParser
from kvchat.agents.formats import (
    APRIEL,
    GLM,
    HERMES,
    KIMI,
    LFM2,
    LLAMA3_JSON,
    MISTRAL_V3,
    MISTRAL_V11,
    QWEN_XML,
)
from kvchat.agents.grammar import GrammarError, Grammars
from kvchat.tiny import tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
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
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "local"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
CONSTRAINABLE = [HERMES, APRIEL, MISTRAL_V3, MISTRAL_V11, KIMI, LLAMA3_JSON]


def _grammars() -> Grammars:
    tokenizer = tiny_tokenizer()
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _walk(grammars: Grammars, grammar: str, seed: int, limit: int = 1000) -> str:
    """The text of a random walk through ``grammar`` to its end."""
    tokenizer = grammars._tokenizer
    processor = grammars.processor(grammar, "x")
    matcher, rng, out = processor._matcher, random.Random(seed), []
    for _ in range(limit):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: len(tokenizer)])
        assert allowed.size, matcher.get_error()
        if tokenizer.eos_token_id in allowed and (allowed.size == 1 or rng.random() < 0.8):
            return tokenizer.decode(out)
        token = int(rng.choice([t for t in allowed if t != tokenizer.eos_token_id]))
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(f"the walk did not end: {tokenizer.decode(out)!r}")


def _read(fmt, text: str) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(fmt, TOOLS)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls


def _allowed(call: ToolCall) -> bool:
    arguments = json.loads(call.arguments)
    if call.name == "get_weather":
        return arguments["unit"] in ("c", "f") and isinstance(arguments["hourly"], bool)
    return call.name == "get_time" and arguments == {"zone": arguments["zone"]}


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_what_a_tool_grammar_lets_a_model_write_parses_as_calls(fmt, parallel):
    grammars = _grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=parallel)
    counts = set()
    for seed in range(12):
        text = _walk(grammars, grammar, seed)
        content, calls = _read(fmt, text)
        assert calls and all(_allowed(c) for c in calls), text
        assert content.strip() == "", text
        counts.add(len(calls))
    if not parallel or fmt is LLAMA3_JSON:  # Llama writes one call a reply
        assert counts == {1}


def test_a_named_function_is_the_only_one_the_grammar_allows():
    grammars = _grammars()
    grammar = grammars.tool_calls(HERMES, TOOLS[1:], parallel=False)
    for seed in range(8):
        _, calls = _read(HERMES, _walk(grammars, grammar, seed))
        assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL_V11, LLAMA3_JSON], ids=lambda f: f.name)
def test_tools_beside_a_json_format_allow_a_call_or_the_json(fmt):
    """tool_choice auto with a response_format: the model may call a tool, or
    answer in the format; both are read back as what they are."""
    grammars = _grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=False, or_json=ANSWER)
    kinds = set()
    for seed in range(24):
        text = _walk(grammars, grammar, seed)
        content, calls = _read(fmt, text)
        if calls:
            assert content.strip() == "" and all(_allowed(c) for c in calls), text
            kinds.add("call")
        else:
            assert isinstance(json.loads(content)["ok"], bool), text
            kinds.add("json")
    assert kinds == {"call", "json"}


@pytest.mark.parametrize("fmt", [QWEN_XML, GLM, LFM2], ids=lambda f: f.name)
def test_markup_kvchat_cannot_constrain_is_refused_by_name(fmt):
    with pytest.raises(GrammarError, match=fmt.name) as error:
        _grammars().tool_calls(fmt, TOOLS)
    assert error.value.param == "tool_choice"


def test_a_schema_llguidance_refuses_names_the_field():
    grammars = _grammars()
    with pytest.raises(GrammarError) as error:
        grammars.processor(grammars.json_schema({"type": "nonsense"}), "response_format")
    assert error.value.param == "response_format" and "nonsense" in str(error.value)
