"""The OpenAI chat-completions request, checked field by field. A field
kvchat cannot serve is refused by name (400), never silently ignored."""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field

from ..prompting import check_json, check_template_kwargs, validate_messages
from .constraints import check_tool, parse_response_format, parse_tool_choice
from .errors import bad_request

# Below this, a temperature is greedy (as vLLM does): dividing logits by it
# would overflow to inf and sample from NaN.
GREEDY_TEMPERATURE = 1e-5
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


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad_request(
            name, f"{name} must be a number in [{low}, {high}], got {reprlib.repr(value)}"
        )
    return float(value)


def _integer(body: dict, name: str, low: int, high: int = 2**62) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(
            name, f"{name} must be an integer in [{low}, {high}], got {reprlib.repr(value)}"
        )
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 512:
        raise bad_request(name, f"{name} must be a non-empty string of at most 512 characters")
    return value


def session_key(body: dict, name: str) -> str | None:
    """A session key from the body (prompt_cache_key, user): refused before
    anything runs unless it can come back as the X-Session-ID header."""
    value = _string(body, name)
    if value is not None and not header_value(value):
        raise bad_request(
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


def check_fields(body, known: set[str]) -> None:
    """That ``body`` is a JSON object of ``known`` fields; 400 naming the first other one."""
    if not isinstance(body, dict):
        raise bad_request(
            None, f"the request body must be a JSON object, got {type(body).__name__}"
        )
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(unknown[0], f"unknown field {unknown[0]!r}", code="unknown_parameter")


def parse_chat_request(body) -> ChatRequest:
    """Checks every field; raises APIError(400) naming the first bad one."""
    check_fields(body, _HANDLED | _IGNORED)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "model must be a non-empty string (see GET /v1/models)")
    if "messages" not in body:
        raise bad_request("messages", "messages is required", code="missing_required_parameter")
    try:
        messages = validate_messages(body["messages"])
    except (TypeError, ValueError) as error:
        raise bad_request("messages", str(error)) from None
    for i, message in enumerate(messages):
        if message["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role", f"unknown role {message['role']!r}")
        if message["role"] == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise bad_request(
                f"messages[{i}].tool_call_id", "a tool message needs its tool_call_id"
            )

    # What one text choice cannot carry.
    if _integer(body, "n", 1, 128) not in (None, 1):
        raise bad_request("n", "kvchat serve returns one choice per request; n must be 1")
    if body.get("logprobs"):
        raise bad_request("logprobs", "kvchat serve does not return logprobs")
    if body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "kvchat serve does not return logprobs")
    if body.get("logit_bias"):
        raise bad_request("logit_bias", "kvchat serve does not support logit_bias")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0):
            raise bad_request(name, f"{name} is not supported; use repetition_penalty")
    json_schema = parse_response_format(body.get("response_format"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", "tools must be a list of tool objects")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise bad_request(
                    "tools",
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                    f"'description': str, 'parameters': object}}}}, got {reprlib.repr(tool)}",
                )
        try:
            check_json(tools, "tools")  # first: nesting and text that is no Unicode
        except ValueError as error:
            raise bad_request("tools", str(error)) from None
        for i, tool in enumerate(tools):
            check_tool(tool["function"], f"tools[{i}]", tool.get("type", "function"))
    tool_choice, tool_name = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        message = f"parallel_tool_calls must be a boolean, got {reprlib.repr(parallel)}"
        raise bad_request("parallel_tool_calls", message)
    # A named function is called once: the grammar allows one call, the reply keeps one.
    parallel = parallel and tool_name is None
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("chat_template_kwargs", "chat_template_kwargs must be an object")
    try:
        check_template_kwargs(template_kwargs)
    except (TypeError, ValueError) as error:
        raise bad_request("chat_template_kwargs", str(error)) from None

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream", f"stream must be a boolean, got {reprlib.repr(stream)}")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad_request(
            "stream_options", "stream_options is an object, and only with stream: true"
        )
    include_usage = bool((options or {}).get("include_usage", False))

    max_tokens = _integer(body, "max_completion_tokens", 1)
    max_tokens_field = "max_completion_tokens"  # the field errors about it name
    if max_tokens is None:
        max_tokens, max_tokens_field = _integer(body, "max_tokens", 1), "max_tokens"
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
        raise bad_request("stop", "stop must be a non-empty string or a list of up to 4 of them")
    try:
        check_json(stop, "stop")
    except ValueError as error:
        raise bad_request("stop", str(error)) from None

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
            raise bad_request(
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
        extra={"max_tokens_field": max_tokens_field},
    )
