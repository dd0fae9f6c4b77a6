"""The chat-completions response and stream-chunk bodies, in OpenAI's shape."""

from __future__ import annotations

import time
import uuid

from ..agents.streamed_calls import CallStart


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
    """A call given out whole: its index, id and name, then its arguments."""
    return [call_start(CallStart(index, call.id, call.name)), call_arguments(index, call.arguments)]


def call_start(start: CallStart) -> dict:
    """A streamed call's first delta: its index, id, type and name."""
    function = {"name": start.name, "arguments": ""}
    return {
        "tool_calls": [
            {"index": start.index, "id": start.id, "type": "function", "function": function}
        ]
    }


def call_arguments(index: int, text: str) -> dict:
    """A piece of call ``index``'s arguments."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


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
