"""The byte budget counts what sessions need, and everything it counts can be
evicted: failed turns and generous max_new_tokens leave nothing pinned."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_SYSTEM, MAX_NEW, SYSTEM, model_for, reference_turn, user_message
from kvchat import SessionManager
from transformers import StoppingCriteria


class StopAfter(StoppingCriteria):
    """Ends generation after ``n`` new tokens, whatever max_new_tokens says."""

    def __init__(self, n: int):
        self.n = n
        self.end = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.end is None:  # first called once the first new token is in
            self.end = input_ids.shape[1] - 1 + self.n
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.end)


class Cancelled(Exception):
    pass


class CancellingStreamer:
    """Raises after a few tokens, as a server's streamer does when its client leaves."""

    def __init__(self, after: int = 3):
        self.left = after + 1  # the first put is the prompt

    def put(self, value):
        self.left -= 1
        if self.left < 0:
            raise Cancelled

    def end(self):
        pass


def test_cancelled_turns_pin_nothing(tokenizer):
    model = model_for("lfm2")  # conv layers: sessions hold checkpoints too
    probe = SessionManager(model, tokenizer, share_prefixes=False)
    conversation = [LONG_SYSTEM, user_message(0)]
    probe.chat("p", conversation, max_new_tokens=MAX_NEW)
    budget = 3 * probe.info("p").nbytes
    mgr = SessionManager(model, tokenizer, max_cache_bytes=budget, share_prefixes=False)

    for i in range(8):
        sid = f"cancelled-{i}"
        messages = [LONG_SYSTEM, user_message(i)]
        messages.append({"role": "assistant", "content": mgr.chat(sid, messages, max_new_tokens=4)})
        history = mgr.messages(sid)
        with pytest.raises(Cancelled):
            mgr.chat(sid, messages + [user_message(i + 1)], streamer=CancellingStreamer())
        # The failed turn kept the history and dropped the whole cache, checkpoints too.
        info = mgr.info(sid)
        assert mgr.messages(sid) == history
        assert (info.cached_tokens, info.nbytes, info.resident) == (0, 0, False)
        stats = mgr.stats()
        held = sum(mgr.info(s).nbytes for s in mgr.sessions())
        assert stats.resident_bytes == held <= budget

    # A healthy session is not evicted right after its own turns.
    messages = [LONG_SYSTEM, user_message(0)]
    for turn in range(3):
        reply = mgr.chat("healthy", messages, max_new_tokens=MAX_NEW)
        _, _, expected = reference_turn(model, tokenizer, messages)
        assert mgr.last_turn("healthy").output_ids == expected
        if turn:
            assert mgr.last_turn("healthy").reused_tokens > 0
        messages += [{"role": "assistant", "content": reply}, user_message(turn + 1)]
    assert mgr.stats().resident_bytes <= budget


def test_room_reserved_for_max_new_tokens_is_given_back(llama, tokenizer):
    messages = [SYSTEM, user_message(0)]
    # The turn's own commit, before any settling changes the cache.
    short = SessionManager(llama, tokenizer, settle=False)
    short.chat("s", messages, max_new_tokens=5)
    generous = SessionManager(llama, tokenizer, settle=False)
    generous.chat("s", messages, max_new_tokens=4096, stopping_criteria=[StopAfter(5)])
    assert generous.last_turn("s").output_ids == short.last_turn("s").output_ids
    assert generous.info("s").cached_tokens == short.info("s").cached_tokens
    # At most the buffer's growth headroom (a quarter, at least 16 tokens) on top.
    assert generous.info("s").nbytes <= 1.5 * short.info("s").nbytes
    assert generous.stats().resident_bytes == generous.info("s").nbytes


def test_a_huge_max_new_tokens_reserves_nothing_up_front(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_context_length=10**12)
    messages = [SYSTEM, user_message(0)]
    reference = SessionManager(llama, tokenizer)
    reference.chat("s", messages, max_new_tokens=5)
    mgr.chat("s", messages, max_new_tokens=10**9, stopping_criteria=[StopAfter(5)])
    assert mgr.last_turn("s").output_ids == reference.last_turn("s").output_ids
    # The next turn reuses it as usual.
    messages += [{"role": "assistant", "content": "Fine."}, user_message(1)]
    mgr.chat("s", messages, max_new_tokens=10**9, stopping_criteria=[StopAfter(3)])
    assert mgr.last_turn("s").reused_tokens > 0
