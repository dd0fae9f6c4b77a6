"""Cohere's Command R7B and Command A: a JSON list between action markers."""

from __future__ import annotations

from .base import CallGrammar, ToolFormat, section

# Command R7B, Command A: a JSON list of {"tool_call_id", "tool_name", "parameters"},
# one call per indented line. A constrained call leaves the id out: it is
# not the client's id (the template numbers the calls), and no parser needs it.
COHERE = ToolFormat(
    "cohere",
    markers=("<|START_ACTION|>",),
    spec=section(
        r"\s*<\|START_ACTION\|>",
        "<|END_ACTION|>",
        "json",
        {"type": "function", "function": {"name": "{tool_name}", "arguments": "{parameters}"}},
        transform_each=True,
    ),
    grammar=CallGrammar(
        "",
        separator=",\n    ",
        section_open="<|START_ACTION|>[\n    ",
        section_close="\n]<|END_ACTION|>",
        name_key="tool_name",
        arguments_key="parameters",
    ),
)
