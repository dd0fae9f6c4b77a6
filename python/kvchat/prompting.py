"""Chat messages to token ids, and the turn markers the core checks use."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import reprlib
from collections.abc import Sequence

import torch

from . import _C
from .call_arguments import as_the_template_wants
from .template_tools import tools_argument, with_calls_written

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


# JSON a client sends (message fields, tools, template variables) nested deeper
# than this is refused: templates and encoders walk it recursively.
MAX_JSON_DEPTH = 64


def _template_arguments() -> frozenset[str]:
    """Names that apply_chat_template (or the renderer under it) takes as its
    own arguments: in ``chat_template_kwargs`` they would replace the template,
    tokenize, or collide with the conversation, rather than be template variables."""
    names = {
        "conversation", "conversations", "messages", "chat", "tools", "documents",
        "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
        "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "compiled_template",
    }  # fmt: skip
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import render_jinja_template

        for function in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
            for name, parameter in inspect.signature(function).parameters.items():
                if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                    names.add(name)
    except (ImportError, AttributeError, TypeError, ValueError) as error:  # another version
        logger.debug("kvchat: apply_chat_template's signature unread: %s", error)
    return frozenset(names)  # "self" included: never a template variable


TEMPLATE_ARGUMENTS = _template_arguments()

# apply_chat_template hands the template every special token (eos_token, ...)
# as a variable, and chat_template_kwargs would replace them: a template that
# writes eos_token after every message would then repeat whatever a client
# sent once per message (a request of a few KB rendering a GB).
SPECIAL_TOKEN_NAMES = frozenset(
    {
        "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
        "mask_token", "additional_special_tokens", "extra_special_tokens",
    }
)  # fmt: skip


def check_json(value, where: str, strict: bool = True, _depth: int = 0, _root=None) -> None:
    """Checks data a client hands the chat template: every string valid Unicode,
    nested at most MAX_JSON_DEPTH deep, numbers finite; with ``strict``, only
    JSON types (dicts with string keys, lists, strings, numbers, bools, None).
    Raises ValueError naming the place (``where``)."""
    if isinstance(value, str):
        _text(value, where)
    elif value is None or isinstance(value, (bool, int)):
        return
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {reprlib.repr(value)}")
    elif isinstance(value, (dict, list, tuple)):
        if _depth >= MAX_JSON_DEPTH:
            raise ValueError(f"{_root or where} is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where} has a key that is not a string: {key!r}")
                _text(key, f"{where} key {key!r}")
                check_json(item, f"{where}[{key!r}]", strict, _depth + 1, _root or where)
        else:
            for j, item in enumerate(value):
                check_json(item, f"{where}[{j}]", strict, _depth + 1, _root or where)
    elif strict:
        raise ValueError(f"{where} is not JSON data: {type(value).__name__}")


def check_tools(tools) -> None:
    """``tools``: None, or a list of tool specs (dicts of JSON data, or callables,
    which transformers turns into specs)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool specs, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if callable(tool) and not isinstance(tool, dict):
            continue
        if not isinstance(tool, dict):
            raise TypeError(f"tools[{i}] must be a dict (a tool spec), got {type(tool).__name__}")
        check_json(tool, f"tools[{i}]")


def check_template_kwargs(template_kwargs, tokenizer=None) -> None:
    """``chat_template_kwargs``: None, or a dict of template variables (such as
    ``enable_thinking``), none of them an argument of apply_chat_template nor
    a special token's name (those of ``tokenizer`` too, where given)."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict):
        raise TypeError(
            f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}"
        )
    for name, value in template_kwargs.items():
        if not isinstance(name, str):
            raise TypeError(f"chat_template_kwargs keys must be strings, got {name!r}")
        if name in TEMPLATE_ARGUMENTS or name.startswith("return_"):
            raise ValueError(
                f"chat_template_kwargs[{name!r}] is an argument of apply_chat_template, not a "
                f"template variable; kvchat renders with the tokenizer's own chat_template"
            )
        if name in SPECIAL_TOKEN_NAMES or name in _special_token_names(tokenizer):
            raise ValueError(
                f"chat_template_kwargs[{name!r}] names a special token, which the template "
                f"takes from the tokenizer; it cannot be replaced"
            )
        check_json(value, f"chat_template_kwargs[{name!r}]", strict=False)


def _special_token_names(tokenizer) -> frozenset[str]:
    try:
        return frozenset(getattr(tokenizer, "special_tokens_map", None) or ())
    except Exception as error:  # a tokenizer that cannot list them
        logger.debug("kvchat: the tokenizer's special tokens are unread: %s", error)
        return frozenset()


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


def _check_tool_call(call, where: str) -> None:
    """A tool call as OpenAI clients send it (``{"id", "type": "function",
    "function": {"name", "arguments"}}``), arguments a string or an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"{where} must be a tool call {{'type': 'function', 'function': {{'name': str, "
            f"'arguments': str}}}}, got {reprlib.repr(call)}"
        )
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, (str, dict)):
        raise ValueError(
            f"{where}['function']['arguments'] must be a string or an object, "
            f"got {type(arguments).__name__}"
        )


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
            raise ValueError(
                f"messages[{i}]['role'] must be a non-empty string, got {reprlib.repr(role)}"
            )
        _text(role, f"messages[{i}]['role']")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise ValueError(
                f"messages[{i}]['tool_calls'] must be a list, got {type(tool_calls).__name__}"
            )
        for j, call in enumerate(tool_calls or []):
            _check_tool_call(call, f"messages[{i}]['tool_calls'][{j}]")
        for key, value in message.items():  # the history keeps these as JSON
            if key not in ("role", "content"):
                _text(key, f"messages[{i}] key {key!r}")
                check_json(value, f"messages[{i}][{key!r}]")
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
    ``enable_thinking``) go to the template, as transformers passes them;
    tool-call arguments as the template wants them (``call_arguments``), and
    tools and calls where it reads them otherwise (``template_tools``)."""
    require_chat_template(tokenizer)
    try:
        messages = with_calls_written(tokenizer, messages)
        return tokenizer.apply_chat_template(
            as_the_template_wants(tokenizer, messages),
            tokenize=False,
            add_generation_prompt=True,
            **tools_argument(tokenizer, tools, template_kwargs),
            **(template_kwargs or {}),
        )
    except Exception as error:  # the template refused this input (raise_exception, say)
        raise ValueError(
            f"messages: the chat template refused them ({type(error).__name__}: {error})"
        ) from error


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    """Characters in the tokenizer's longest token (byte-level tokens count at
    least one character per character they decode to)."""
    try:
        return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
    except Exception as error:  # a tokenizer without a vocabulary to list
        logger.debug("kvchat: the tokenizer's vocabulary is unread: %s", error)
        return 1024


def max_prompt_chars(tokenizer, max_tokens: int) -> int:
    """A text longer than this has more than ``max_tokens`` tokens, whatever
    they are: checked before tokenizing, so an overlong render costs nothing.
    Twice the bound, for normalizers that join characters."""
    return 2 * max_tokens * _longest_token(tokenizer) + 1024


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


def end_ids(tokenizer, generation_config, eos_token_id=None) -> set[int]:
    """The ids that end a reply: generate's ``eos_token_id`` (this call's, else
    the generation config's) and the tokenizer's end-of-sequence id."""
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    ids = set(_as_list(eos_token_id))
    if tokenizer is not None:
        ids.update(_as_list(tokenizer.eos_token_id))
    return ids


def turn_markers(tokenizer, generation_config) -> _C.TurnMarkers:
    """End-of-turn ids and role headers, taken from the tokenizer and template."""
    end = end_ids(tokenizer, generation_config)
    headers = []
    if tokenizer is not None:
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
    return _C.TurnMarkers(sorted(end), headers)
