"""stream_chat yields the same reply as chat, piece by piece."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import MAX_NEW, SYSTEM, reference_turn, user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt


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


def test_an_exhausted_stream_stays_exhausted(llama, tokenizer):
    # A consumer that asks once more after the end (the server did, after a
    # stop string that never matched) must get StopIteration, not a wait on a
    # queue nothing will ever fill again.
    mgr = SessionManager(llama, tokenizer)
    stream = mgr.stream_chat("s", [SYSTEM, user_message(0)], max_new_tokens=4)
    pieces = list(stream)
    assert pieces and stream.report is not None
    asked = threading.Thread(target=lambda: next(stream, None), daemon=True)
    asked.start()
    asked.join(timeout=30)
    assert not asked.is_alive(), "next() on an exhausted stream blocked"


def _forced(token_ids: list[int]):
    """A logits processor that makes generate write ``token_ids`` in order."""

    def force(input_ids, scores):
        step = input_ids.shape[1] - force.prompt_length
        out = torch.full_like(scores, -float("inf"))
        out[:, token_ids[min(step, len(token_ids) - 1)]] = 0
        return out

    return force


def test_each_token_is_streamed_as_soon_as_its_text_is_final(llama, tokenizer):
    # A reply whose first "word" is many tokens (code, a URL, JSON): the first
    # piece must come after the first token, not once a space appears.
    word = "`code_with_a_very_long_identifier(argument)`"
    ids = tokenizer(word, add_special_tokens=False).input_ids
    assert len(ids) >= 8 and " " not in word
    messages = [SYSTEM, user_message(0)]
    prompt_length = render_prompt(tokenizer, messages).numel()
    force = _forced(ids)
    force.prompt_length = prompt_length
    first_piece = threading.Event()
    steps_before_first_piece = []

    def wait_for_reader(input_ids, scores):
        # Past the first token, hold generation until the reader saw a piece
        # (bounded: a streamer that holds text back would wait here in vain).
        if input_ids.shape[1] - prompt_length == 1:
            steps_before_first_piece.append(first_piece.wait(timeout=20))
        return scores

    mgr = SessionManager(llama, tokenizer)
    stream = mgr.stream_chat(
        "s",
        messages,
        max_new_tokens=len(ids),
        logits_processor=[wait_for_reader, force],
    )
    pieces = []
    for piece in stream:
        pieces.append(piece)
        first_piece.set()
    assert steps_before_first_piece == [True], "the first piece waited for later tokens"
    assert "".join(pieces) == word
    assert len(pieces) >= len(ids) // 2  # token by token, not one lump at the end
    assert mgr.last_turn("s").output_ids == tuple(ids)
