"""One request's reply as it is sent: the stream's text, cut at a stop string,
and read for tool calls when the request has tools (for gpt-oss's channels,
always)."""

from __future__ import annotations

import threading

from starlette.responses import JSONResponse, StreamingResponse

from ..agents import Content, ToolCall, ToolCallParser, ToolFormat
from ..agents.streamed_calls import CallStream, streamable
from . import chat_response

DONE = object()


class Reply:
    """A turn's stream as the client gets it: ``next_items()`` gives the
    next ``Content`` and ``ToolCall`` items (an empty list while text is held
    back), then ``DONE``. A call written in its format's grammar's shape also
    gives ``CallStart`` and ``CallArguments`` items as it is written (not in
    LFM2's Python calls nor a format without a grammar; in gpt-oss's channels
    only under the grammar); its ``ToolCall`` at the end comes after the
    piece that completes its arguments, with the same id (``streamed_calls.py``)."""

    def __init__(self, stream, first, chat, max_tokens, session, ns, fmt):
        self.stream, self.chat, self.session, self.ns = stream, chat, session, ns
        self.max_tokens = max_tokens
        self._first = first
        self.finished = threading.Lock()  # finish() runs once, whoever gets here first
        # Run once a turn its client left is finished (a streamed response stores itself).
        self.on_abandoned = None
        # What keeps the session in use (serve/expiry.py): its turn, until it is
        # finished, and its response, until its last byte is handed to the server.
        self._holds = {"turn", "response"}
        self._holds_lock = threading.Lock()
        self._trim = StopTrimmer(chat.stop)
        self._parser = None
        if fmt is not None:
            self._parser = ToolCallParser(fmt, chat.tools, calls=calls_allowed(chat))
        # Calls are followed in the section the parser reads. A reply in
        # channels is followed only under the grammar: unforced, the section
        # is the whole reply, reasoning included.
        follow = calls_allowed(chat) and streamable(fmt)
        if follow and (chat.tool_choice == "required" or not fmt.channels):
            one = None if chat.parallel_tool_calls else 1
            self._follow = CallStream(fmt, chat.tools, max_calls=one)
        else:
            self._follow = None
        self._followed = 0  # how much of the parser's section the stream has read
        self._ended = False  # the stream's end was seen: never ask it again
        self.text = ""  # the reply as sent, before tool calls are read out of it
        self.content = ""
        self.calls: list[ToolCall] = []
        self.grammar = None  # the GrammarProcessor of a constrained turn (turns.py sets it)

    def let_go(self, hold: str) -> bool:
        """Drops ``hold`` ("turn" or "response"); True for the one call that
        drops the last of them: the session is idle from then on."""
        with self._holds_lock:
            if hold not in self._holds:
                return False
            self._holds.discard(hold)
            return not self._holds

    def next_items(self):
        if self._ended:
            return DONE
        if self._trim.stopped:
            return self._end("")
        if self._first is not None:
            raw, self._first = self._first, None
        else:
            raw = next(self.stream, DONE)
        if raw is DONE:
            # What a stop string that never matched held back is the reply's end.
            return self._end(self._trim.flush())
        text = self._trim.feed(raw)
        if self._trim.stopped:
            return self._end(text)
        return self._read(text, final=False)

    @property
    def ended(self) -> bool:
        """Whether the reply was read to its end (else its client left first)."""
        return self._ended

    def collect_items(self) -> list:
        """Every item up to the reply's end."""
        out = []
        while (items := self.next_items()) is not DONE:
            out += items
        return out

    def _end(self, text: str):
        self._ended = True
        items = self._read(text, final=True)
        return items if items else DONE

    def _read(self, text: str, final: bool) -> list:
        self.text += text
        if self._parser is None:
            items = [Content(text)] if text else []
        else:
            # Content before the section's marker, then what is followed of the
            # section, then (at the end) the section read whole.
            items = self._parser.feed(text)
            if self._follow is not None:
                section = self._parser.section_text
                items += self._follow.feed(section[self._followed :])
                # A section that did not parse reads as "": nothing more to follow.
                self._followed = max(self._followed, len(section))
            if final:
                items += self._settled(self._parser.finish(cut=self._cut()))
        if not self.chat.parallel_tool_calls:  # one call at most: the first
            kept: list = []
            for item in items:
                first = not self.calls and not any(isinstance(k, ToolCall) for k in kept)
                if first or not isinstance(item, ToolCall):
                    kept.append(item)
            items = kept
        for item in items:
            if isinstance(item, ToolCall):
                self.calls.append(item)
            elif isinstance(item, Content):
                self.content += item.text
        return items

    def _cut(self) -> bool:
        """Whether the reply was cut short: by a stop string, or at max_tokens."""
        report = getattr(self.stream, "report", None)  # a plain iterator in tests
        hit_limit = report is not None and report.generated_tokens >= self.max_tokens
        return self._trim.stopped or hit_limit

    def _settled(self, ended: list) -> list:
        """The section read whole, each followed call with the ids and
        arguments given out, after the piece that completes them."""
        if self._follow is None:
            return ended
        settled = iter(self._follow.settle([i for i in ended if isinstance(i, ToolCall)]))
        out: list = []
        for item in ended:
            if not isinstance(item, ToolCall):
                out.append(item)
                continue
            for piece in settled:  # up to and including the call
                out.append(piece)
                if isinstance(piece, ToolCall):
                    break
        return out

    def message(self) -> dict:
        return chat_response.message(self.content, self.calls)

    @property
    def report(self):
        return self.stream.report

    def finish_reason(self, stop_ids: set[int]) -> str:
        report = self.stream.report
        hit_limit = (
            report is not None
            and report.generated_tokens >= self.max_tokens
            and not (report.output_ids and report.output_ids[-1] in stop_ids)
        )
        # Calls before one the reply was cut inside are calls, and the reply
        # was cut; so it was when max_tokens ended it after a complete call,
        # before the model ended it (it might have written more calls).
        cut = hit_limit or (self._parser is not None and self._parser.cut)
        if self.calls and not cut:
            return "tool_calls"
        if self._trim.stopped or report is None:
            return "stop"
        return "length" if hit_limit else "stop"


def tool_format(chat, fmt: ToolFormat | None) -> ToolFormat | None:
    """The format to read ``chat``'s reply with, or None (the reply is its
    text): for tool calls when it allows them; a reply in channels (gpt-oss)
    also without, since its answer is one channel of it and its reasoning
    another, except under a JSON response_format."""
    if fmt is None or chat.prompt is not None:  # a text completion is its text
        return None
    if calls_allowed(chat):
        return fmt
    # Under a JSON schema alone the reply is the JSON, whatever text it holds.
    return fmt if fmt.channels and chat.json_schema is None else None


def calls_allowed(chat) -> bool:
    """Whether ``chat`` lets the model call a tool."""
    return bool(chat.tools) and chat.tool_choice != "none"


class _EndsWith:
    """A turn's response: ``on_end`` runs however the response ends (its
    last byte handed to the server, or its client gone), even when its body
    never started (the client gone before the headers)."""

    def __init__(self, content, on_end, **kwargs):
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class StreamedReplyResponse(_EndsWith, StreamingResponse):
    """The HTTP response of a streamed reply: its server-sent events (``_EndsWith``)."""


class JSONReplyResponse(_EndsWith, JSONResponse):
    """The HTTP response of a whole reply: one JSON body (``_EndsWith``)."""


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
