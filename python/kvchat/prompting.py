"""Chat messages to token ids, and the turn markers the core checks use."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C

_ROLE_PROBE = [{"role": "user", "content": "x"}]


def validate_messages(messages) -> list[dict[str, str]]:
    """Checks the HF chat format: a non-empty list of {'role': str, 'content': str}."""
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
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]['content'] must be a string, got {type(content).__name__}"
            )
        for key, text in (("role", role), ("content", content)):
            try:
                text.encode("utf-8")  # the core stores UTF-8; a lone surrogate has none
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"messages[{i}]['{key}'] is not valid Unicode text ({error.reason} at "
                    f"index {error.start})"
                ) from None
        clean.append(dict(message))
    return clean


def require_chat_template(tokenizer) -> None:
    if tokenizer is None:
        raise ValueError("tokenizer is None; chat() and stream_chat() need a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "tokenizer has no chat_template, which chat() and stream_chat() need; "
            "set tokenizer.chat_template, or call generate() with input_ids"
        )


def render_text(tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation plus the generation prompt, as the chat template writes it."""
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of template text, 1-D int64."""
    # Templates write their own special tokens; adding BOS again would shift ids.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids of the conversation plus the generation prompt, 1-D int64."""
    return tokenize_text(tokenizer, render_text(tokenizer, messages))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def turn_markers(tokenizer, generation_config) -> _C.TurnMarkers:
    """End-of-turn ids and role headers, taken from the tokenizer and template."""
    end_ids = set(_as_list(getattr(generation_config, "eos_token_id", None)))
    headers = []
    if tokenizer is not None:
        end_ids.update(_as_list(tokenizer.eos_token_id))
        if getattr(tokenizer, "chat_template", None):
            # The generation prompt is the assistant's role header.
            bare = tokenizer.apply_chat_template(_ROLE_PROBE, tokenize=False)
            full = tokenizer.apply_chat_template(
                _ROLE_PROBE, tokenize=False, add_generation_prompt=True
            )
            if full.startswith(bare) and len(full) > len(bare):
                header = tokenizer(full[len(bare) :], add_special_tokens=False)["input_ids"]
                if header:
                    headers.append(header)
    return _C.TurnMarkers(sorted(end_ids), headers)
