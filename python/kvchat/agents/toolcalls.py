"""Tool calls out of a reply's text, as it streams.

Text before the format's first marker is content and streams as it comes
(only a possible marker's first characters are held). From the marker on,
transformers' ``ResponseParser`` reads the tool-call section, and what it
holds is given out when the reply ends: a model ends its turn right after its
last call, and a section read whole is either all calls or all text. Markup
that does not parse (a call's JSON cut short, a marker in prose) is never an
error: the section, from its marker on, is content as it came. Except where
the reply was cut short (``finish(cut=True)``): the calls complete before
the one it was cut inside are calls, and that one is dropped. Markup inside
a call's strings (``quoted.py``) does not close the call.

A reply in channels (gpt-oss's harmony) is parsed from its first character,
and its answer streams too: what its ``final`` (or preamble) channel says
goes out as it comes, up to the first call, which is held to the end. Should
a call then not parse (or the request allow none), the answer before it
stays content and the markup from that call on follows it as text; the
reasoning channel is never content.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from transformers.utils.chat_parsing import ResponseParser

from .formats import ToolFormat
from .json_arguments import dumps, not_json
from .quoted import QuotedMarkup, escaped
from .refs import with_refs_resolved

logger = logging.getLogger("kvchat")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, in OpenAI's terms: ``arguments`` is a JSON string."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Content:
    text: str


class ToolCallParser:
    """``feed(text)`` and ``finish()`` return what became final: ``Content``
    pieces and ``ToolCall`` objects, in the reply's order. Joined, the content
    pieces are ``content``; ``calls`` lists every call."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None, calls: bool = True):
        """``calls=False``: the request allows no call (no tools, or
        ``tool_choice`` "none"), so a call the model writes anyway stays text;
        used for a format in channels, whose answer is read out all the same."""
        self._format = fmt
        self._tools = tools
        self._calls_allowed = calls
        self._names = tool_names(tools)  # None without tools
        self._pending = ""  # text not yet given out: a marker's start, or the section
        self._section: ResponseParser | None = None
        self._failed = False  # the section did not parse: everything is content
        self._started = False  # any non-space text seen (Llama's JSON must come first)
        self.content = ""
        self.calls: list[ToolCall] = []
        self._section_text = ""
        self._held: list = []  # what the section parsed so far, given out at the end
        self._streamed = False  # channels: some of the section's content is out already
        self.cut = False  # a call the reply ended inside was dropped (finish's ``cut``)
        self._quoted: QuotedMarkup | None = None  # set by _parser for JSON and Python calls
        self._in_section = not fmt.markers  # no literal marker: parsed from the start
        if self._in_section:
            self._section = self._parser()

    @property
    def section_text(self) -> str:
        """The tool-call section read so far, from its marker on: "" before
        the marker, and once the section turned out not to parse."""
        return "" if self._failed else self._section_text

    # ---------------------------------------------------------------- feeding
    def feed(self, text: str) -> list:
        if not text:
            return []
        if self._failed:
            return self._content(text)
        if self._in_section:
            return self._feed_section(text)
        self._pending += text
        start, hold = self._marker()
        if start is not None:
            before, section = self._pending[:start], self._pending[start:]
            self._pending = ""
            out = self._content(before)
            self._in_section, self._section = True, self._parser()
            return out + self._feed_section(section)
        out, self._pending = self._pending[:hold], self._pending[hold:]
        return self._content(out)

    def finish(self, cut: bool = False) -> list:
        """The rest, once the reply has ended. ``cut``: the reply was cut
        short (``max_tokens``, a stop string), so a call it ended inside is
        dropped and the calls complete before it are still calls."""
        if self._failed or not self._in_section:
            out, self._pending = self._pending, ""
            return self._content(out)
        if cut and not self._format.channels:
            complete = self._complete_calls()
            if complete is not None:
                return complete
        try:
            if self._format.spec is None:
                items = self._whole_json()
            else:
                events = self._section.finalize()[1]
                if self._format.closed and any(
                    e["type"] == "region_close" and e["field"] == "tool_calls" for e in events
                ):
                    raise ValueError("the reply ended inside a tool call")
                self._read(events)
                items = self._held
            calls = [self._call(item) for item in items if not isinstance(item, str)]
            if calls and not self._calls_allowed:
                raise ValueError("the request allows no tool call")
            self._check_values(calls)
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            return self._fail(error)
        if not calls and not self._format.channels:  # a marker and no call: the section is text
            return self._fail(ValueError("no tool call in the section"))
        out = []
        items = _joined(items)
        for k, item in enumerate(items):
            if isinstance(item, str):
                item = self._without_ignored(item)
                if self._format.unfinished and k == len(items) - 1:
                    item = re.sub(self._format.unfinished, "", item)
                # Blank lines between calls are the markup's, not content; but
                # blank text after an answer streamed so far is that answer's.
                if item.strip() or (k == 0 and self._streamed):
                    out += self._content(item)
            else:
                out.append(calls.pop(0))
        self.calls = [c for c in out if isinstance(c, ToolCall)]
        return out

    # -------------------------------------------------------------- internals
    def _complete_calls(self) -> list | None:
        """The section's calls up to the last one written whole, when the
        section does not read as calls to its end (a call there cut short):
        read with the section closed after that call. None where it reads
        as it is (a partial marker at the end aside), or no call is whole."""
        g = self._format.grammar
        if g is None or g.separator is None:  # no grammar's shape, or one call a reply
            return None
        whole = self._reads(self._section_text)
        if whole is not None and not self._markup_begun(whole[0].content):
            return None
        end, text = g.call_close or "}", self._section_text
        at = len(text)
        for _ in range(16):  # the last few ends (one inside a string does not read)
            at = text.rfind(end, 0, at)
            if at < 0:
                return None
            read = self._reads(text[: at + len(end)] + g.section_close)
            if read is not None and not read[0].content.strip():
                self.cut, self._failed = True, True  # nothing more is read
                self.calls = read[0].calls
                self._pending = self._section_text = ""
                return read[1]
        return None

    def _markup_begun(self, content: str) -> bool:
        """Whether ``content``, read after the calls, is the start of a next
        call's markup or of the section's closing marker (the reply cut there)."""
        g, tail = self._format.grammar, content.strip()
        opens = (g.separator.strip() + g.call_open).strip(), *self._format.markers
        if tail and g.section_close.strip().startswith(tail):
            return True
        return bool(tail) and any(m.startswith(tail) or tail.startswith(m) for m in opens if m)

    def _reads(self, section: str) -> tuple[ToolCallParser, list] | None:
        """(a parser, the calls it read) for ``section`` read alone; None
        where it reads no call."""
        parser = ToolCallParser(self._format, self._tools, self._calls_allowed)
        items = parser.feed(section)
        items += parser.finish()
        if not parser.calls:
            return None
        return parser, [i for i in items if isinstance(i, ToolCall)]

    def _parser(self) -> ResponseParser | None:
        if self._format.spec is None:
            return None
        # Markup inside a JSON (or Python) string does not close the call.
        calls = self._format.spec["fields"].get("tool_calls", {})
        if not self._format.channels and not calls.get("content_args"):
            if calls.get("content") == "json":
                self._quoted = QuotedMarkup()
            elif calls.get("content") == "python-call-list":
                self._quoted = QuotedMarkup("'\"", "{[(")
        # Values are cast by their parameter's type, read through a $ref.
        return ResponseParser(self._format.spec, prefix="", tools=with_refs_resolved(self._tools))

    def _marker(self) -> tuple[int | None, int]:
        """(where a complete marker starts, or None; how much of the pending
        text is content for sure)."""
        text = self._pending
        if self._format.spec is None:  # Llama: the JSON is the whole reply or nothing
            stripped = text.lstrip()
            if not stripped:
                return None, 0
            if any(stripped.startswith(m) for m in self._format.markers) and not self._started:
                return len(text) - len(stripped), 0
            if any(m.startswith(stripped) for m in self._format.markers) and not self._started:
                return None, 0
            self._started = True
            return None, len(text)
        found = [i for i in (text.find(m) for m in self._format.markers) if i >= 0]
        if found:
            return min(found), 0
        return None, len(text) - _partial_marker(text, self._format.markers)

    def _feed_section(self, text: str) -> list:
        self._section_text += text
        if self._format.spec is None:
            return []  # one JSON object: read whole at the end
        if self._quoted is not None:
            text = self._quoted.feed(text)
        try:
            self._read(self._section.feed(text))
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            return self._fail(error)
        return self._stream_channels() if self._format.channels else []

    def _stream_channels(self) -> list:
        """The answer's text parsed so far, up to the first call: what is sure
        to be content. Held: blank text (it may lie between calls), and an
        end that may be the start of markup to drop."""
        count, text = self._answer_held()
        if not text.strip():
            return []
        hold = _partial_marker(text, self._format.ignore)
        out, rest = text[: len(text) - hold], text[len(text) - hold :]
        self._held[:count] = [rest] if rest else []
        self._streamed = self._streamed or bool(out)
        return self._content(out)

    def _answer_held(self) -> tuple[int, str]:
        """(how many held items come before the first call, their text
        without the markup to drop): the answer not yet given out."""
        count = 0
        while count < len(self._held) and isinstance(self._held[count], str):
            count += 1
        return count, self._without_ignored("".join(self._held[:count]))

    def _without_ignored(self, text: str) -> str:
        for markup in self._format.ignore:
            text = text.replace(markup, "")
        return text

    def _read(self, events: list[dict]) -> None:
        """Keeps the section's content pieces and parsed calls, in order."""
        for event in events:
            if event["type"] == "region_open" and event["field"] == "final":
                # Another message of the reply (harmony): apart from the text before.
                held = any(isinstance(item, str) and item.strip() for item in self._held)
                if held or self._streamed:
                    self._held.append("\n\n")
            if event["type"] == "region_chunk" and event["field"] in ("content", "final"):
                quoted = self._quoted
                if quoted is not None and quoted.rewritten and escaped(event["text"]):
                    # A string outside the calls: not text to give out rewritten.
                    raise ValueError("a string outside the calls holds markup")
                self._held.append(event["text"])
            elif event["type"] == "region_close" and event["field"] == "tool_calls":
                value = event["value"]
                self._held += value if isinstance(value, list) else [value]

    def _whole_json(self) -> list[dict]:
        text = self._section_text.strip()
        text = text.removeprefix("<|python_tag|>").strip()
        value = json.loads(text)
        # A JSON answer is not a call: a call names one of the tools and has arguments.
        keys = {self._format.arguments_key, "arguments"}
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("not a call object")
        if not keys & set(value) or (self._names is not None and value["name"] not in self._names):
            raise ValueError(f"not a call of one of the tools: {value['name']!r}")
        arguments = value.get(self._format.arguments_key, value.get("arguments", {}))
        return [{"function": {"name": value["name"], "arguments": arguments}}]

    def _call(self, value) -> ToolCall:
        function = value.get("function") if isinstance(value, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool call without a name: {value!r}")
        arguments = function.get("arguments", function.get(self._format.arguments_key, {}))
        # Arguments are a JSON object (a string holding one), and strict JSON:
        # NaN and Infinity, which Python's json reads, are not JSON.
        if isinstance(arguments, str):
            arguments = json.loads(arguments, parse_constant=not_json)
        if not isinstance(arguments, dict):
            raise ValueError(f"tool-call arguments must be an object, got {arguments!r}")
        arguments = dumps(arguments)
        # A lone surrogate ("\ud800" written as an escape) is no text a
        # response can carry: UnicodeEncodeError, a ValueError, so the markup
        # stays text.
        arguments.encode("utf-8")
        return ToolCall(self._format.new_id(), function["name"].strip(), arguments)

    def _content(self, text: str) -> list:
        if not text:
            return []
        self.content += text
        return [Content(text)]

    def _check_values(self, calls: list[ToolCall]) -> None:
        """In an XML format, a value that holds its own closing tag is read
        short (or closes its call early): every closing tag written must be
        one parameter read, or the calls are not what the model wrote."""
        g = self._format.grammar
        if g is None or g.xml is None or not calls:
            return
        tag = g.xml[2].strip()
        written = self._section_text.count(tag)
        read = sum(len(json.loads(call.arguments)) for call in calls)
        if written != read:
            raise ValueError(f"{written} {tag!r} tags for {read} values")

    def _fail(self, error: Exception) -> list:
        """The section is text after all: from its marker on, as it came. A
        reply in channels keeps its answer before the first call (out already,
        or held) and never gives its reasoning: the text is from that call on."""
        logger.debug("kvchat: tool-call markup did not parse (%s); kept as text", error)
        self._failed = True
        answer = self._answer_held()[1] if self._format.channels else ""
        if not (answer.strip() or self._streamed):
            answer = ""
        self._held = []
        text, self._pending, self._section_text = (
            self._section_text + self._pending,
            "",
            "",
        )
        if self._format.channels:
            text = answer + text[self._first_call(text) :]
        return self._content(text)

    def _first_call(self, text: str) -> int:
        """Where the first call's markup starts in the section's ``text``
        (its end when there is none: the answer before it is out)."""
        pattern = self._format.spec["fields"]["tool_calls"]["open_pattern"]
        # Its names capture the call's name, twice where it may be in two
        # places, which Python's re refuses; here only the start counts.
        found = re.search(re.sub(r"\(\?P<\w+>", "(?:", pattern), text)
        return len(text) if found is None else found.start()


def tool_names(tools: list[dict] | None) -> set[str] | None:
    """The names of ``tools`` (OpenAI's chat or Responses shape); None without tools."""
    if not tools:
        return None
    return {t.get("function", t).get("name") for t in tools if isinstance(t, dict)}


def _partial_marker(text: str, markers) -> int:
    """How many of ``text``'s last characters may be the start of one of
    ``markers`` (the longest such start): held until the next piece tells."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _joined(items: list) -> list:
    """Consecutive text pieces as one (a marker to drop may span two)."""
    out: list = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        else:
            out.append(item)
    return out
