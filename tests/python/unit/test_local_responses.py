"""kvchat serve's stored responses in this process's memory (no server started)."""

from __future__ import annotations

import time

from kvchat.serve.local_responses import LocalResponses
from kvchat.serve.store import ResponseLimits


def test_an_expired_response_is_not_deleted_twice():
    """DELETE of a response past its life is a 404 (False), as GET is: it
    answered 200 "deleted" for a response no GET could read."""
    responses = LocalResponses(ResponseLimits(per_key=5, bytes_per_key=10_000, ttl=0.05))
    responses.put("key-a", "r1", b"{}")
    time.sleep(0.1)
    responses.put("key-b", "r2", b"{}")  # another key's put does not expire key-a's
    assert not responses.delete("key-a", "r1")
    assert responses.get("key-a", "r1") is None
    assert responses.totals() == (1, 2)


def test_the_start_up_log_says_the_byte_bound_as_the_flag_does():
    from kvchat.units import format_bytes, parse_bytes

    for text in ("64MiB", "12KiB", "1GiB", "1000 bytes"):
        assert format_bytes(parse_bytes(text.replace(" bytes", ""))) == text
