"""A Responses API reply in OpenAI's shape: the response object, its output
items (messages and function calls), and the stream events that write them."""

from __future__ import annotations

import time
import uuid

from ..agents import ToolCall
from ..agents.streamed_calls import CallArguments, CallStart
from .responses_request import ResponsesRequest


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


def response(
    request: ResponsesRequest,
    rid: str,
    created: int,
    status: str,
    output,
    report,
    reason: str = "max_output_tokens",
):
    """The response object; ``status`` "in_progress", "completed" or
    "incomplete" (why: ``reason``, "max_output_tokens" or "client_disconnected")."""
    body = request.body
    chat = request.chat_fields
    incomplete = {"reason": reason} if status == "incomplete" else None
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
        # Calls given out as they were written: [item id, index, start, arguments].
        self._started: list[list] = []
        self._ended = 0  # of them, how many are done
        self.announced = False  # the client got response.created (set by the stream)

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return out

    def feed(self, items: list) -> list[dict]:
        events: list[dict] = []
        for item in items:
            if isinstance(item, CallStart):
                self._blank = ""
                events += self._close_message() + self._start_call(item)
            elif isinstance(item, CallArguments):
                events += self._arguments(item)
            elif isinstance(item, ToolCall):
                self._blank = ""
                events += self._close_message() + self._call(item)
            elif item.text:
                # Text after a call given out as it was written: the call was
                # cut short (max_output_tokens, a stop string) and is text.
                events += self._cut_calls() + self._write(item.text)
        return events

    def close(self, any_call: bool, cut: bool = False) -> list[dict]:
        """The open message's end (an empty reply is one empty message);
        ``cut``: the reply was cut short, so that message is "incomplete", as
        OpenAI marks it."""
        events: list[dict] = self._cut_calls()
        if not any_call and self._message is None and not self.items:
            events += self._open_message()
        if self._blank and self._message is not None:
            events += self._delta(self._blank)
        self._blank = ""
        return events + self._close_message("incomplete" if cut else "completed")

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

    def _close_message(self, status: str = "completed") -> list[dict]:
        if self._message is None:
            return []
        item_id, index, text = self._message["id"], len(self.items), self._text
        done = message_item(item_id, text, status)
        self.items.append(done)
        self._message = None
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def _start_call(self, start: CallStart) -> list[dict]:
        """A call given out as it is written: its item now, in its place
        among the output items, and its arguments as they come."""
        item_id, index = new_id("fc"), len(self.items)
        begun = call_item(item_id, ToolCall(start.id, start.name, ""), "in_progress")
        self.items.append(begun)
        self._started.append([item_id, index, start, ""])
        return [self.event("response.output_item.added", output_index=index, item=begun)]

    def _arguments(self, piece: CallArguments) -> list[dict]:
        started = self._started[piece.index]
        started[3] += piece.text
        where = {"item_id": started[0], "output_index": started[1]}
        return [self.event("response.function_call_arguments.delta", **where, delta=piece.text)]

    def _cut_calls(self) -> list[dict]:
        """Calls given out as they were written that never ended: done as
        incomplete, with the arguments written so far."""
        events = []
        while self._ended < len(self._started):
            item_id, index, start, written = self._started[self._ended]
            self._ended += 1
            done = call_item(item_id, ToolCall(start.id, start.name, written), "incomplete")
            self.items[index] = done
            events.append(self.event("response.output_item.done", output_index=index, item=done))
        return events

    def _call(self, call: ToolCall) -> list[dict]:
        if self._ended < len(self._started):  # its item and arguments are out
            item_id, index, _, _ = self._started[self._ended]
            self._ended += 1
            opened = []
        else:
            item_id, index = new_id("fc"), len(self.items)
            self.items.append(None)  # its place
            where = {"item_id": item_id, "output_index": index}
            opened = [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item=call_item(item_id, call, "in_progress"),
                ),
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            ]
        done = call_item(item_id, call)
        self.items[index] = done
        where = {"item_id": item_id, "output_index": index}
        return opened + [
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
