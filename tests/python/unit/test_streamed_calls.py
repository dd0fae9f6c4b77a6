"""A forced call followed as it is written (``CallStream``): on what each
tool-call grammar lets a model write (a seeded random walk, no model), fed
whole, one character and three at a time, every call starts with its name
before its arguments, and the pieces join into the arguments the parser
reads back; text that is not the grammar's is not followed."""

from __future__ import annotations

import json

import pytest
from grammar_walks import TOOLS, tiny_grammars, walk
from kvchat.agents import ToolCall, ToolCallParser
from kvchat.agents.formats import (
    APRIEL,
    COHERE,
    DEEPSEEK_R1,
    DEEPSEEK_V31,
    DEEPSEEK_V32,
    GEMMA4,
    GIGACHAT,
    GLM,
    HARMONY,
    HERMES,
    HY3,
    KIMI,
    LFM2,
    LLAMA3_JSON,
    MINIMAX,
    MINIMAX_M1,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON_V2,
    QWEN_XML,
    SEED_OSS,
    SOLAR,
)
from kvchat.agents.streamed_calls import CallArguments, CallStart, CallStream, streamable

FOLLOWED = [
    HERMES,
    APRIEL,
    MISTRAL_V3,
    MISTRAL_V11,
    KIMI,
    LLAMA3_JSON,
    HARMONY,
    DEEPSEEK_V31,
    DEEPSEEK_R1,
    NEMOTRON_V2,
    COHERE,
    GIGACHAT,
    MINIMAX_M1,
    QWEN_XML,
    GLM,
    MINIMAX,
    SEED_OSS,
    HY3,
    DEEPSEEK_V32,
]


def _follow(fmt, text: str, step: int) -> tuple[list, list[ToolCall]]:
    stream, items = CallStream(fmt, TOOLS), []
    for i in range(0, len(text), step):
        items += stream.feed(text[i : i + step])
    parser = ToolCallParser(fmt, TOOLS)
    parser.feed(text)
    parser.finish()
    return items, stream.settle(parser.calls)


@pytest.mark.parametrize("fmt", FOLLOWED, ids=lambda f: f.name)
def test_each_call_starts_with_its_name_and_its_pieces_join_into_its_arguments(fmt):
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=True)
    pieces_seen = 0
    for seed in range(6):
        text = walk(grammars, grammar, seed, limit=4000)  # Hy3's long tags
        for step in (1, 3, len(text)):
            items, calls = _follow(fmt, text, step)
            starts = [i for i in items if isinstance(i, CallStart)]
            assert [(s.index, s.name) for s in starts] == [(i, c.name) for i, c in enumerate(calls)]
            assert [s.id for s in starts] == [c.id for c in calls]
            for index, call in enumerate(calls):
                pieces = [i for i in items if isinstance(i, CallArguments) and i.index == index]
                # Each piece after its call's start, and together its arguments.
                assert items.index(pieces[0]) > items.index(starts[index])
                assert "".join(p.text for p in pieces) == call.arguments, text
                arguments = json.loads(call.arguments)
                assert isinstance(arguments, dict)
                if fmt.grammar.xml is not None:  # one piece a value, then the brace
                    assert len(pieces) == len(arguments) + 1, (pieces, text)
                pieces_seen = max(pieces_seen, len(pieces))
    assert pieces_seen > (2 if fmt.grammar.xml else 10)  # the arguments came in pieces


@pytest.mark.parametrize("fmt", [HERMES, KIMI, HARMONY, QWEN_XML], ids=lambda f: f.name)
def test_text_that_is_not_the_grammars_is_not_followed(fmt):
    for text in ("Sure, here you go.", "<tool_call>\nnot json", " to=functions.f<|chan"):
        items, _ = _follow(fmt, text, 1)
        assert not [i for i in items if isinstance(i, CallArguments)], (fmt.name, text)


def test_only_python_calls_and_formats_without_a_grammar_are_given_whole():
    assert all(streamable(f) for f in FOLLOWED)
    assert not any(streamable(f) for f in (LFM2, GEMMA4, SOLAR, None))
