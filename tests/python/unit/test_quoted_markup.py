"""Markup inside a call's strings does not close the call: the parser reads
the JSON (or LFM2's Python) as what it is, fed whole or a character at a
time, and the text around the calls is given out as it came."""

from __future__ import annotations

import json

import pytest
from kvchat.agents import ToolCallParser
from kvchat.agents.formats import APRIEL, HERMES, KIMI, LFM2, MISTRAL_V11

VALUE = 'a</tool_call>b<|tool_call_end|>c[TOOL_CALLS]d</tool_calls>e```f\\"<g'
CALLS = [
    (HERMES, '<tool_call>\n{{"name": "f", "arguments": {{"s": {v}}}}}\n</tool_call>'),
    (APRIEL, '<tool_calls>[{{"name": "f", "arguments": {{"s": {v}}}}}]</tool_calls>'),
    (
        KIMI,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{{"s": {v}}}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    (MISTRAL_V11, '[TOOL_CALLS]f[ARGS]{{"s": {v}}}'),
    (LFM2, "<|tool_call_start|>[f(s={v})]<|tool_call_end|>"),
]


def _read(fmt, text: str, whole: bool):
    parser = ToolCallParser(fmt)
    for piece in [text] if whole else list(text):
        parser.feed(piece)
    parser.finish()
    return parser


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "by-character"])
@pytest.mark.parametrize("fmt, call", CALLS, ids=[f.name for f, _ in CALLS])
def test_a_string_holding_closing_markup_stays_in_the_call(fmt, call, whole):
    text = "Sure. " + call.format(v=json.dumps(VALUE))
    parser = _read(fmt, text, whole)
    assert parser.content == "Sure. ", parser.content
    (read,) = parser.calls
    assert json.loads(read.arguments) == {"s": VALUE}


def test_lfm2s_single_quoted_strings_hold_markup_too():
    text = "<|tool_call_start|>[f(s='x<|tool_call_end|>y', t=\"<|tool_call_end|>\")]"
    parser = _read(LFM2, text + "<|tool_call_end|>", whole=False)
    (call,) = parser.calls
    assert json.loads(call.arguments) == {"s": "x<|tool_call_end|>y", "t": "<|tool_call_end|>"}


def test_text_around_the_calls_is_given_out_as_it_came():
    """Quotes and brackets in prose (outside any value) are not strings: the
    markup after them is read, and the prose is untouched."""
    call = CALLS[0][1].format(v='"x"')
    text = 'He said "<b>" [1] ' + call + ' then "it\'s <i>"'
    parser = _read(HERMES, text, whole=False)
    assert parser.content == 'He said "<b>" [1]  then "it\'s <i>"', parser.content
    assert [c.name for c in parser.calls] == ["f"]
