"""What the next prompt will start with, once the client sends the reply back.

After a reply, kvchat knows how the client will send the conversation back:
the history, then the reply as an assistant message (with its parsed
``tool_calls``, say), rendered by the chat template. What follows it is not
known, so the prediction is the common prefix of renders with different next
messages: where they part is where the next prompt stops being predictable.
The settler (settling.py) prefills the session to it between turns.
"""

from __future__ import annotations

from . import _C
from .prompting import render_text, tokenize_text

# Two different next messages: where their renders part is where the next
# prompt stops being predictable. Different first characters and classes, so
# no byte-level merge carries one into the header before it.
_PROBES = ({"role": "user", "content": "Alpha"}, {"role": "user", "content": "7"})
# What follows an assistant message that calls tools: the tool's result (two,
# for templates that take nothing else there).
_TOOL_PROBES = (
    {"role": "tool", "tool_call_id": "call_0", "name": "probe", "content": "Alpha"},
    {"role": "tool", "tool_call_id": "call_0", "name": "probe", "content": "7"},
)


def predicted_prefix(
    tokenizer, history: list[dict], tools=None, template_kwargs=None, max_chars=None
):
    """The ids the next prompt is predicted to start with, once ``history``
    (ending with the reply as the client will send it back) is followed by
    any next message: the common prefix of renders with different next
    messages. None when the template refuses every probe; ValueError (naming
    ``messages``) when it refuses the history itself, or a render is longer
    than ``max_chars``, before tokenizing it."""
    last = history[-1] if history else {}
    if last.get("role") == "assistant" and last.get("tool_calls"):
        # What follows a call is its result. A user message instead can render
        # the call differently (Qwen3.5 renders a reply after the last user
        # message with its reasoning block, one before it without), and the
        # common prefix would then stop before the call, settling nothing.
        call_id = (last["tool_calls"][0] or {}).get("id") or "call_0"
        tool_probes = [dict(probe, tool_call_id=call_id) for probe in _TOOL_PROBES]
        target = _common_render(
            tokenizer, history, tool_probes, tools, template_kwargs, max_chars, strict=False
        )
        if target is not None:
            return target
    return _common_render(tokenizer, history, _PROBES, tools, template_kwargs, max_chars)


def _common_render(tokenizer, history, probes, tools, template_kwargs, max_chars, strict=True):
    """The common prefix of ``history`` rendered with each of ``probes`` next
    (None where fewer than two render; ``strict``: the refusal, where all
    are refused, is the history's own)."""
    rendered, refusals = [], []
    for probe in probes:
        try:
            text = render_text(tokenizer, [*history, probe], tools, template_kwargs)
        except ValueError as error:  # the template refuses this continuation
            refusals.append(error)
            continue
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(
                f"messages: the history renders to {len(text)} characters, more than the "
                f"context ({max_chars} characters at most) can hold"
            )
        rendered.append(tokenize_text(tokenizer, text))
    if len(rendered) < 2:
        if strict and refusals and len(refusals) == len(probes):
            raise refusals[0]  # the history itself, not a probe
        return None
    n = min(ids.numel() for ids in rendered)
    for other in rendered[1:]:
        n = min(n, _C.common_prefix_length(rendered[0], other))
    return rendered[0][:n].clone() if n > 0 else None
