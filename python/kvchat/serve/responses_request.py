"""The OpenAI Responses API in kvchat's terms.

A Responses request becomes a chat turn: ``instructions`` the system message,
the ``input`` items (messages, ``function_call``, ``function_call_output``)
chat messages, and ``previous_response_id`` the conversation that response
ended with, so the turn continues that response's session and its cache. The
chat request's checks apply, with their errors named by the Responses field.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

from ..prompting import check_json
from .chat_request import ChatRequest, check_fields, parse_chat_request
from .constraints import check_tool
from .errors import APIError, bad_request

_IGNORED = {
    "metadata",
    "truncation",
    "reasoning",
    "include",
    "safety_identifier",
    "service_tier",
    "prompt_cache_retention",
    "stream_options",
    "text_verbosity",
}
_HANDLED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "previous_response_id",
    "store",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "prompt_cache_key",
    "user",
    "min_tokens",  # kvchat's own, as in chat completions
    "background",
    "conversation",
    "max_tool_calls",
    "top_logprobs",
}
# A chat field's error, named as the Responses field it came from.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


@dataclass
class ResponsesRequest:
    """A Responses request: the chat fields it maps to (all but messages),
    and what the response echoes back."""

    body: dict
    chat_fields: dict
    input_messages: list[dict]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool

    def conversation(self, previous: list[dict] | None) -> list[dict]:
        """The chat messages this turn answers: the instructions, what the
        previous response ended with, then this request's input."""
        system = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        return [*system, *(previous or []), *self.input_messages]

    def chat(self, messages: list[dict], session_key: str | None = None) -> ChatRequest:
        """The chat request; ``session_key``: the previous response's, which the
        turn continues unless this request names its own."""
        fields = dict(self.chat_fields)
        if session_key is not None and "prompt_cache_key" not in fields and "user" not in fields:
            fields["prompt_cache_key"] = session_key
        try:
            chat = parse_chat_request({**fields, "messages": messages})
        except APIError as error:
            error.param = responses_param(error.param)
            raise
        chat.extra["max_tokens_field"] = "max_output_tokens"
        return chat


def responses_param(param: str | None) -> str | None:
    """A chat field an error names, as the Responses field it came from."""
    return _PARAMS.get(param, param)


def parse_request(body) -> ResponsesRequest:
    """Checks every Responses field; raises APIError(400) naming the first bad one."""
    check_fields(body, _HANDLED | _IGNORED)
    if body.get("background"):
        raise bad_request(
            "background", "kvchat serve answers in the foreground; background must be false"
        )
    if body.get("conversation") is not None:
        raise bad_request(
            "conversation", "kvchat serve keeps conversations by previous_response_id"
        )
    if body.get("max_tool_calls") is not None:
        raise bad_request(
            "max_tool_calls", "max_tool_calls is not supported; use parallel_tool_calls"
        )
    if body.get("top_logprobs"):
        raise bad_request("top_logprobs", "kvchat serve does not return logprobs")
    if "input" not in body:
        raise bad_request("input", "input is required", code="missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", "instructions must be a string")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("previous_response_id", "previous_response_id must be a response's id")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("store", f"store must be a boolean, got {reprlib.repr(store)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream", f"stream must be a boolean, got {reprlib.repr(stream)}")

    # min_tokens: kvchat's own, as in chat completions.
    names = ("model", "temperature", "top_p", "prompt_cache_key", "user", "min_tokens")
    chat = {name: body[name] for name in names if body.get(name) is not None}
    chat.update(stream=stream)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _check_metadata(body.get("metadata"))
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(i, str) for i in include)
    ):
        raise bad_request("include", "include must be a list of strings")
    if body.get("reasoning") is not None and not isinstance(body["reasoning"], dict):
        raise bad_request("reasoning", "reasoning must be an object")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise bad_request(
                "text", "text must be an object, such as {'format': {'type': 'text'}}"
            )
        if text.get("format") is not None:
            chat["response_format"] = _format(text["format"])
    return ResponsesRequest(
        body=body,
        chat_fields=chat,
        input_messages=input_messages(body["input"]),
        instructions=instructions,
        previous_response_id=previous,
        store=store,
        stream=stream,
    )


def _check_metadata(metadata) -> None:
    """OpenAI's limits: 16 pairs, keys of 64 characters, string values of 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise bad_request("metadata", "metadata must be an object of at most 16 pairs")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(
                "metadata",
                "metadata keys are at most 64 characters and values strings of at most 512, "
                f"got {reprlib.repr(key)}: {reprlib.repr(value)}",
            )
    try:  # stored with the response as UTF-8: a lone surrogate cannot be
        check_json(metadata, "metadata")
    except ValueError as error:
        raise bad_request("metadata", str(error)) from None


def chat_tools(tools) -> list[dict]:
    """The Responses API's function tools as chat completions' tools (the
    chat template's), or a 400 naming ``tools``."""
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(
                f"tools[{i}]",
                f"kvchat serve runs function tools only, got {reprlib.repr(kind)}",
            )
        check_tool(tool, f"tools[{i}]")  # named as sent: {"type", "name", ...}
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name", "tool_choice {'type': 'function'} needs the name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise bad_request("tool_choice", "tool_choice allowed_tools is not supported")
    return choice  # "auto", "none", "required", or what the chat checks refuse


def _format(fmt) -> dict:
    if not isinstance(fmt, dict):
        raise bad_request("text.format", f"text.format must be an object, got {reprlib.repr(fmt)}")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def input_messages(value) -> list[dict]:
    """Chat messages from ``input``: a string, or a list of items. An assistant
    message and the function calls after it are one assistant message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input", "input must be a string or a non-empty list of items")
    messages: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}]", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input[{i}].role", f"unknown role {reprlib.repr(role)}")
            text = _text(item.get("content"), f"input[{i}].content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = _strings(item, ("call_id", "name", "arguments"), i)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(
                {
                    "id": call["call_id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            )
        elif kind == "function_call_output":
            call_id = _strings(item, ("call_id",), i)["call_id"]
            output = _text(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # kvchat writes no reasoning items; a template drops old reasoning
        elif kind == "item_reference":
            raise bad_request(
                f"input[{i}]",
                "kvchat serve cannot resolve item references: send the item, or "
                "continue with previous_response_id",
            )
        else:
            raise bad_request(f"input[{i}].type", f"unknown input item type {reprlib.repr(kind)}")
    return messages


def _strings(item: dict, names: tuple[str, ...], i: int) -> dict:
    for name in names:
        if not isinstance(item.get(name), str):
            raise bad_request(
                f"input[{i}].{name}", f"a {item.get('type')} item needs a string {name}"
            )
    return item


def _text(content, param: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                    continue
            kind = part.get("type") if isinstance(part, dict) else part
            raise bad_request(
                param, f"kvchat serve takes text parts only, got {reprlib.repr(kind)}"
            )
        return "".join(parts)
    raise bad_request(param, "content must be a string or a list of text parts")
