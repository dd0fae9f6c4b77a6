"""The OpenAI Responses API in kvchat's terms.

A Responses request becomes a chat turn: ``instructions`` the system message,
the ``input`` items (messages, ``function_call``, ``function_call_output``)
chat messages, and ``previous_response_id`` the conversation that response
ended with, so the turn continues that response's session and its cache. The
chat request's checks apply, with their errors named by the Responses field.
"""

from __future__ import annotations

import reprlib
import time
import uuid
from dataclasses import dataclass

from ..agents import ToolCall
from . import protocol
from .errors import APIError

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


def _bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


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

    def chat(self, messages: list[dict], session_key: str | None = None) -> protocol.ChatRequest:
        """The chat request; ``session_key``: the previous response's, which the
        turn continues unless this request names its own."""
        fields = dict(self.chat_fields)
        if session_key is not None and "prompt_cache_key" not in fields and "user" not in fields:
            fields["prompt_cache_key"] = session_key
        try:
            return protocol.parse_chat_request({**fields, "messages": messages})
        except APIError as error:
            error.param = _PARAMS.get(error.param, error.param)
            raise


def parse_request(body) -> ResponsesRequest:
    """Checks every Responses field; raises APIError(400) naming the first bad one."""
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _HANDLED - _IGNORED)
    if unknown:
        raise _bad(unknown[0], f"unknown field {unknown[0]!r}", code="unknown_parameter")
    if body.get("background"):
        raise _bad("background", "kvchat serve answers in the foreground; background must be false")
    if body.get("conversation") is not None:
        raise _bad("conversation", "kvchat serve keeps conversations by previous_response_id")
    if body.get("max_tool_calls") is not None:
        raise _bad("max_tool_calls", "max_tool_calls is not supported; use parallel_tool_calls")
    if body.get("top_logprobs"):
        raise _bad("top_logprobs", "kvchat serve does not return logprobs")
    if "input" not in body:
        raise _bad("input", "input is required", code="missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "instructions must be a string")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("previous_response_id", "previous_response_id must be a response's id")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store", f"store must be a boolean, got {reprlib.repr(store)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"stream must be a boolean, got {reprlib.repr(stream)}")

    names = ("model", "temperature", "top_p", "prompt_cache_key", "user")
    chat = {name: body[name] for name in names if body.get(name) is not None}
    chat.update(stream=stream)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _check_metadata(body.get("metadata"))
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(i, str) for i in include)
    ):
        raise _bad("include", "include must be a list of strings")
    if body.get("reasoning") is not None and not isinstance(body["reasoning"], dict):
        raise _bad("reasoning", "reasoning must be an object")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise _bad("text", "text must be an object, such as {'format': {'type': 'text'}}")
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
        raise _bad("metadata", "metadata must be an object of at most 16 pairs")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise _bad(
                "metadata",
                "metadata keys are at most 64 characters and values strings of at most 512, "
                f"got {reprlib.repr(key)}: {reprlib.repr(value)}",
            )


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise _bad(
                f"tools[{i}]",
                f"kvchat serve runs function tools only, got {reprlib.repr(kind)}",
            )
        protocol.check_tool(tool, f"tools[{i}]")  # named as sent: {"type", "name", ...}
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "tool_choice {'type': 'function'} needs the name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise _bad("tool_choice", "tool_choice allowed_tools is not supported")
    return choice  # "auto", "none", "required", or what the chat checks refuse


def _format(fmt) -> dict:
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"text.format must be an object, got {reprlib.repr(fmt)}")
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
        raise _bad("input", "input must be a string or a non-empty list of items")
    messages: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}]", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"input[{i}].role", f"unknown role {reprlib.repr(role)}")
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
            raise _bad(
                f"input[{i}]",
                "kvchat serve cannot resolve item references: send the item, or "
                "continue with previous_response_id",
            )
        else:
            raise _bad(f"input[{i}].type", f"unknown input item type {reprlib.repr(kind)}")
    return messages


def _strings(item: dict, names: tuple[str, ...], i: int) -> dict:
    for name in names:
        if not isinstance(item.get(name), str):
            raise _bad(f"input[{i}].{name}", f"a {item.get('type')} item needs a string {name}")
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
            raise _bad(param, f"kvchat serve takes text parts only, got {reprlib.repr(kind)}")
        return "".join(parts)
    raise _bad(param, "content must be a string or a list of text parts")


# ------------------------------------------------------------------ bodies
def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def usage(report) -> dict:
    cached = report.reused_tokens if report is not None else 0
    prompt = report.prompt_tokens if report is not None else 0
    generated = report.generated_tokens if report is not None else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    arguments = "" if status == "in_progress" else call.arguments
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def response(request: ResponsesRequest, rid: str, created: int, status: str, output, report):
    """The response object; ``status`` "in_progress", "completed" or "incomplete"."""
    body = request.body
    chat = request.chat_fields
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    text_format = chat.get("response_format") or {"type": "text"}
    if text_format.get("type") == "json_schema":
        text_format = {"type": "json_schema", **text_format["json_schema"]}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": body.get("temperature"),
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage(report) if status != "in_progress" else None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


class Output:
    """A reply's output items as it streams: ``feed`` takes the reply's
    Content and ToolCall items and returns the stream events they make
    (each with its ``sequence_number``); ``items`` are the finished items.
    Blank text is held until something follows it, and dropped before a call."""

    def __init__(self):
        self.items: list[dict] = []
        self._sequence = 0
        self._message: dict | None = None  # the message item being written
        self._text = ""
        self._blank = ""  # whitespace not given out yet

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return out

    def feed(self, items: list) -> list[dict]:
        events: list[dict] = []
        for item in items:
            if isinstance(item, ToolCall):
                self._blank = ""
                events += self._close_message() + self._call(item)
            elif item.text:
                events += self._write(item.text)
        return events

    def close(self, any_call: bool) -> list[dict]:
        """The open message's end (an empty reply is one empty message)."""
        events: list[dict] = []
        if not any_call and self._message is None and not self.items:
            events += self._open_message()
        if self._blank and self._message is not None:
            events += self._delta(self._blank)
        self._blank = ""
        return events + self._close_message()

    def _write(self, text: str) -> list[dict]:
        text, self._blank = self._blank + text, ""
        if not text.strip():
            self._blank = text
            return []
        events = self._open_message() if self._message is None else []
        return events + self._delta(text)

    def _open_message(self) -> list[dict]:
        self._message, self._text = message_item(new_id("msg"), "", "in_progress"), ""
        index = len(self.items)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=index, item=self._message),
            self.event(
                "response.content_part.added",
                item_id=self._message["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _delta(self, text: str) -> list[dict]:
        self._text += text
        return [
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def _close_message(self) -> list[dict]:
        if self._message is None:
            return []
        item_id, index, text = self._message["id"], len(self.items), self._text
        done = message_item(item_id, text)
        self.items.append(done)
        self._message = None
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def _call(self, call: ToolCall) -> list[dict]:
        item_id, index = new_id("fc"), len(self.items)
        done = call_item(item_id, call)
        self.items.append(done)
        where = {"item_id": item_id, "output_index": index}
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=call_item(item_id, call, "in_progress"),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]


def now() -> int:
    return int(time.time())
