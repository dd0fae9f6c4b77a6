"""MiniMax: M1's JSON lines in <tool_calls>, M2's and M3's <invoke> XML."""

from __future__ import annotations

import re

from .base import CALL, CALL_FROM_JSON, CallGrammar, ToolFormat, section

# MiniMax-M1: one {"name": ..., "arguments": ...} per line in <tool_calls>; a
# call ends with its line (JSON text has no raw newline).
MINIMAX_M1 = ToolFormat(
    "minimax-m1",
    markers=("<tool_calls>",),
    spec=section(r"\s*(?:<tool_calls>)?\s*(?=\{)", "\n", "json", CALL_FROM_JSON),
    grammar=CallGrammar(
        "", "\n", separator="", section_open="<tool_calls>\n", section_close="</tool_calls>"
    ),
    ignore=("<tool_calls>", "</tool_calls>"),
)
MINIMAX = ToolFormat(  # MiniMax-M2: <invoke name=...> XML calls in a <minimax:tool_call> block
    "minimax",
    markers=("<minimax:tool_call>",),
    spec=section(
        r'\s*(?:<minimax:tool_call>)?\s*<invoke name="(?P<name>[^"\n]+)">',
        "</invoke>",
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": r'<parameter name="(?P<key>[^"\n]+)">(?P<value>.*?)</parameter>'
        },
    ),
    # As the template renders a call sent back, the newline before the block
    # included; values a string's text, anything else tojson.
    grammar=CallGrammar(
        '<invoke name="',
        "</invoke>\n",
        separator="",
        section_open="\n<minimax:tool_call>\n",
        section_close="</minimax:tool_call>",
        name_in_json=False,
        name_close='">\n',
        xml=('<parameter name="', '">', "</parameter>\n"),
    ),
    ignore=("<minimax:tool_call>", "</minimax:tool_call>"),
)
# MiniMax-M3: M2's <invoke name=...> calls in <tool_call>, every tag after the
# namespace token "]<]minimax[>[", and each argument a tag named by its key:
# <city>Paris</city>. Not constrained: a key's closing tag repeats the key,
# which CallGrammar's fixed value_close cannot write. Values are read back
# cast by the tool's schema. An object or list, which the template writes as
# nested tags, not JSON, is not read as one: its value is the tags' text.
_NS = "]<]minimax[>["
_NS_RE = re.escape(_NS)
MINIMAX_M3 = ToolFormat(
    "minimax-m3",
    markers=(_NS + "<tool_call>",),
    spec=section(
        rf'\s*(?:{_NS_RE}<tool_call>)?\s*{_NS_RE}<invoke name="(?P<name>[^"\n]+)">',
        _NS + "</invoke>",
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": rf"{_NS_RE}<(?P<key>[^<>\s/]+)>(?P<value>.*?){_NS_RE}</(?P=key)>"
        },
    ),
    ignore=(_NS + "<tool_call>", _NS + "</tool_call>"),
)
