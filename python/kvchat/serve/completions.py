"""``POST /v1/completions``: a text prompt continued as it is, with no chat
template. It runs as a chat request whose prompt is the text, so it gets the
same checks (sampling, ``stop``, ``max_tokens``) and errors. Its turn runs on
the session ``prompt_cache_key`` or ``user`` names (never one that holds a
chat), else on the session whose prompt and completion the prompt continues,
else on a new one, which starts from another text session's prefix where they
share one (the core cuts a text, which has no message boundary, at a multiple
of ``min_shared_tokens``)."""

from __future__ import annotations

import time
import uuid

from ..prompting import check_json
from . import chat_response
from .chat_request import ChatRequest, parse_chat_request
from .errors import APIError

# The legacy API's fields; the chat request's checks take the rest.
_REFUSED = {
    "echo": "kvchat serve does not echo the prompt",
    "suffix": "kvchat serve does not insert: suffix is not supported",
    "best_of": "kvchat serve returns one choice per request; best_of must be 1",
    "logprobs": "kvchat serve does not return logprobs",
}
_CHAT_ONLY = {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "max_completion_tokens",
    "top_logprobs",
}


def parse_request(body) -> ChatRequest:
    """Checks every field; raises APIError(400) naming the first bad one."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    chat_only = sorted(set(body) & _CHAT_ONLY)
    if chat_only:
        name = chat_only[0]
        message = f"unknown field {name!r} (a chat field: see /v1/chat/completions)"
        raise APIError(400, message, param=name, code="unknown_parameter")
    for name, message in _REFUSED.items():
        value = body.get(name)
        if value not in (None, False, 0) and not (name == "best_of" and value == 1):
            raise APIError(400, message, param=name, code="invalid_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(
            400,
            "prompt must be a non-empty string (or a list of one); kvchat serve returns "
            "one choice per request",
            param="prompt",
            code="missing_required_parameter" if "prompt" not in body else "invalid_value",
        )
    try:
        check_json(prompt, "prompt")  # a lone surrogate, say
    except ValueError as error:
        raise APIError(400, str(error), param="prompt", code="invalid_value") from None
    fields = {k: v for k, v in body.items() if k not in (*_REFUSED, "prompt")}
    chat = parse_chat_request({**fields, "messages": [{"role": "user", "content": "-"}]})
    chat.messages, chat.prompt = [], prompt
    chat.extra["session_field"] = "prompt_cache_key" if body.get("prompt_cache_key") else "user"
    return chat


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def body(cid: str, model: str, text: str, finish_reason: str, report) -> dict:
    return {**chunk(cid, model, text, finish_reason), "usage": chat_response.usage(report)}


def chunk(cid: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(cid: str, model: str, report) -> dict:
    return {**chunk(cid, model, ""), "choices": [], "usage": chat_response.usage(report)}
