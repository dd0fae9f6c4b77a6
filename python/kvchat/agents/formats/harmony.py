"""gpt-oss's harmony: the whole reply is messages in channels."""

from __future__ import annotations

from .base import CALL, CallGrammar, ToolFormat

# gpt-oss (harmony): messages in channels. The generation prompt is
# "<|start|>assistant"; the model reasons in "analysis", may address the user
# in "commentary", answers in "final", and calls a function in "commentary"
# (at times "analysis") with a recipient, written after the role (as the
# template renders a call sent back) or in the channel's header (as the model
# usually writes it).
# "<|call|>" and "<|return|>" end the reply, so the decode drops them.
_HARMONY_HEAD = r"(?:<\|start\|>assistant)?\s*"
HARMONY = ToolFormat(
    "harmony",
    markers=(),
    spec={
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\A",
        "fields": {
            "thinking": {
                "open_pattern": _HARMONY_HEAD + r"<\|channel\|>analysis\s*<\|message\|>",
                "close": "<|end|>",
                "content": "text",
                "repeats": True,
                "join": "",
            },
            "tool_calls": {
                "open_pattern": _HARMONY_HEAD
                + r"(?:to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>(?:commentary|analysis)"
                + r"|<\|channel\|>(?:commentary|analysis)\s+to=functions\.(?P<name>[^\s<]+))"
                + r"\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>",
                "close": "<|call|>",
                "repeats": True,
                "content": "json",
                "transform": CALL,
            },
            "final": {
                "open_pattern": _HARMONY_HEAD
                + r"<\|channel\|>(?:final|commentary)\s*<\|message\|>",
                "close_pattern": r"<\|end\|>|<\|return\|>",
                "content": "text",
                "repeats": True,
                "join": "",
            },
            "content": {"content": "text"},  # text outside every channel
        },
    },
    # The recipient after the role and no constraint token: as the template
    # renders the call when it is sent back, so the settled history is the reply.
    grammar=CallGrammar(
        " to=functions.",
        separator=None,  # one call a message
        name_in_json=False,
        name_close="<|channel|>commentary json<|message|>",
    ),
    closed=False,  # "<|call|>" ends the reply and is not decoded
    ignore=("<|start|>assistant",),  # a next message's head, cut short
    channels=True,
    # "<|start|>assistant" and a channel header, or either alone, at the end.
    unfinished=(
        r"(?:<\|start\|>(?:assistant)?\s*(?:<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)?|<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)\Z"
    ),
)
