"""Solar Open: calls that carry the model's own ids."""

from __future__ import annotations

from .base import CALL, ToolFormat, section

# Solar Open: each call carries the model's own id. Not constrained: a
# grammar would write one fixed id for every call.
SOLAR = ToolFormat(
    "solar",
    markers=("<|tool_calls|>", "<|tool_call:begin|>"),
    spec=section(
        r"\s*<\|tool_call:begin\|>[^<]*<\|tool_call:name\|>(?P<name>[^\s<]+)<\|tool_call:args\|>",
        "<|tool_call:end|>",
        "json",
        CALL,
    ),
    ignore=("<|tool_calls|>", "<|calls|>"),
)
