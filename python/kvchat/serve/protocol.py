"""The OpenAI chat-completions request, checked field by field, and the
response and stream-chunk bodies. A field kvchat cannot serve is refused by
name (400), never silently ignored."""

from __future__ import annotations

import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field

from ..prompting import check_json, check_template_kwargs, validate_messages
from .errors import APIError

# Below this, a temperature is greedy (as vLLM does): dividing logits by it
# would overflow to inf and sample from NaN.
GREEDY_TEMPERATURE = 1e-5
# A tool's name, as OpenAI allows it (and dots, which some templates write).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# What a session key may be: it is returned as the X-Session-ID header, so
# printable ASCII with no space at either end (an HTTP header value).
_HEADER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")

# Accepted and ignored: they change nothing kvchat produces for one choice.
_IGNORED = {
    "store",
    "metadata",
    "service_tier",
    "prediction",
    "modalities",
    "safety_identifier",
    "prompt_cache_retention",
    "reasoning_effort",
    "verbosity",
}
_HANDLED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "repetition_penalty",
    "stop",
    "seed",
    "n",
    "user",
    "prompt_cache_key",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "logprobs",
    "top_logprobs",
    "response_format",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
}


def _bad(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(name, f"{name} must be a number in [{low}, {high}], got {reprlib.repr(value)}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int = 2**62) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(name, f"{name} must be an integer in [{low}, {high}], got {reprlib.repr(value)}")
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 512:
        raise _bad(name, f"{name} must be a non-empty string of at most 512 characters")
    return value


def session_key(body: dict, name: str) -> str | None:
    """A session key from the body (prompt_cache_key, user): refused before
    anything runs unless it can come back as the X-Session-ID header."""
    value = _string(body, name)
    if value is not None and not header_value(value):
        raise _bad(
            name,
            f"{name} must be printable ASCII with no space at either end (it is returned "
            f"as the X-Session-ID header), got {reprlib.repr(value)}",
        )
    return value


def header_value(value: str) -> bool:
    """Whether ``value`` can be sent as an HTTP header value as it is."""
    return _HEADER_VALUE.fullmatch(value) is not None


@dataclass
class ChatRequest:
    """What a request asks for, in kvchat's terms."""

    model: str
    messages: list[dict]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    generate_kwargs: dict
    stop: list[str]
    tools: list | None
    template_kwargs: dict | None
    session_key: str | None  # prompt_cache_key, else user
    seed: int | None
    tool_choice: str = "auto"  # "auto", "none", "required" (a named function too)
    tool_name: str | None = None  # the function tool_choice names
    parallel_tool_calls: bool = True
    json_schema: dict | None = None  # response_format's, {"type": "object"} for json_object
    prompt: str | None = None  # a text completion's prompt (messages are then empty)
    extra: dict = field(default_factory=dict)

    @property
    def constrained(self) -> bool:
        """Whether a grammar decides what the reply may be."""
        return self.tool_choice == "required" or self.json_schema is not None


def parse_chat_request(body) -> ChatRequest:
    """Checks every field; raises APIError(400) naming the first bad one."""
    if not isinstance(body, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _HANDLED - _IGNORED)
    if unknown:
        raise _bad(unknown[0], f"unknown field {unknown[0]!r}", code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model must be a non-empty string (see GET /v1/models)")
    if "messages" not in body:
        raise _bad("messages", "messages is required", code="missing_required_parameter")
    try:
        messages = validate_messages(body["messages"])
    except (TypeError, ValueError) as error:
        raise _bad("messages", str(error)) from None
    for i, message in enumerate(messages):
        if message["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", f"unknown role {message['role']!r}")
        if message["role"] == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _bad(f"messages[{i}].tool_call_id", "a tool message needs its tool_call_id")

    # What one text choice cannot carry.
    if _integer(body, "n", 1, 128) not in (None, 1):
        raise _bad("n", "kvchat serve returns one choice per request; n must be 1")
    if body.get("logprobs"):
        raise _bad("logprobs", "kvchat serve does not return logprobs")
    if body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "kvchat serve does not return logprobs")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "kvchat serve does not support logit_bias")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0):
            raise _bad(name, f"{name} is not supported; use repetition_penalty")
    json_schema = _response_format(body.get("response_format"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "tools must be a list of tool objects")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _bad(
                    "tools",
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                    f"'description': str, 'parameters': object}}}}, got {reprlib.repr(tool)}",
                )
        try:
            check_json(tools, "tools")  # first: nesting and text that is no Unicode
        except ValueError as error:
            raise _bad("tools", str(error)) from None
        for i, tool in enumerate(tools):
            check_tool(tool["function"], f"tools[{i}]", tool.get("type", "function"))
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        message = f"parallel_tool_calls must be a boolean, got {reprlib.repr(parallel)}"
        raise _bad("parallel_tool_calls", message)
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise _bad("chat_template_kwargs", "chat_template_kwargs must be an object")
    try:
        check_template_kwargs(template_kwargs)
    except (TypeError, ValueError) as error:
        raise _bad("chat_template_kwargs", str(error)) from None

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"stream must be a boolean, got {reprlib.repr(stream)}")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options", "stream_options is an object, and only with stream: true")
    include_usage = bool((options or {}).get("include_usage", False))

    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad("stop", "stop must be a non-empty string or a list of up to 4 of them")
    try:
        check_json(stop, "stop")
    except ValueError as error:
        raise _bad("stop", str(error)) from None

    # Sampling: greedy when temperature is 0, as OpenAI's API documents (and
    # below GREEDY_TEMPERATURE, whose division would overflow).
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _integer(body, "top_k", 0)
    penalty = _number(body, "repetition_penalty", 0.01, 10.0)
    kwargs: dict = {"do_sample": temperature is None or temperature >= GREEDY_TEMPERATURE}
    if temperature is None:
        temperature = 1.0
    if kwargs["do_sample"]:
        kwargs["temperature"] = temperature
        kwargs["top_p"] = 1.0 if top_p is None else top_p
        kwargs["top_k"] = top_k or 0
    if penalty is not None:
        kwargs["repetition_penalty"] = penalty
    min_tokens = _integer(body, "min_tokens", 0)
    if min_tokens:
        if tool_choice == "required" or json_schema is not None:
            # The grammar may allow only the end of the reply, which min_tokens forbids.
            raise _bad(
                "min_tokens",
                "min_tokens cannot be combined with tool_choice "
                "'required', a named function or a JSON response_format",
            )
        kwargs["min_new_tokens"] = min_tokens

    key = session_key(body, "prompt_cache_key") or session_key(body, "user")
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        generate_kwargs=kwargs,
        stop=stop,
        tools=tools,
        template_kwargs=template_kwargs,
        session_key=key,
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel,
        json_schema=json_schema,
    )


def check_tool(function: dict, where: str, kind="function") -> None:
    """A function tool kvchat can call and constrain: OpenAI's name rule, and
    parameters that are a JSON schema of an object (arguments are an object)."""
    if kind != "function":
        raise _bad(f"{where}.type", f"kvchat serve runs function tools only, got {kind!r}")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise _bad(
            f"{where}.name",
            f"a tool's name must be 1 to 64 letters, digits, '_', '-' or '.', got "
            f"{reprlib.repr(name)}",
        )
    parameters = function.get("parameters")
    if parameters is not None and not _object_schema(parameters):
        raise _bad(
            f"{where}.parameters",
            "a tool's parameters must be a JSON schema of an object, got "
            f"{reprlib.repr(parameters)}",
        )


# What a schema with no "type" may hold and still describe only objects.
_OBJECT_KEYWORDS = {
    "properties", "required", "additionalProperties", "description", "title", "$defs",
    "definitions", "$schema", "$id", "patternProperties", "minProperties", "maxProperties",
}  # fmt: skip


def _object_schema(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    if "type" in schema:
        return schema["type"] == "object"
    return set(schema) <= _OBJECT_KEYWORDS


def _tool_choice(value, tools: list | None) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the named function or None)."""
    if value is None or value in ("auto", "none"):
        return value or "auto", None
    names = [t["function"]["name"] for t in tools or []]
    if value == "required":
        if not names:
            raise _bad("tool_choice", "tool_choice 'required' needs tools")
        return "required", None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise _bad(
            "tool_choice",
            "tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': str}}}}, got {reprlib.repr(value)}",
        )
    if name not in names:
        raise _bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "required", name


def _response_format(value) -> dict | None:
    """The JSON schema a reply must match, or None for plain text."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(
                "response_format",
                "response_format json_schema needs "
                "{'json_schema': {'name': str, 'schema': object}}",
            )
        try:
            check_json(schema, "response_format")
        except ValueError as error:
            raise _bad("response_format", str(error)) from None
        return schema
    raise _bad(
        "response_format",
        "response_format type must be 'text', 'json_object' or 'json_schema', got "
        f"{reprlib.repr(value)}",
    )


# ----------------------------------------------------------------- responses
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(report) -> dict:
    """OpenAI's usage; cached_tokens is what the session reused (0, not absent)."""
    return {
        "prompt_tokens": report.prompt_tokens,
        "completion_tokens": report.generated_tokens,
        "total_tokens": report.prompt_tokens + report.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": report.reused_tokens},
    }


def message(content: str, calls: list) -> dict:
    """The assistant message: with tool calls, content is None when blank."""
    if not calls:
        return {"role": "assistant", "content": content}
    return {
        "role": "assistant",
        "content": content if content.strip() else None,
        "tool_calls": [call.as_dict() for call in calls],
    }


def tool_call_deltas(index: int, call) -> list[dict]:
    """A streamed call: its index, id and name, then its arguments."""
    return [
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


def completion(cid: str, model: str, message: dict, finish_reason: str, report) -> dict:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage(report),
    }


def chunk(cid: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def usage_chunk(cid: str, model: str, report) -> dict:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(report),
    }


class StopTrimmer:
    """Cuts the reply at the first stop string, as OpenAI does (the stop string
    is not returned). Fed streamed pieces, it holds back only what could still
    be the start of a stop string."""

    def __init__(self, stop: list[str]):
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self._pending += piece
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        safe = len(self._pending) - self._hold
        out, self._pending = self._pending[: max(safe, 0)], self._pending[max(safe, 0) :]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
