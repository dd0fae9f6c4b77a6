"""MiniMax: M1's JSON lines in <tool_calls>, M2's <invoke> XML."""

from __future__ import annotations

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
