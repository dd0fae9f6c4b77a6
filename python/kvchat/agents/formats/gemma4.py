"""Gemma 4: call:NAME{...} with bare keys and <|"|> strings."""

from __future__ import annotations

from .base import CALL, ToolFormat, section

# Gemma 4: call:NAME{key:<|"|>text<|"|>,key:3}, JSON with bare keys and
# strings between <|"|> marks (transformers' own template for it). Not
# constrained: that is not JSON, which the grammars write.
GEMMA4 = ToolFormat(
    "gemma4",
    markers=("<|tool_call>",),
    spec=section(
        r"\s*<\|tool_call>call:(?P<name>[^\s{<]+)",
        "<tool_call|>",
        "json",
        CALL,
        content_args={"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
    ),
)
