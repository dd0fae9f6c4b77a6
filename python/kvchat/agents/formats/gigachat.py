"""GigaChat 3.1: one JSON call after <|function_call|>."""

from __future__ import annotations

from .base import CALL_FROM_JSON, CallGrammar, ToolFormat, section

GIGACHAT = ToolFormat(  # GigaChat 3.1: <|function_call|>{"name": ..., "arguments": ...}, one call
    "gigachat",
    markers=("<|function_call|>",),
    spec=section(r"\s*<\|function_call\|>", None, "json", CALL_FROM_JSON),
    grammar=CallGrammar("<|function_call|>", separator=None),
    closed=False,  # the call ends the reply
)
