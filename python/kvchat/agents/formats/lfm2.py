"""LFM2 / LFM2.5: a Python list of calls."""

from __future__ import annotations

from .base import EACH, CallGrammar, ToolFormat, section

LFM2 = ToolFormat(  # LFM2 / LFM2.5: a Python list of calls
    "lfm2",
    markers=("<|tool_call_start|>",),
    spec=section(
        r"\s*<\|tool_call_start\|>",
        "<|tool_call_end|>",
        "python-call-list",
        EACH,
        transform_each=True,
    ),
    grammar=CallGrammar(
        "",
        ")",
        separator=", ",
        section_open="<|tool_call_start|>[",
        section_close="]<|tool_call_end|>",
        name_in_json=False,
        name_close="(",
        keyword_arguments=True,
    ),
)
