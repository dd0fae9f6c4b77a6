"""``ArgumentsScan.sure()``: how much of a call's JSON arguments, as written
so far, surely begins the arguments read back. Fed in pieces it must say
what a scan of the same text read whole says, at every prefix; and a long
string value must not be read back as JSON on every piece."""

from __future__ import annotations

import json

import pytest
from kvchat.agents import json_arguments
from kvchat.agents.json_arguments import ArgumentsScan

LONG = "def f(x):  return x * 2  # é 日本 " * 40
TEXTS = [
    '{"code": "' + LONG + '", "days": 3}',
    '{"city": "Paris", "days": 3, "note": "a coat, \\"warm\\"\\n then ' + LONG + '"}',
    # Keys that grow into an earlier key: never given out as sure by length alone.
    '{"a": 1, "ab": {"b": 2, "bb": "x", "b": "y"}, "a": "z"}',
    '{"list": ["ab", "cd' + LONG + '", "\\u00e9t\\u00e9"], "x": [{"k": "v", "k2": "v2"}]}',
    '{"s": "tab\there", "t": "\\ud800", "u": "fine"}',  # a raw control character; a lone surrogate
    '{"n": "1.5e1", "m": 1.5e1, "o": "trailing \\\\"}',
]


def _uncast(key, kind) -> bool:  # every parameter a string: no value is cast
    return False


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("step", [1, 2, 3, 7])
@pytest.mark.parametrize("castable", [_uncast, None], ids=["strings", "all-cast"])
def test_sure_fed_in_pieces_is_sure_read_whole_at_every_prefix(text, step, castable):
    def scan():
        return ArgumentsScan() if castable is None else ArgumentsScan(castable)

    fed = scan()
    for end in range(step, len(text) + step, step):
        fed.feed(text[end - step : end])
        whole = scan()
        whole.feed(text[:end])
        assert fed.sure() == whole.sure(), text[:end]


@pytest.mark.parametrize(
    "text",
    ['{"\\u00e9": 1}', '{"a\\/b": 1}', '{"k\\"": "v\\u00e9"}', '{"\\n": "\\t", "x": "\\/"}'],
)
def test_what_is_sure_begins_the_arguments_read_back_through_escapes(text):
    """An escape's start waits for what it becomes: a key ending in a
    backslash was sure (completed as an escaped quote), yet the escape
    u00e9 is written back as the letter itself."""
    final = json.dumps(json.loads(text), ensure_ascii=False)
    scan = ArgumentsScan(_uncast)
    for c in text:
        scan.feed(c)
        assert final.startswith(scan.sure()), (scan.text, scan.sure())


def test_a_long_string_value_is_not_read_back_on_every_piece(monkeypatch):
    """Only its start is read back as JSON: what follows only lengthens a
    string that was sure, with characters json.dumps writes as themselves."""
    reads = []
    completes = json_arguments._completes
    monkeypatch.setattr(
        json_arguments, "_completes", lambda *a: reads.append(a[0]) or completes(*a)
    )
    text = '{"code": "' + LONG * 8
    scan = ArgumentsScan(_uncast)
    for end in range(3, len(text) + 3, 3):
        scan.feed(text[end - 3 : end])
        scan.sure()
    assert scan.sure() == text
    assert len(reads) <= 5, len(reads)
    # A quote, a backslash or a control character is read again.
    for more in ('\\"', '"', "\n"):
        before = len(reads)
        scan.feed(more)
        scan.sure()
        assert len(reads) == before + 1
