"""Tools, and the calls sent back, where the chat template reads them otherwise.

Most templates read OpenAI-style ``tools`` and render an assistant's
``tool_calls``. SmolLM3's reads its tools from ``xml_tools`` (bare function
specs, as its model card passes them), and renders an assistant message's
content only: OpenAI ``tools`` would never reach the model, and a call the
client sends back would vanish from the history it reads, though the model
wrote that call into its reply as markup. Both are read off probes of the
template, never a model's name:

- tools that the template shows only when they come as ``xml_tools`` go to it
  as that (unless the caller passes ``xml_tools`` itself);
- calls that a template leaves out are written into the message's content in
  the markup of its tool-call format (``agents.formats``), as the model's grammar
  writes them, so the history holds the text the model wrote.
"""

from __future__ import annotations

import functools
import json
import logging

from .agents.formats import CallGrammar, detect

logger = logging.getLogger("kvchat")

_PROBE_NAME = "kvchat_probe_tool"
_PROBE_FUNCTION = {
    "name": _PROBE_NAME,
    "description": "A probe.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
}
_USER = [{"role": "user", "content": "Alpha"}]
_CALLED = [
    *_USER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "a1b2c3d4e",  # nine letters or digits: Mistral's templates refuse others
                "type": "function",
                "function": {"name": _PROBE_NAME, "arguments": '{"key": "value"}'},
            }
        ],
    },
    {"role": "user", "content": "Beta"},
]


def _template(tokenizer) -> str:
    return str(getattr(tokenizer, "chat_template", None))


def tools_argument(tokenizer, tools, template_kwargs=None) -> dict:
    """The keyword ``tools`` go to ``apply_chat_template`` with: ``tools``, or
    ``xml_tools`` (each tool's function spec) for a template that shows
    tools only from there."""
    if not tools or "xml_tools" in (template_kwargs or {}):
        return {"tools": tools}
    if not _reads_xml_tools(tokenizer, _template(tokenizer)):
        return {"tools": tools}
    return {"xml_tools": [_function(tool) for tool in tools]}


def _function(tool):
    """A tool's function spec: a Python function's as transformers reads it
    for ``tools`` (its signature and docstring), a spec as it is."""
    if callable(tool):
        from transformers.utils import get_json_schema

        tool = get_json_schema(tool)
    return tool["function"] if isinstance(tool, dict) and "function" in tool else tool


@functools.lru_cache(maxsize=32)
def _reads_xml_tools(tokenizer, template: str) -> bool:
    def shows(**tools) -> bool:
        try:
            text = tokenizer.apply_chat_template(
                _USER, tokenize=False, add_generation_prompt=True, **tools
            )
        except Exception as error:  # a template that refuses the probe: no tools there
            logger.debug("kvchat: the chat template refused a tools probe: %s", error)
            return False
        return _PROBE_NAME in text

    probe_tool = {"type": "function", "function": _PROBE_FUNCTION}
    return not shows(tools=[probe_tool]) and shows(xml_tools=[_PROBE_FUNCTION])


def with_calls_written(tokenizer, messages: list[dict]) -> list[dict]:
    """``messages``, where the template leaves an assistant's ``tool_calls``
    out, with those calls appended to its content as the model writes them
    (a copy; the input is kept)."""
    if not any(_calls(message) for message in messages):
        return messages
    grammar = _dropped_calls_grammar(tokenizer, _template(tokenizer))
    if grammar is None:
        return messages
    out = []
    for message in messages:
        calls = _calls(message)
        if calls:
            content = message.get("content")
            content = content if isinstance(content, str) else ""
            message = {**message, "content": content + _written(grammar, calls)}
        out.append(message)
    return out


def _calls(message) -> list:
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return []
    calls = message.get("tool_calls")
    return calls if isinstance(calls, list) else []


@functools.lru_cache(maxsize=32)
def _dropped_calls_grammar(tokenizer, template: str) -> CallGrammar | None:
    """How to write calls for a template that renders none of them (a
    message with a call, its content "" or None, renders as the same
    message without it): its
    format's grammar, where that writes calls as JSON. None for a template
    that renders calls (or refuses the probe), or whose markup kvchat
    cannot write."""
    # Rendered with tools, as a conversation with calls is: a template may
    # render calls only beside its tools.
    tools = tools_argument(tokenizer, [{"type": "function", "function": _PROBE_FUNCTION}])
    uncalled = [{k: v for k, v in m.items() if k != "tool_calls"} for m in _CALLED]
    # Content None as well as "": some templates render calls only beside
    # None (DeepSeek R1's distills), and such a template renders calls.
    no_content = [dict(m, content=None) if "tool_calls" in m else m for m in _CALLED]
    try:
        bare = tokenizer.apply_chat_template(uncalled, tokenize=False, **tools)
        renders = [
            tokenizer.apply_chat_template(probe, tokenize=False, **tools)
            for probe in (_CALLED, no_content)
        ]
    except Exception as error:  # refused: leave its messages as they are
        logger.debug("kvchat: the chat template refused a tool-call probe: %s", error)
        return None
    if any(render != bare for render in renders):  # the call shows
        return None
    fmt = detect(tokenizer)
    grammar = fmt.grammar if fmt is not None else None
    if grammar is None or grammar.xml is not None or grammar.keyword_arguments:
        if fmt is not None:
            logger.info(
                "kvchat: the chat template leaves tool calls out of the history, and "
                "kvchat cannot write its %s markup; calls sent back are not shown",
                fmt.name,
            )
        return None
    return grammar


def _written(g: CallGrammar, calls: list) -> str:
    """The calls in ``g``'s markup. Arguments sent back as text are written
    as that text (the model's own, as the reply gave it back); an object as
    JSON, spaced as the grammars write it."""
    written = []
    for call in calls:
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        name = function.get("name", "")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if g.name_in_json:
            name_part = json.dumps(g.name_key) + ": " + json.dumps(name, ensure_ascii=False)
            body = "{" + name_part + ", " + json.dumps(g.arguments_key) + ": " + arguments + "}"
        else:
            body = name + g.name_close + arguments
        written.append(g.call_open + body + g.call_close)
    separator = g.separator if g.separator is not None else ""
    return g.section_open + separator.join(written) + g.section_close
