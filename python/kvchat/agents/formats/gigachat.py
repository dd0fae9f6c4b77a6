"""GigaChat: one JSON call a reply, after 3.1's <|function_call|> or as 3's
call message."""

from __future__ import annotations

from .base import CALL_FROM_JSON, CallGrammar, ToolFormat, section


def _one_call(name: str, markers: tuple[str, ...], open_pattern: str, call_open: str) -> ToolFormat:
    """{"name": ..., "arguments": ...} after ``open_pattern``; the call ends the reply."""
    return ToolFormat(
        name,
        markers=markers,
        spec=section(open_pattern, None, "json", CALL_FROM_JSON),
        grammar=CallGrammar(call_open, separator=None),
        closed=False,
    )


# GigaChat 3.1: <|function_call|>{"name": ..., "arguments": ...}
GIGACHAT = _one_call(
    "gigachat", ("<|function_call|>",), r"\s*<\|function_call\|>", "<|function_call|>"
)
# GigaChat 3: the call is a message of its own after the reply's,
# "function call<|role_sep|>\n{...}", the message separator before it where
# the model writes one. A grammar writes only the call message's header: the
# separator is the end-of-message token, where generation would end.
_HEADER = "function call<|role_sep|>"
GIGACHAT_3 = _one_call(
    "gigachat3",
    ("<|message_sep|>\n\n" + _HEADER, _HEADER),
    r"\s*(?:<\|message_sep\|>\s*)?function call<\|role_sep\|>\s*",
    _HEADER + "\n",
)
