"""A reply cut short (max_tokens, a stop string) after complete calls: the
parser keeps them as calls and drops only the call it was cut inside, on
every markup a forced call may write several calls in."""

from __future__ import annotations

import pytest
from grammar_walks import TOOLS, tiny_grammars, walk
from kvchat.agents import ToolCallParser
from kvchat.agents.formats import (
    APRIEL,
    COHERE,
    DEEPSEEK_R1,
    DEEPSEEK_V4,
    DEEPSEEK_V31,
    DEEPSEEK_V32,
    GLM,
    HERMES,
    HY3,
    KIMI,
    LFM2,
    MINIMAX,
    MINIMAX_M1,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON_V2,
    QWEN_XML,
    SEED_OSS,
)

# The markups a forced call may write several calls in (one call a reply in
# Llama 3's JSON, gpt-oss's harmony and GigaChat's).
PARALLEL_FORMATS = [
    HERMES, APRIEL, MISTRAL_V3, MISTRAL_V11, KIMI, DEEPSEEK_V31, QWEN_XML, GLM, MINIMAX, LFM2,
    NEMOTRON_V2, COHERE, SEED_OSS, HY3, DEEPSEEK_V32, DEEPSEEK_V4, DEEPSEEK_R1, MINIMAX_M1,
]  # fmt: skip


def _read(fmt, text: str, cut: bool):
    parser = ToolCallParser(fmt, TOOLS)
    parser.feed(text)
    parser.finish(cut=cut)
    return parser


@pytest.mark.parametrize("fmt", PARALLEL_FORMATS, ids=lambda f: f.name)
def test_a_cut_after_complete_calls_keeps_them_and_drops_the_cut_one(fmt):
    grammars, g = tiny_grammars(), fmt.grammar
    one = walk(grammars, grammars.tool_calls(fmt, TOOLS, parallel=False), 0, limit=4000)
    body = one[len(g.section_open) : len(one) - len(g.section_close)]
    first = g.section_open + body
    both = first + g.separator + body
    two = both + g.section_close
    (call,) = _read(fmt, one, cut=False).calls
    # The second call complete: a newline after its closing tag aside (where
    # the newline is not the close itself, as MiniMax-M1's line is).
    whole = len(both.rstrip()) if g.call_close.strip() else len(both)
    for end in range(len(first), len(two)):
        parser = _read(fmt, two[:end], cut=True)
        expected = 2 if end >= whole else 1
        assert len(parser.calls) == expected, (end, two[:end])
        assert parser.content.strip() == "", (end, parser.content)
        assert all((c.name, c.arguments) == (call.name, call.arguments) for c in parser.calls)
        if end < whole and two[len(first) : end].strip():  # a call begun: dropped
            assert parser.cut, (end, two[:end])
    # Cut inside the first call: nothing is whole, the markup is text as it came.
    inside = first.rstrip()[:-1]
    parser = _read(fmt, inside, cut=True)
    assert parser.calls == [] and parser.content == inside


@pytest.mark.parametrize("fmt", [HERMES, LFM2], ids=lambda f: f.name)
def test_a_reply_that_ended_by_itself_inside_a_call_stays_text(fmt):
    """Only a cut reply drops a call: one the model ended inside (no grammar)
    is markup that does not parse, text as it came."""
    grammars, g = tiny_grammars(), fmt.grammar
    one = walk(grammars, grammars.tool_calls(fmt, TOOLS, parallel=False), 0, limit=4000)
    body = one[len(g.section_open) : len(one) - len(g.section_close)]
    text = g.section_open + body + g.separator + body[:-2]
    parser = _read(fmt, text, cut=False)
    assert parser.calls == [] and parser.content == text
