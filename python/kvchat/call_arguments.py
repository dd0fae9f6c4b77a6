"""Tool-call arguments as the chat template wants them.

OpenAI clients send an assistant's ``tool_calls`` back with ``arguments`` as
JSON text. Many templates iterate them as a mapping (Qwen3.5's and
Qwen3-Coder's ``arguments|items``, GLM's), and refuse text; others apply
``tojson`` to them, which writes text as an escaped JSON string, not the call
the model wrote; Gemma 4's writes the object's braces itself. The template
decides: it is probed once with text arguments, and where it refuses them,
escapes them, braces them again or writes them as a JSON block where it
writes an object as markup (Kimi-K3), arguments that are a JSON object are
passed to it as that object. Templates that write text as it
is (Hermes-style ``is string`` checks) get the text, unchanged.
"""

from __future__ import annotations

import functools
import json

_PROBE_ARGUMENTS = '{"key": "value"}'
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",  # Hermes' templates read it
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


def _probe(arguments) -> list[dict]:
    call = {
        "id": "a1b2c3d4e",  # nine letters or digits: Mistral's templates refuse other ids
        "type": "function",
        "function": {"name": "probe", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "Alpha"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def as_the_template_wants(tokenizer, messages: list[dict]) -> list[dict]:
    """``messages``, with text arguments that hold a JSON object passed as
    that object where the template wants objects (a copy; the input is kept)."""
    if not any(_text_arguments(m) for m in messages):
        return messages
    if not _wants_objects(tokenizer, str(getattr(tokenizer, "chat_template", None))):
        return messages
    return [_with_objects(m) if _text_arguments(m) else m for m in messages]


def _text_arguments(message: dict) -> bool:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return any(
        isinstance(call, dict) and isinstance(call.get("function", {}).get("arguments"), str)
        for call in calls or ()
    )


def _with_objects(message: dict) -> dict:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None  # text that is no JSON stays text
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


@functools.lru_cache(maxsize=32)
def _wants_objects(tokenizer, template: str) -> bool:
    """Whether ``template`` refuses text arguments that it takes as an
    object (it iterates them as a mapping), writes them escaped, or writes
    them inside braces of its own."""

    def render(arguments) -> str:
        return tokenizer.apply_chat_template(_probe(arguments), tools=_PROBE_TOOLS, tokenize=False)

    try:
        text = render(_PROBE_ARGUMENTS)
    except Exception:
        try:  # refused for another reason too (the probe's own shape): leave it be
            render(json.loads(_PROBE_ARGUMENTS))
        except Exception:
            return False
        return True
    escaped = json.dumps(_PROBE_ARGUMENTS)[1:-1] in text  # '{\"key\": ...': tojson of text
    # A template that writes the object's braces itself (Gemma 4's
    # call:NAME{key:value}) would write text inside a second pair.
    braced = "{" + _PROBE_ARGUMENTS + "}" in text
    return escaped or braced or _markup_for_objects(render, text)


def _markup_for_objects(render, text: str) -> bool:
    """Whether the template writes text arguments as a JSON block but an
    object as markup of its own, no JSON in it (Kimi-K3's argument tags):
    the model writes the markup."""
    if _PROBE_ARGUMENTS not in text:
        return False
    try:
        as_object = render(json.loads(_PROBE_ARGUMENTS))
    except Exception:
        return False
    return not any(pair in as_object for pair in ('"key": "value"', '"key":"value"'))
