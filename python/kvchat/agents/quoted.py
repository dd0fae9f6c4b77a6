"""Markup inside a call's strings, kept from closing the call.

transformers' ``ResponseParser`` closes a call's region at the first text
that matches its closing marker, wherever it stands; so a JSON string that
holds ``</tool_call>`` (an enum value, a key, a model's free text) would end
the call inside the string, and the call would come back as text.
``QuotedMarkup`` rewrites a tool-call section as it streams so that inside a
string of a JSON (or Python) value no character that starts a marker is
left: it is written as the ``\\uXXXX`` escape that both JSON and the Python
call parser read back as that character, so the arguments read are the same.
"""

from __future__ import annotations

# The first characters of every closing marker the formats watch for:
# "</tool_call>", "<|tool_call_end|>", "[TOOL_CALLS]" (Mistral), "```" (R1).
_ESCAPES = {"<": "\\u003c", "[": "\\u005b", "`": "\\u0060"}


class QuotedMarkup:
    """``feed(text)`` returns ``text`` with the characters in ``_ESCAPES``
    escaped inside quoted strings that stand inside a value (a bracket is
    open), so prose around the calls is untouched. ``quotes``: the string
    delimiters (JSON's ``"``; also ``'`` in Python calls); ``brackets``: the
    openers that start a value (``(`` too in Python calls)."""

    def __init__(self, quotes: str = '"', brackets: str = "{["):
        self._quotes = quotes
        self._open = brackets
        self._close = "".join({"{": "}", "[": "]", "(": ")"}[b] for b in brackets)
        self._depth = 0
        self._quote: str | None = None  # the open string's delimiter
        self._escaped = False  # the last character was a backslash in a string
        self.rewritten = False  # whether any character was escaped

    def feed(self, text: str) -> str:
        out = []
        for c in text:
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote:
                    self._quote = None
                elif c in _ESCAPES:
                    out.append(_ESCAPES[c])
                    self.rewritten = True
                    continue
            elif c in self._open:
                self._depth += 1
            elif c in self._close:
                self._depth = max(self._depth - 1, 0)
            elif c in self._quotes and self._depth:
                self._quote = c
            out.append(c)
        return "".join(out)


def escaped(text: str) -> bool:
    """Whether ``text`` holds an escape ``QuotedMarkup`` may have written."""
    return any(escape in text for escape in _ESCAPES.values())
