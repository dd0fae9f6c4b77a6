"""Chat messages to token ids, and the turn markers the core checks use."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch

from . import _C

logger = logging.getLogger("kvchat")

_ROLE_PROBE = [{"role": "user", "content": "x"}]
# A turn, and the same turn with a reply and the next question after it.
_REWRITE_PROBE = (
    [{"role": "user", "content": "Hello there."}],
    [{"role": "assistant", "content": "Sure thing."}, {"role": "user", "content": "Thanks."}],
)
# More than this is no rewrite of the generation prompt but of earlier history
# (a system prompt the template moves, say), which a tail stop cannot serve.
_MAX_REWRITTEN_TAIL = 16


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")  # the core stores UTF-8; a lone surrogate has none
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{where} is not valid Unicode text ({error.reason} at index {error.start})"
        ) from None
    return value


def _content(message: dict, where: str) -> str | None:
    """The message's text: a string, or a list of text parts joined (as OpenAI
    clients send it); None only for an assistant message that calls tools."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return None
    if isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"{where}[{j}] is a {kind or type(part).__name__!r} part; kvchat serves "
                    f"text parts only"
                )
            pieces.append(_text(part.get("text"), f"{where}[{j}]['text']"))
        return "".join(pieces)
    return _text(content, where)


def validate_messages(messages) -> list[dict]:
    """Checks the chat format: a non-empty list of {'role': str, 'content': str} dicts.

    As OpenAI clients send them, ``content`` may also be a list of text parts
    (joined here), or None in an assistant message with ``tool_calls``; other
    keys (``tool_calls``, ``tool_call_id``, ``name``) pass to the template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        _text(role, f"messages[{i}]['role']")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise ValueError(
                f"messages[{i}]['tool_calls'] must be a list, got {type(tool_calls).__name__}"
            )
        extras = {k: v for k, v in message.items() if k not in ("role", "content")}
        try:  # the history keeps these as JSON
            json.dumps(extras)
        except (TypeError, ValueError) as error:
            raise ValueError(f"messages[{i}] has a field that is not JSON data: {error}") from None
        clean.append(dict(message, content=_content(message, f"messages[{i}]['content']")))
    return clean


def require_chat_template(tokenizer) -> None:
    if tokenizer is None:
        raise ValueError("tokenizer is None; chat() and stream_chat() need a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "tokenizer has no chat_template, which chat() and stream_chat() need; "
            "set tokenizer.chat_template, or call generate() with input_ids"
        )


def render_text(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> str:
    """The conversation plus the generation prompt, as the chat template writes it.

    ``tools`` (OpenAI-style function specs) and ``template_kwargs`` (such as
    ``enable_thinking``) go to the template, as transformers passes them."""
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        **(template_kwargs or {}),
    )


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of template text, 1-D int64."""
    # Templates write their own special tokens; adding BOS again would shift ids.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def render_prompt(tokenizer, messages: list[dict], tools=None, template_kwargs=None):
    """Token ids of the conversation plus the generation prompt, 1-D int64."""
    return tokenize_text(tokenizer, render_text(tokenizer, messages, tools, template_kwargs))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def rewritten_tail(tokenizer, tools=None, template_kwargs=None) -> int:
    """How many of a prompt's last tokens the chat template renders otherwise
    once the reply follows in history: 0 for most templates; the generation
    prompt's opening of a ``<think>`` block for one that drops it from earlier
    turns (Qwen3.5, DeepSeek-R1). Read off a probe conversation, never a name."""
    turn, after = _REWRITE_PROBE
    try:
        before = tokenize_text(tokenizer, render_text(tokenizer, turn, tools, template_kwargs))
        later = render_text(tokenizer, [*turn, *after], tools, template_kwargs)
    except Exception as error:  # a template that refuses the probe: assume no rewrite
        logger.debug("kvchat: the chat template refused the rewrite probe: %s", error)
        return 0
    common = _C.common_prefix_length(before, tokenize_text(tokenizer, later))
    tail = before.numel() - common
    return tail if 0 < tail <= _MAX_REWRITTEN_TAIL else 0


def turn_markers(tokenizer, generation_config) -> _C.TurnMarkers:
    """End-of-turn ids and role headers, taken from the tokenizer and template."""
    end_ids = set(_as_list(getattr(generation_config, "eos_token_id", None)))
    headers = []
    if tokenizer is not None:
        end_ids.update(_as_list(tokenizer.eos_token_id))
        if getattr(tokenizer, "chat_template", None):
            # The generation prompt is the assistant's role header.
            try:
                bare = tokenizer.apply_chat_template(_ROLE_PROBE, tokenize=False)
                full = tokenizer.apply_chat_template(
                    _ROLE_PROBE, tokenize=False, add_generation_prompt=True
                )
            except Exception as error:  # a template that needs tools, say
                logger.warning(
                    "kvchat: the chat template refused a one-message probe (%s); message "
                    "boundaries will be found by end-of-turn tokens alone",
                    error,
                )
                bare = full = ""
            if full.startswith(bare) and len(full) > len(bare):
                header = tokenizer(full[len(bare) :], add_special_tokens=False)["input_ids"]
                if header:
                    headers.append(header)
    return _C.TurnMarkers(sorted(end_ids), headers)
