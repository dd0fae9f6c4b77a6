"""``kvchat serve --chat-template`` and ``--chat-template-kwargs``: the chat
template a server renders every conversation with instead of the model's
own, and the template variables every request gets, as vLLM names and means
them. Both are read while the command line is parsed, so a bad value is an
error naming its flag before the model loads."""

from __future__ import annotations

import argparse
import json
import logging
import reprlib
from importlib import resources
from pathlib import Path

from ..prompting import check_template_kwargs

logger = logging.getLogger("kvchat.serve")

_SHIPPED = "templates"  # the templates kvchat ships, python/kvchat/templates/NAME.jinja


def shipped_templates() -> dict[str, str]:
    """The chat templates kvchat ships, by name (``chatml-tools``): text."""
    folder = resources.files("kvchat").joinpath(_SHIPPED)
    return {
        entry.name.removesuffix(".jinja"): entry.read_text("utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".jinja")
    }


def chat_template(value: str) -> str:
    """The template ``--chat-template VALUE`` names: the text of the file
    VALUE; VALUE itself when it is no file but a template's text (it holds
    ``{%`` or ``{{``, as vLLM takes it inline); or a template kvchat ships,
    by its name. Raises ``argparse.ArgumentTypeError`` for anything else."""
    path = Path(value)
    if _is_file(path):
        try:
            text = path.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise argparse.ArgumentTypeError(f"cannot read {value!r}: {error}") from None
        where = repr(value)
    elif "{%" in value or "{{" in value:
        text, where = value, "the template text given"
    elif value in (shipped := shipped_templates()):
        return shipped[value]
    else:
        raise argparse.ArgumentTypeError(
            f"no such file: {value!r} (a Jinja chat template's path, its text, or one that "
            f"kvchat ships: {', '.join(sorted(shipped))})"
        )
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{where} is empty, not a chat template")
    _check_syntax(text, where)
    return text


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name no file can have (too long): a template's text, say
        return False


def _check_syntax(text: str, where: str) -> None:
    """Compiles ``text`` as transformers will render it, so a template that
    cannot be read fails here, not at every request."""
    try:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError as error:  # another transformers: rendering finds out
        logger.debug("kvchat serve: chat template not compiled ahead: %s", error)
        return
    try:
        _compile_jinja_template(text)
    except TemplateError as error:
        raise argparse.ArgumentTypeError(
            f"{where} is not a Jinja template transformers can compile: {error}"
        ) from None


def template_kwargs(value: str) -> dict:
    """The template variables ``--chat-template-kwargs JSON`` gives every
    request (a request's own ``chat_template_kwargs`` win, key by key).
    Raises ``argparse.ArgumentTypeError`` for what a request's would be refused."""
    try:
        kwargs = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"not valid JSON: {error} (got {reprlib.repr(value)})"
        ) from None
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object of template variables, such as "
            f"'{{\"enable_thinking\": false}}', got {reprlib.repr(value)}"
        )
    try:
        check_template_kwargs(kwargs)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return kwargs


def merged(defaults: dict, own: dict | None) -> dict | None:
    """A request's template variables: the server's ``defaults`` under its ``own``."""
    if not defaults:
        return own
    return {**defaults, **(own or {})}
