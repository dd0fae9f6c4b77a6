"""A call's name and arguments as they are written.

``CallStream`` follows a tool-call section written in the shape its format's
grammar writes (the format's markup, each call's name, and its arguments as
JSON) and reports each call's start and the arguments written since the last
piece. Under a tool-call grammar (``tool_choice`` "required" or a named
function) the reply is that text exactly. Without one ("auto") a model that
writes its calls the way its template shows them writes the same text, and
``Reply`` feeds the stream the section the parser reads, from its marker on;
markup in any other shape is not followed, and its calls go out whole when
the reply ends.

Nothing given out can turn into a wrong call. A call starts only once its
name is written and names one of the request's tools. Its JSON arguments go
out only as far as they surely begin the arguments the parser reads back
(``json_arguments.py``: a prefix of the object's ``json.dumps`` text, up to
a string value, or a list of them, the tool's schema may cast); and the
piece that completes them is held: ``settle`` gives it out only for a call
the parser reads back at the reply's end, with the id given out at the start. So a call cut short
(``max_tokens``, a stop string), or markup that turns out not to parse, has
arguments that are not JSON on the client's side, and its text follows as
content; and a call read back has arguments that are the pieces joined.

In the XML formats the arguments become JSON only when they are read: each
parameter goes out once its closing tag is written, as the JSON the parser
reads it as (the call so far, closed and read by the format's own parser, so
the pieces join into exactly the arguments read at the end), and the closing
brace once the parser has read the call. LFM2's Python calls, whose
arguments have no closing tag of their own, are not followed: they go out
whole when the reply ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

import regex  # partial matching: whether a header is still being written

from .formats import CallGrammar, ToolFormat
from .json_arguments import ArgumentsScan, castable_keys, read_object
from .refs import with_refs_resolved
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


@dataclass
class _Followed:
    """A call being followed: its ``id``, the arguments ``given`` out, and
    once written, the ``whole`` arguments as written (the JSON object's text,
    or in XML the parser's reading)."""

    id: str
    name: str
    given: str = ""
    whole: str | None = None
    scan: ArgumentsScan | None = None  # its JSON arguments, as they are read


def streamable(fmt: ToolFormat | None) -> bool:
    """Whether ``fmt``'s calls can be followed as they are written."""
    g = fmt.grammar if fmt is not None else None
    return g is not None and not g.keyword_arguments


class CallStream:
    """``feed(text)`` returns ``CallStart`` and ``CallArguments`` items for a
    tool-call section written in the shape of ``fmt``'s grammar; ``settle(calls)``
    gives the parsed calls the ids and arguments given out, each after the
    piece that completes its arguments."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None, max_calls=None):
        """``tools``: the request's; a call must name one of them, and XML
        values are read back typed by them. ``max_calls``: how many calls are
        followed (1 without parallel tool calls: a second is not given out)."""
        g: CallGrammar = fmt.grammar
        self._format = fmt
        self._grammar = g
        self._tools = tools
        # None without tools: then any name is followed.
        self._tools_by_name = None
        if tools:
            # Cast as the parser casts: by each parameter's type, read through a $ref.
            self._tools_by_name = {
                t.get("function", t).get("name"): t
                for t in with_refs_resolved(tools)
                if isinstance(t, dict)
            }
        self._max_calls = max_calls
        self._call_start = 0  # where the call being written starts
        self._text = ""
        self._pos = 0  # where reading goes on
        # section, call, arguments, after, between (then call again); lost:
        # the text is not the grammar's, and nothing more is followed.
        self._state = "section"
        self._header = _header(g)
        self._between = g.separator or ""
        self._after = ("}" if g.name_in_json else "") + g.call_close
        # The stream reads the section from its marker on, as the parser does:
        # what the grammar writes before the marker (a newline) is content.
        at = [g.section_open.find(m) for m in fmt.markers if m in g.section_open]
        self._section_open = g.section_open[min(at) :] if at else g.section_open
        self.calls: list[_Followed] = []

    def feed(self, text: str) -> list:
        self._text += text
        out: list = []
        while self._state != "lost":
            if self._state == "section":
                if not self._skip(self._section_open):
                    break
                self._state = "call"
            elif self._state == "between":  # the separator before a next call
                if self._max_calls is not None and len(self.calls) >= self._max_calls:
                    self._state = "lost"
                    break
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
                if self._tools_by_name is not None and found["name"] not in self._tools_by_name:
                    self._state = "lost"  # not a call of the request's tools
                    break
                self._call_start, self._pos = found.start(), found.end()
                call_id = self._format.new_id()
                self.calls.append(_Followed(call_id, found["name"]))
                out.append(CallStart(len(self.calls) - 1, call_id, found["name"]))
                self._state = "arguments" if self._grammar.xml is None else "parameters"
            elif self._state == "parameters":
                if not self._parameters(out):
                    break
                self._state = "between"
            elif self._state == "arguments":
                if not self._arguments(out):
                    break
                self._state = "after"
            else:  # after: the call's closing markup
                if not self._skip(self._after):
                    break
                self._state = "between"
        return out

    def settle(self, calls: list[ToolCall]) -> list:
        """For each parsed call, in order: when it was followed, the piece
        that completes its arguments, then the call with the id given out;
        its arguments are the pieces joined (the parsed text, which the
        pieces begin; else the text as written, where it reads back the
        same)."""
        out: list = []
        for i, call in enumerate(calls):
            if i >= len(self.calls):
                out.append(call)
                continue
            followed = self.calls[i]
            # The parser's text first: what a reply answered whole has.
            texts = [t for t in (call.arguments, followed.whole) if t is not None]
            arguments = next(
                (
                    t
                    for t in texts
                    if t.startswith(followed.given) and _same_object(t, call.arguments)
                ),
                None,
            )
            if arguments is None:  # the rules in json_arguments.py make this a bug
                logger.warning(
                    "kvchat: streamed arguments of call %d are not the start of the parsed "
                    "ones: %r, %r",
                    i,
                    followed.given,
                    call.arguments,
                )
                arguments = call.arguments
            elif len(arguments) > len(followed.given):
                out.append(CallArguments(i, arguments[len(followed.given) :]))
            out.append(dataclasses.replace(call, id=followed.id, arguments=arguments))
        return out

    # -------------------------------------------------------------- internals
    def _give(self, out: list, text: str) -> None:
        if text:
            self.calls[-1].given += text
            out.append(CallArguments(len(self.calls) - 1, text))

    def _arguments(self, out: list) -> bool:
        """Gives out the JSON arguments written so far, as far as they surely
        begin the arguments read back: True once the object is written (the
        rest held for ``settle``), False while it is not (or the text is not
        an object: "lost")."""
        followed = self.calls[-1]
        if followed.scan is None:
            if self._pos >= len(self._text):
                return False
            if self._text[self._pos] != "{":
                self._state = "lost"
                return False
            tool = (self._tools_by_name or {}).get(followed.name)
            followed.scan = ArgumentsScan(castable_keys(tool))
        scan = followed.scan
        fed = len(scan.text)
        scan.feed(self._text[self._pos :])
        if scan.end is not None:
            written = scan.text[: scan.end]
            if read_object(written) is None:
                logger.debug("kvchat: call arguments that are not a JSON object: %r", written)
                self._state = "lost"
                return False
            followed.whole = written
            self._pos += scan.end - fed
            return True
        self._pos = len(self._text)
        sure = scan.sure()
        if len(sure) > len(followed.given):
            self._give(out, sure[len(followed.given) :])
        return False

    def _parameters(self, out: list) -> bool:
        """Gives out each XML parameter written whole, and once the call's
        closing markup is written holds its closing brace for ``settle``:
        True then, False while the call is still being written (or the text
        is not the grammar's: "lost")."""
        g = self._grammar
        value_close = g.xml[2]
        while True:
            rest = self._text[self._pos :]
            if rest.startswith(g.call_close):
                self._pos += len(g.call_close)
                given = self.calls[-1].given
                self.calls[-1].whole = given + "}" if given else "{}"
                return True
            end = rest.find(value_close)
            if end < 0:
                return False
            end = self._pos + end + len(value_close)
            read = self._read_call(self._text[self._call_start : end])
            written = self.calls[-1].given
            if read is None or not read.startswith(written) or len(read) <= len(written):
                # Not what the parser reads as this call with one more value.
                logger.debug("kvchat: an XML call is not followed further: %r", read)
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


def _same_object(a: str, b: str) -> bool:
    first = read_object(a)
    return first is not None and first == read_object(b)


def _header(g: CallGrammar) -> regex.Pattern:
    """A call's markup up to its arguments, as the grammar writes it."""
    if g.name_in_json:
        key = json.dumps(g.arguments_key)
        name = regex.escape(json.dumps(g.name_key))
        middle = r"\{" + name + r': "(?P<name>[^"\\]+)", ' + regex.escape(key) + ": "
        return regex.compile(regex.escape(g.call_open) + middle)
    name = r"(?P<name>[^\s<>\[\]()]+?)"  # tool names: letters, digits, _ - .
    return regex.compile(regex.escape(g.call_open) + name + regex.escape(g.name_close))
