"""Hermes: one JSON object {"name": ..., "arguments": ...} per <tool_call>."""

from __future__ import annotations

from .base import CALL_FROM_JSON, CallGrammar, ToolFormat, section

HERMES = ToolFormat(
    "hermes",
    markers=("<tool_call>",),
    spec=section(r"\s*<tool_call>", "</tool_call>", "json", CALL_FROM_JSON),
    grammar=CallGrammar("<tool_call>\n", "\n</tool_call>"),
)
