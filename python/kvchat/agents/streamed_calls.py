"""A forced call's name and arguments as they are written.

Under a tool-call grammar (``tool_choice`` "required" or a named function)
the reply is the grammar's text exactly: the format's markup, each call's
name, and its arguments as compact JSON. So a call is certain from the moment
its name is written, and its arguments can go out as they come, where an
unconstrained reply's markup is read only when the reply ends (it may turn
out to be text). ``CallStream`` follows that text and reports each call's
start and the arguments written since the last piece; the parser still reads
the section whole, and the call it gives back carries the id given out at
the start and the arguments as written (``settle``).

In the XML formats the arguments become JSON only when they are read: each
parameter goes out once its closing tag is written, as the JSON the parser
reads it as (the call so far, closed and read by the format's own parser, so
the pieces join into exactly the arguments read at the end), and the closing
brace with the call's closing markup. LFM2's Python calls, whose arguments
have no closing tag of their own, are not followed: they go out whole when
the reply ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

import regex  # partial matching: whether a header is still being written

from .formats import CallGrammar, ToolFormat
from .toolcalls import ToolCall, ToolCallParser

logger = logging.getLogger("kvchat")


@dataclass(frozen=True)
class CallStart:
    """A call's start: its index among the reply's calls, its id and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """Arguments text of call ``index`` written since its last piece."""

    index: int
    text: str


def streamable(fmt: ToolFormat | None) -> bool:
    """Whether ``fmt``'s forced calls can be followed as they are written."""
    g = fmt.grammar if fmt is not None else None
    return g is not None and not g.keyword_arguments


class CallStream:
    """``feed(text)`` returns ``CallStart`` and ``CallArguments`` items for a
    reply written under ``fmt``'s tool-call grammar; ``settle(calls)`` gives
    the parsed calls the ids and arguments text given out."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None):
        """``tools``: the request's, which XML values are read back typed by."""
        g: CallGrammar = fmt.grammar
        self._format = fmt
        self._grammar = g
        self._tools = tools
        self._call_start = 0  # where the call being written starts
        self._text = ""
        self._pos = 0  # where reading goes on
        # section, call, arguments, after, between (then call again); lost:
        # the text is not the grammar's, and nothing more is followed.
        self._state = "section"
        self._header = _header(g)
        self._between = g.separator or ""
        self._after = ("}" if g.name_in_json else "") + g.call_close
        self._section_open = g.section_open
        self._depth = 0  # the arguments' JSON nesting, while in them
        self._string = False
        self._escape = False
        self.calls: list[tuple[str, str]] = []  # (id, arguments as written)

    def feed(self, text: str) -> list:
        self._text += text
        out: list = []
        while self._state != "lost":
            if self._state == "section":
                if not self._skip(self._section_open):
                    break
                self._state = "call"
            elif self._state == "between":  # the separator before a next call
                if not self._skip(self._between):
                    break
                self._state = "call"
            elif self._state == "call":
                found = self._header.match(self._text, self._pos)
                if found is None:
                    # Not all written yet, or not the grammar's text (a turn cut
                    # at a stop string): then nothing more is followed.
                    if not self._header_prefix(self._text[self._pos :]):
                        self._state = "lost"
                    break
                self._call_start, self._pos = found.start(), found.end()
                call_id = self._format.new_id()
                self.calls.append((call_id, ""))
                out.append(CallStart(len(self.calls) - 1, call_id, found["name"]))
                self._state = "arguments" if self._grammar.xml is None else "parameters"
            elif self._state == "parameters":
                if not self._parameters(out):
                    break
                self._state = "between"
            elif self._state == "arguments":
                start = self._pos
                if self._depth == 0 and start < len(self._text) and self._text[start] != "{":
                    self._state = "lost"
                    break
                closed = self._scan()
                if self._pos > start:
                    self._give(out, self._text[start : self._pos])
                if not closed:
                    break
                self._state = "after"
            else:  # after: the call's closing markup
                if not self._skip(self._after):
                    break
                self._state = "between"
        return out

    def settle(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The parsed ``calls`` with the ids given out, and as arguments the
        text given out when it holds the same object (under the grammar it
        always does; where not, the parsed text, and a warning)."""
        out = []
        for i, call in enumerate(calls):
            if i >= len(self.calls):
                out.append(call)
                continue
            call_id, written = self.calls[i]
            try:
                same = json.loads(written) == json.loads(call.arguments)
            except ValueError:
                same = False
            if not same:
                logger.warning(
                    "kvchat: streamed arguments of call %d differ from the parsed ones", i
                )
            out.append(
                dataclasses.replace(call, id=call_id, arguments=written if same else call.arguments)
            )
        return out

    # -------------------------------------------------------------- internals
    def _give(self, out: list, text: str) -> None:
        call_id, written = self.calls[-1]
        self.calls[-1] = (call_id, written + text)
        out.append(CallArguments(len(self.calls) - 1, text))

    def _parameters(self, out: list) -> bool:
        """Gives out each XML parameter written whole, then the closing brace
        once the call's closing markup is: True then, False while the call
        is still being written (or the text is not the grammar's: "lost")."""
        g = self._grammar
        value_close = g.xml[2]
        while True:
            rest = self._text[self._pos :]
            if rest.startswith(g.call_close):
                self._pos += len(g.call_close)
                self._give(out, "}" if self.calls[-1][1] else "{}")
                return True
            end = rest.find(value_close)
            if end < 0:
                return False
            end = self._pos + end + len(value_close)
            read = self._read_call(self._text[self._call_start : end])
            written = self.calls[-1][1]
            if read is None or not read.startswith(written) or len(read) <= len(written):
                # Not what the parser reads as this call with one more value.
                logger.debug("kvchat: a forced XML call is not followed further: %r", read)
                self._state = "lost"
                return False
            self._give(out, read[len(written) :])
            self._pos = end

    def _read_call(self, call: str) -> str | None:
        """The arguments JSON, less its closing brace, that the format's
        parser reads from ``call`` (one call's markup up to a parameter's
        end) once closed; None when it reads no one call."""
        g = self._grammar
        parser = ToolCallParser(self._format, self._tools)
        parser.feed(g.section_open + call + g.call_close + g.section_close)
        parser.finish()
        if len(parser.calls) != 1 or not parser.calls[0].arguments.endswith("}"):
            return None
        return parser.calls[0].arguments[:-1]

    def _skip(self, literal: str) -> bool:
        """Past ``literal`` once it is all written; "lost" if other text is."""
        written = self._text[self._pos : self._pos + len(literal)]
        if not literal.startswith(written):
            self._state = "lost"
            return False
        if len(written) < len(literal):
            return False
        self._pos += len(literal)
        return True

    def _header_prefix(self, text: str) -> bool:
        """Whether ``text`` may still grow into a call's header."""
        return self._header.fullmatch(text, partial=True) is not None

    def _scan(self) -> bool:
        """Reads the arguments' JSON on from ``_pos``, to the object's end
        (True) or the text's (False)."""
        text, i = self._text, self._pos
        while i < len(text):
            c = text[i]
            i += 1
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i
                    return True
        self._pos = i
        return False


def _header(g: CallGrammar) -> regex.Pattern:
    """A call's markup up to its arguments, as the grammar writes it."""
    if g.name_in_json:
        key = json.dumps(g.arguments_key)
        name = regex.escape(json.dumps(g.name_key))
        middle = r"\{" + name + r': "(?P<name>[^"\\]+)", ' + regex.escape(key) + ": "
        return regex.compile(regex.escape(g.call_open) + middle)
    name = r"(?P<name>[^\s<>\[\]()]+?)"  # tool names: letters, digits, _ - .
    return regex.compile(regex.escape(g.call_open) + name + regex.escape(g.name_close))
