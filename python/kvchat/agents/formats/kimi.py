"""Kimi-K2: a section of calls named functions.NAME:INDEX."""

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
