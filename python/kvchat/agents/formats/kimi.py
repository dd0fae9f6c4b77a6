"""Kimi: K2's section of calls named functions.NAME:INDEX, K3's tagged channels."""

from __future__ import annotations

from .base import CALL, CallGrammar, ToolFormat, section

KIMI = ToolFormat(  # Kimi-K2: a section of calls named functions.NAME:INDEX
    "kimi-k2",
    markers=("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    spec=section(
        r"\s*<\|tool_call_begin\|>\s*"
        r"(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>",
        "<|tool_call_end|>",
        "json",
        CALL,
    ),
    grammar=CallGrammar(
        "<|tool_call_begin|>functions.",
        "<|tool_call_end|>",
        separator="",
        section_open="<|tool_calls_section_begin|>",
        section_close="<|tool_calls_section_end|>",
        name_in_json=False,
        name_close=":0<|tool_call_argument_begin|>",
    ),
    ignore=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
)
# Kimi-K3: the reply's response channel, then a tools channel of calls, each
# <|open|>call tool="NAME" index="N"<|sep|>, one argument a tag that says its
# JSON type; a string's value is its text, any other JSON. The markup around
# the calls (the channels' ends) is not content. Not constrained: the type a
# value's tag says depends on the value, and CallGrammar writes one tag for
# every value that is not a string.
_K3_TAGS = ("<|close|>response<|sep|>", "<|open|>tools<|sep|>")
_K3_AFTER = ("<|close|>tools<|sep|>", "<|close|>message<|sep|>")
KIMI_K3 = ToolFormat(
    "kimi-k3",
    markers=("".join(_K3_TAGS), _K3_TAGS[1]),
    spec=section(
        r"\s*(?:<\|close\|>response<\|sep\|>)?\s*(?:<\|open\|>tools<\|sep\|>)?\s*"
        r'<\|open\|>call tool="(?P<name>[^"\n]+)"(?: index="\d+")?<\|sep\|>',
        "<|close|>call<|sep|>",
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": (
                r'<\|open\|>argument key="(?P<key>[^"\n]+)" type="\w+"<\|sep\|>'
                r"(?P<value>.*?)<\|close\|>argument<\|sep\|>"
            )
        },
    ),
    ignore=_K3_TAGS + _K3_AFTER,
)
