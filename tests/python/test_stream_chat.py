"""stream_chat yields the same reply as chat, piece by piece."""

from __future__ import annotations

import time

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
    # Bad generate arguments raise at the call, like bad messages.
    with pytest.raises(ValueError, match="temprature"):
        mgr.stream_chat("s", [SYSTEM, user_message(0)], max_new_tokens=4, temprature=0.5)

    # A failure inside generation surfaces when iterating, not as a hang.
    def fail(input_ids, scores):
        raise RuntimeError("failed inside generate")

    stream = mgr.stream_chat(
        "s", [SYSTEM, user_message(0)], max_new_tokens=4, logits_processor=[fail]
    )
    with pytest.raises(RuntimeError, match="failed inside generate"):
        list(stream)


# Long enough that running to the end would be unmistakable; min_new_tokens
# keeps a random model from stopping early at an end-of-turn token.
LONG = dict(max_new_tokens=2000, min_new_tokens=2000)


def continue_exactly(mgr, llama, tokenizer, messages):
    """The session's next turn (busy='error': it must be free) equals plain generate."""
    messages = messages + [{"role": "assistant", "content": "Fine."}, user_message(1)]
    _, _, expected = reference_turn(llama, tokenizer, messages)
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").output_ids == expected
    assert mgr.last_turn("s").reused_tokens > 0


def test_closing_a_stream_stops_generation(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, busy="error")
    messages = [SYSTEM, user_message(0)]
    stream = mgr.stream_chat("s", messages, **LONG)
    first = next(stream)
    stream.close()
    aborted = mgr.last_turn("s")
    assert aborted is not None and aborted.generated_tokens < 20
    assert first and aborted.reason == "no_cache"
    continue_exactly(mgr, llama, tokenizer, messages)


def test_leaving_a_for_loop_stops_generation(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    for _ in mgr.stream_chat("s", messages, **LONG):
        break
    # The stream was dropped, not closed: the worker stops on its own within a
    # token or two and commits; wait for that (bounded) without racing it.
    for _ in range(600):
        if mgr.last_turn("s") is not None:
            break
        time.sleep(0.05)
    assert mgr.last_turn("s").generated_tokens < 50
    continue_exactly(mgr, llama, tokenizer, messages)
