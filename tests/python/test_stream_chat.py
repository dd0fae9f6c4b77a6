"""stream_chat yields the same reply as chat, piece by piece."""

from __future__ import annotations

import pytest
from helpers import MAX_NEW, SYSTEM, reference_turn, user_message
from kvchat import SessionManager


def test_stream_matches_reference_over_turns(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM]
    for turn in range(3):
        messages.append(user_message(turn))
        pieces = list(mgr.stream_chat("s", messages, max_new_tokens=MAX_NEW))
        ref_reply, _, ref_ids = reference_turn(llama, tokenizer, messages)
        assert "".join(pieces) == ref_reply
        assert mgr.last_turn("s").output_ids == ref_ids
        messages.append({"role": "assistant", "content": ref_reply})
    assert mgr.last_turn("s").reused_tokens > 0


def test_stream_errors_raise_in_the_caller(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    with pytest.raises(ValueError, match="messages"):
        mgr.stream_chat("s", [])
    # A failure inside generation surfaces when iterating, not as a hang.
    stream = mgr.stream_chat("s", [SYSTEM, user_message(0)], max_new_tokens=4, num_beams=0)
    with pytest.raises(ValueError):
        list(stream)
