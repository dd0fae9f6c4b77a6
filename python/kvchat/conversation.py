"""A conversation's messages as the caller gives them (dicts) and as the core
keeps them (role, text, and anything else as JSON), and how a chat turn's
conversation will come back."""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import _C


def core_messages(messages: list[dict]) -> list[_C.Message]:
    """The core keeps role and text; anything else (tool calls, a tool call id,
    content None beside tool calls) rides along as JSON."""
    out = []
    for m in messages:
        extras = {k: v for k, v in m.items() if k not in ("role", "content")}
        if m["content"] is None:
            extras["content"] = None
        out.append(_C.Message(m["role"], m["content"] or "", json.dumps(extras) if extras else ""))
    return out


def as_dicts(messages: list[_C.Message]) -> list[dict]:
    return [
        {"role": m.role, "content": m.content, **(json.loads(m.extras) if m.extras else {})}
        for m in messages
    ]


@dataclass(frozen=True)
class SendBack:
    """How the client will send a chat turn's conversation back: its messages,
    then the reply as an assistant message, rendered with the same tools and
    template arguments. ``settle``: settle the session for that after the turn."""

    messages: list[dict]
    tools: list | None
    template_kwargs: dict | None
    settle: bool

    def history(self, reply: str) -> list[dict]:
        return [*self.messages, {"role": "assistant", "content": reply}]


def drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """The conversation without its oldest turn after the system prompt: the
    first message and any replies up to the next user message. None when only
    the last user message would be left."""
    first = 1 if messages[0]["role"] == "system" else 0
    end = first + 1
    while end < len(messages) and messages[end]["role"] != "user":
        end += 1
    if end >= len(messages):
        return None
    return messages[:first] + messages[end:]
