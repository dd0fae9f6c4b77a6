"""Llama 3.1-3.3: the whole reply is one JSON call."""

from __future__ import annotations

from .base import CallGrammar, ToolFormat

LLAMA3_JSON = ToolFormat(  # Llama 3.1-3.3: the whole reply is {"name": ..., "parameters": ...}
    "llama3-json",
    markers=("<|python_tag|>", "{"),
    spec=None,
    grammar=CallGrammar("", separator=None, arguments_key="parameters"),  # one call: the reply
    arguments_key="parameters",
)
