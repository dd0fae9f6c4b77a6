"""Inspection, clearing, removal, eviction and threads through the Python API."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import MAX_NEW, SYSTEM, reference_turn, user_message
from kvchat import LayerKind, ModelLayout, SessionBusy, SessionManager


def test_info_stats_clear_remove(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    mgr.chat("a", messages, max_new_tokens=MAX_NEW)
    info = mgr.info("a")
    assert info.resident and info.cached_tokens > 0 and info.nbytes > 0
    assert info.system_prompt == SYSTEM["content"] and info.messages == 2
    # torch's name, not the core's c10 one ("Double"): getattr(torch, name) is the dtype.
    assert info.dtype == "float64" and getattr(torch, info.dtype) is llama.dtype
    assert info.device == "cpu"
    stats = mgr.stats()
    assert stats.requests == 1 and stats.resident_bytes == info.nbytes
    mgr.clear("a")
    info = mgr.info("a")
    assert not info.resident and info.messages == 0
    assert info.system_prompt == SYSTEM["content"]
    mgr.remove("a")
    assert mgr.sessions() == []
    assert mgr.stats().requests == 1  # totals keep removed sessions


def test_cached_ids_are_the_prompt_and_reply_the_next_turn_can_reuse(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, settle=False)
    messages = [SYSTEM, user_message(0)]
    _, prompt, output = reference_turn(llama, tokenizer, messages)
    mgr.chat("a", messages, max_new_tokens=MAX_NEW)
    held = mgr.cached_ids("a")
    # The prompt, then the reply up to its last token (generated, never fed back).
    assert held == prompt.tolist() + list(output[:-1])
    assert mgr.info("a").cached_tokens == len(held)
    mgr.clear("a")
    assert mgr.cached_ids("a") == []
    with pytest.raises(KeyError, match="ghost"):
        mgr.cached_ids("ghost")
    with pytest.raises(TypeError, match="session_id"):
        mgr.cached_ids(7)


def test_layout_names_every_layer_kvchat_carries(llama, tokenizer):
    layout = SessionManager(llama, tokenizer).layout
    assert isinstance(layout, ModelLayout) and layout.supported and layout.problem is None
    assert layout.num_layers == llama.config.num_hidden_layers
    assert set(layout.parts) == {(LayerKind.attention,)}
    with pytest.raises((AttributeError, TypeError)):  # shared with the manager: read-only
        layout.indexer_of[0] = 1
    with pytest.raises(AttributeError):
        layout.problem = "changed"


def test_lru_order_and_count_eviction(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_sessions=2)
    for sid in ["a", "b", "c"]:
        mgr.chat(sid, [user_message(0)], max_new_tokens=2)
    assert mgr.sessions() == ["a", "b", "c"]
    assert not mgr.info("a").resident
    assert mgr.stats().resident_sessions == 2
    assert mgr.stats().evictions == 1


def test_byte_budget_holds_after_every_call(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    mgr.chat("probe", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
    one = mgr.info("probe").nbytes
    mgr.remove("probe")
    budget = int(one * 2.5)
    # Private copies, so the four sessions cannot all fit (sharing would let them).
    mgr = SessionManager(llama, tokenizer, max_cache_bytes=budget, share_prefixes=False)
    for turn in range(2):
        for sid in "abcd":
            mgr.chat(sid, [SYSTEM, user_message(turn)], max_new_tokens=MAX_NEW)
            assert mgr.stats().resident_bytes <= budget
    assert mgr.stats().evictions > 0


def test_threads_on_distinct_and_shared_sessions(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    expected = {}
    for sid in ["t0", "t1", "t2", "t3"]:
        messages = [SYSTEM, user_message(int(sid[1]))]
        expected[sid] = reference_turn(llama, tokenizer, messages)[2]
    failures = []

    def worker(sid):
        try:
            for _ in range(3):
                mgr.chat(sid, [SYSTEM, user_message(int(sid[1]))], max_new_tokens=MAX_NEW)
                if mgr.last_turn(sid).output_ids != expected[sid]:
                    failures.append(sid)
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(repr(error))

    threads = [threading.Thread(target=worker, args=(s,)) for s in [*expected, "t0", "t1"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread deadlocked"
    assert failures == []
    assert mgr.stats().requests == 18


def test_busy_session_without_waiting(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    lease = mgr._core.acquire("a")
    with pytest.raises(SessionBusy, match="in use"):
        mgr._core.acquire("a", wait=False)
    with pytest.raises(SessionBusy):
        mgr.remove("a")
    lease.release()
    mgr.remove("a")


def test_busy_error_raises_instead_of_waiting_and_wait_runs_after(llama, tokenizer):
    messages = [SYSTEM, user_message(0)]
    _, _, expected = reference_turn(llama, tokenizer, messages)
    impatient = SessionManager(llama, tokenizer, busy="error")
    lease = impatient._core.acquire("a")  # another call is mid-turn on "a"
    with pytest.raises(SessionBusy, match="session_id 'a' is in use"):
        impatient.chat("a", messages, max_new_tokens=MAX_NEW)
    impatient.chat("b", messages, max_new_tokens=MAX_NEW)  # other sessions are unaffected
    lease.release()
    impatient.chat("a", messages, max_new_tokens=MAX_NEW)
    assert impatient.last_turn("a").output_ids == expected

    patient = SessionManager(llama, tokenizer)  # busy="wait", the default
    lease = patient._core.acquire("a")
    releaser = threading.Timer(0.2, lease.release)
    releaser.start()
    patient.chat("a", messages, max_new_tokens=MAX_NEW)  # waits for the release, then runs
    releaser.join()
    assert patient.last_turn("a").output_ids == expected
