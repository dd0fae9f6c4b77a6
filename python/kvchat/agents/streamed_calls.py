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
out only as far as they are a prefix of some JSON object; and the piece that
would complete them (the object's last brace) is held: ``settle`` gives it
out only for a call the parser reads back at the reply's end, with the id
given out at the start and the arguments as written. So a call cut short
(``max_tokens``, a stop string), or markup that turns out not to parse, has
arguments that are not JSON on the client's side, and its text follows as
content.

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
from .toolcalls import ToolCall, ToolCallParser, tool_names

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
        self._names = tool_names(tools)
        self._max_calls = max_calls
        self._call_start = 0  # where the call being written starts
        self._arguments_start = 0  # where its JSON arguments start
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
        self._depth = 0  # the arguments' JSON nesting, while in them
        self._string = False
        self._escape = False
        # Per call: [id, arguments given out, the whole arguments once written].
        self.calls: list[list] = []

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
                if self._names is not None and found["name"] not in self._names:
                    self._state = "lost"  # not a call of the request's tools
                    break
                self._call_start, self._pos = found.start(), found.end()
                self._arguments_start = found.end()
                call_id = self._format.new_id()
                self.calls.append([call_id, "", None])
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
        """For each parsed call, in order: the piece of arguments not given
        out yet (their last brace) when it was followed, then the call, with
        the id given out and as arguments the text given out when it holds
        the same object (where not: the parsed text, and a warning)."""
        out: list = []
        for i, call in enumerate(calls):
            if i >= len(self.calls):
                out.append(call)
                continue
            call_id, given, whole = self.calls[i]
            arguments = whole if whole is not None else call.arguments
            if not (arguments.startswith(given) and _same_json(arguments, call.arguments)):
                logger.warning(
                    "kvchat: streamed arguments of call %d differ from the parsed ones", i
                )
                arguments = call.arguments
            elif len(arguments) > len(given):
                out.append(CallArguments(i, arguments[len(given) :]))
            out.append(dataclasses.replace(call, id=call_id, arguments=arguments))
        return out

    # -------------------------------------------------------------- internals
    def _give(self, out: list, text: str) -> None:
        if text:
            self.calls[-1][1] += text
            out.append(CallArguments(len(self.calls) - 1, text))

    def _arguments(self, out: list) -> bool:
        """Gives out the JSON arguments written so far, as far as they are a
        prefix of an object: True once the object is written (its last brace
        held for ``settle``), False while it is not (or the text is not an
        object: "lost")."""
        if self._depth == 0 and self._pos < len(self._text) and self._text[self._pos] != "{":
            self._state = "lost"
            return False
        closed = self._scan()
        written = self._text[self._arguments_start : self._pos]
        given = self.calls[-1][1]
        if closed:
            if not _is_object(written):
                logger.debug("kvchat: call arguments that are not JSON: %r", written)
                self._state = "lost"
                return False
            self._give(out, written[len(given) : -1])
            self.calls[-1][2] = written
            return True
        if _json_prefix(written):
            self._give(out, written[len(given) :])
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
                given = self.calls[-1][1]
                self.calls[-1][2] = given + "}" if given else "{}"
                return True
            end = rest.find(value_close)
            if end < 0:
                return False
            end = self._pos + end + len(value_close)
            read = self._read_call(self._text[self._call_start : end])
            written = self.calls[-1][1]
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


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, parse_constant=_not_json), dict)
    except ValueError:
        return False


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


# Endings that complete a JSON prefix where it may stop: nothing, a string's
# close, a value, a key's colon and value, a key. A prefix that none of them
# completes (``tru``, an escape's start) waits for the next piece.
_ENDINGS = ("", '"', "0", ":0", '":0', '"":0')


def _json_prefix(text: str) -> bool:
    """Whether ``text`` (an object's start) is, for sure, the start of a JSON
    object: completed by one of a few endings and the brackets it left open."""
    for ending in _ENDINGS:
        candidate = text + ending
        still_open, in_string = _open_brackets(candidate)
        if not in_string and _is_object(candidate + still_open):
            return True
    return False


def _open_brackets(text: str) -> tuple[str, bool]:
    """The closing brackets ``text`` leaves to write, and whether it ends in a string."""
    stack, in_string, escape = [], False, False
    for c in text:
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    return "".join(reversed(stack)), in_string


def _header(g: CallGrammar) -> regex.Pattern:
    """A call's markup up to its arguments, as the grammar writes it."""
    if g.name_in_json:
        key = json.dumps(g.arguments_key)
        name = regex.escape(json.dumps(g.name_key))
        middle = r"\{" + name + r': "(?P<name>[^"\\]+)", ' + regex.escape(key) + ": "
        return regex.compile(regex.escape(g.call_open) + middle)
    name = r"(?P<name>[^\s<>\[\]()]+?)"  # tool names: letters, digits, _ - .
    return regex.compile(regex.escape(g.call_open) + name + regex.escape(g.name_close))
