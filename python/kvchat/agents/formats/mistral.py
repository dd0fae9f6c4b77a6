"""Mistral: [TOOL_CALLS], then v11's NAME[ARGS]{...} or v3's JSON list."""

from __future__ import annotations

from .base import CALL, EACH, CallGrammar, ToolFormat, section

MISTRAL_V11 = ToolFormat(  # Mistral Small 3.2, Devstral: [TOOL_CALLS]NAME[ARGS]{...}
    "mistral-v11",
    markers=("[TOOL_CALLS]",),
    spec=section(
        r"\s*\[TOOL_CALLS\](?P<name>[^\[\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]",
        None,  # a call ends where the next begins, or with the reply
        "json",
        CALL,
        close_pattern=r"(?=\[TOOL_CALLS\])",
    ),
    grammar=CallGrammar("[TOOL_CALLS]", separator="", name_in_json=False, name_close="[ARGS]"),
    mistral_ids=True,
    closed=False,
)
MISTRAL_V3 = ToolFormat(  # Mistral Nemo: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
    "mistral",
    markers=("[TOOL_CALLS]",),
    spec=section(
        r"\s*\[TOOL_CALLS\]",
        None,
        "json",
        EACH,
        transform_each=True,
    ),
    grammar=CallGrammar("", separator=", ", section_open="[TOOL_CALLS][", section_close="]"),
    mistral_ids=True,
    closed=False,
)
