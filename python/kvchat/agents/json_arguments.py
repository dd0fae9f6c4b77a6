"""How much of a call's JSON arguments, as written so far, is sure to begin
the arguments the parser reads back: what ``CallStream`` may give out.

Pieces given to a client are only ever appended to, so each must begin the
call's final ``arguments``, whatever the model writes next. The parser reads
the arguments as JSON, casts each top-level string value with the tool's
schema (transformers' ``ResponseParser``: ``"3"`` becomes 3 for an integer
parameter, ``"null"`` None for an optional one, and so do the strings in a
list given for a parameter that is not an array), and writes them back with
``json.dumps``. So a prefix is given out only when
- some JSON object begins with it, and that object's ``json.dumps`` text
  begins with it too (spacing of the model's own, ``1e5`` or a ``\\u`` escape
  wait for the reply's end, where the text written is the arguments when it
  reads back the same); and
- it stops before any top-level string value (or list) the schema may
  cast, since its value is known only once read back.

Where a value already out reads back otherwise (a key written twice, a
number such as ``1.5e1`` whose first digits are out), the call's arguments
are the text as written, which reads as the same object.
"""

from __future__ import annotations

import json
import re

try:  # the parser's own reading of a parameter's schema types
    from transformers.utils.chat_parsing.response_parser import _schema_types
except ImportError:  # pragma: no cover - another transformers: every string may be cast
    _schema_types = None


def castable_keys(tool: dict | None):
    """``castable(key, kind)`` for ``tool``'s parameters: whether the parser
    (its ``_coerce_tool_calls``) may cast a value written for ``key``. For
    ``kind`` "string", when a type other than string is declared; for "list"
    (the strings in a list), when such a type is and "array" is not. Without
    a schema reader, any string and list may be cast."""
    function = tool.get("function", tool) if isinstance(tool, dict) else {}
    parameters = function.get("parameters") if isinstance(function, dict) else None
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    properties = properties if isinstance(properties, dict) else {}

    def castable(key: str | None, kind: str) -> bool:
        if _schema_types is None or key is None:
            return True
        types = _schema_types(properties.get(key)) if key in properties else ()
        cast = any(t != "string" for t in types)
        return cast and (kind == "string" or "array" not in types)

    return castable


class ArgumentsScan:
    """Reads a call's JSON arguments as they are written (``feed``), from
    their first brace: ``end`` is where the object ends (just past its last
    brace; None while it is open), and ``sure()`` how much of it surely
    begins the arguments read back. ``feed`` reads each character once.
    ``sure()`` reads the text back as JSON, except where what is new since
    the text last proved sure only lengthens a string value with characters
    ``json.dumps`` writes as themselves (a long string, the common case):
    that text is sure too, unread."""

    def __init__(self, castable=lambda key, kind: True):
        self.text = ""
        self.end: int | None = None
        self.cast_from: int | None = None  # a top-level string value the schema may cast
        self._castable = castable
        self._stack: list[str] = []  # the closing brackets owed
        self._keys_next: list[bool] = []  # per open bracket: its next string is a key
        self._in_string = self._escape = False
        self._value_string = False  # the string being read is a value, not a key
        self._sure_at: int | None = None  # sure() was all of the text up to here
        self._expect_key = False  # in the top object: the next string is a key
        self._key = None  # the top object's key being given a value
        self._string_start = 0
        self._before_cast: str | None = None  # sure() once cast_from is set

    def feed(self, text: str) -> None:
        start, self.text = len(self.text), self.text + text
        if self.end is not None:
            return
        for i in range(start, len(self.text)):
            c = self.text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if len(self._stack) == 1 and self._expect_key:
                        self._key = _string(self.text[self._string_start : i + 1])
            elif c == '"':
                self._in_string, self._string_start = True, i
                self._value_string = not (self._keys_next and self._keys_next[-1])
                top_value = len(self._stack) == 1 and not self._expect_key
                if top_value and self.cast_from is None and self._castable(self._key, "string"):
                    self.cast_from = i
            elif c in "{[":
                top_list = c == "[" and len(self._stack) == 1 and not self._expect_key
                if top_list and self.cast_from is None and self._castable(self._key, "list"):
                    self.cast_from = i
                self._stack.append("}" if c == "{" else "]")
                self._keys_next.append(c == "{")
                self._expect_key = len(self._stack) == 1 or self._expect_key
            elif c in "}]":
                if self._stack:
                    self._stack.pop()
                    self._keys_next.pop()
                if not self._stack:
                    self.end = i + 1
                    return
            elif c in ":," and self._stack and self._stack[-1] == "}":
                self._keys_next[-1] = c == ","
                if len(self._stack) == 1:
                    self._expect_key = c == ","

    def sure(self) -> str:
        """The longest start of the text that surely begins the arguments
        read back: all of it, or up to a string value the schema may cast
        (then fixed), or "" where a piece such as ``tru`` waits for the next
        (the caller keeps what it gave)."""
        if self.cast_from is None:
            if self._lengthens_a_sure_string():
                self._sure_at = len(self.text)
                return self.text
            if not _completes(self.text, self._stack, self._in_string, self._escape):
                return ""
            self._sure_at = len(self.text) if self._in_string and not self._escape else None
            return self.text
        if self._before_cast is None:  # it stops between the top object's members
            before = self.text[: self.cast_from]
            self._before_cast = before if _completes(before, ["}"], False, False) else ""
        return self._before_cast

    def _lengthens_a_sure_string(self) -> bool:
        """Whether the text was sure inside a string value still open, and
        what came since only lengthens it with characters that ``json.dumps``
        writes as themselves. Then the text is sure: completed by the same
        closing quote and brackets, it reads as the same object with that
        string longer, whose ``json.dumps`` text is longer by those same
        characters. Never a key, which may come to repeat an earlier one."""
        at = self._sure_at
        if at is None or not (self._in_string and self._value_string) or self._escape:
            return False
        return self._string_start < at and _PLAIN.match(self.text, at) is not None


# Characters json.dumps(ensure_ascii=False) writes as themselves in a string
# (no quote, backslash, control character or lone surrogate), to the end.
_PLAIN = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]*\Z')

# Endings that complete a prefix where it may stop: nothing, a string's close,
# a value, a key's colon and value, a key. A prefix none of them completes
# (``tru``, an escape's start) waits for the next piece.
_ENDINGS = ("", '"', "0", ":0", '":0', '"":0')


def _completes(text: str, stack: list[str], in_string: bool, escape: bool) -> bool:
    """Whether ``text``, left with ``stack`` open and in a string or not,
    completed by one of the endings reads as an object whose ``json.dumps``
    text begins with it."""
    if escape:  # what the escape becomes is unknown: "\u00e9" is written "é"
        return False
    for ending in _ENDINGS:
        quoted, escaped = in_string, escape
        for c in ending:  # no brackets in the endings: only strings change
            if escaped:
                escaped = False
            elif quoted and c == "\\":
                escaped = True
            elif c == '"':
                quoted = not quoted
        if quoted:
            continue
        value = read_object(text + ending + "".join(reversed(stack)))
        try:
            if value is not None and dumps(value).startswith(text):
                return True
        except (ValueError, RecursionError):  # 1e400 reads as inf, which is not JSON
            continue
    return False


def read_object(text: str) -> dict | None:
    """``text`` as a JSON object (strict: no NaN or Infinity), or None."""
    try:
        value = json.loads(text, parse_constant=not_json)
    except (ValueError, RecursionError):  # RecursionError: nesting past Python's limit
        return None
    return value if isinstance(value, dict) else None


def dumps(value) -> str:
    """Arguments as the parser writes them back."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _string(text: str) -> str | None:
    try:
        return json.loads(text)
    except ValueError:
        return None
