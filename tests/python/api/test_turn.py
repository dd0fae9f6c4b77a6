"""The turn pipeline: begin_turn, the model, Turn.finish. A turn that fails in
the model's part leaves the session with its history and no cache, never half
a turn, and the next turn is exact again."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from helpers import LONG_SYSTEM, MAX_NEW, REUSE_FAMILIES, model_for, reference_turn, user_message
from kvchat import _C, SessionManager
from transformers import StoppingCriteria


class Explode(StoppingCriteria):
    """Raises after `after` decoding steps: the cache is half-written by then."""

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("generate failed mid-turn")
        return False


def _two_turns(mgr, model, tokenizer):
    messages = [LONG_SYSTEM]
    for turn in range(2):
        messages.append(user_message(turn))
        reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
        messages.append({"role": "assistant", "content": reply})
    return messages


@pytest.mark.parametrize("family", REUSE_FAMILIES)
@pytest.mark.parametrize("where", ["before decoding", "mid-decoding"])
def test_a_turn_that_raises_in_generate_leaves_history_and_no_cache(family, where, tokenizer):
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    messages = _two_turns(mgr, model, tokenizer)
    history = mgr.messages("s")
    before = mgr.stats()
    failing = [*messages, user_message(2)]
    if where == "before decoding":
        original = model.generate

        def boom(*args, **kwargs):
            raise RuntimeError("generate failed before it began")

        model.generate = boom
        try:
            with pytest.raises(RuntimeError, match="before it began"):
                mgr.chat("s", failing, max_new_tokens=MAX_NEW)
        finally:
            model.generate = original
    else:
        with pytest.raises(RuntimeError, match="mid-turn"):
            mgr.chat("s", failing, max_new_tokens=MAX_NEW, stopping_criteria=[Explode(2)])

    # History as before the turn; no cache at all (checkpoints included), so
    # nothing half-written can be reused; the failed turn is not counted.
    assert mgr.messages("s") == history
    info = mgr.info("s")
    assert info.cached_tokens == 0 and info.checkpoints == 0
    after = mgr.stats()
    assert after.resident_bytes == 0
    assert after.requests == before.requests

    # The next turn prefills everything once and is exact again.
    want, _, _ = reference_turn(model, tokenizer, failing)
    assert mgr.chat("s", failing, max_new_tokens=MAX_NEW) == want
    assert mgr.last_turn("s").reason == "no_cache"
    failing += [{"role": "assistant", "content": want}, user_message(3)]
    want, _, _ = reference_turn(model, tokenizer, failing)
    assert mgr.chat("s", failing, max_new_tokens=MAX_NEW) == want
    assert mgr.last_turn("s").reused_tokens > 0


def _core_after_a_turn():
    """A core session "a" holding 12 tokens after one turn (no model)."""
    core = _C.SessionManager(
        _C.ManagerLimits(num_layers=1), _C.TurnSettings(markers=_C.TurnMarkers([2], []))
    )
    prompt = torch.arange(100, 110)
    with (lease := core.acquire("a")), core.begin_turn(lease, prompt, 4) as turn:
        turn.finish(_finished(prompt))
    return core, torch.cat([prompt, torch.tensor([500, 501, 7])])


def _finished(prompt, generated=3):
    sequence = torch.cat([prompt, torch.arange(500, 500 + generated)])
    cached = sequence.numel() - 1
    kv = torch.zeros(1, 1, cached, 2)
    return _C.TurnResult(
        sequence=sequence, layers=[_C.AttentionState(kv, kv)], cached_tokens=cached
    )


def test_the_core_turn_aborts_when_its_block_is_left_unfinished():
    core, prompt = _core_after_a_turn()
    with (lease := core.acquire("a")) as session:
        with pytest.raises(RuntimeError, match="the model failed"):
            with core.begin_turn(lease, prompt, 4) as turn:
                taken = session.version
                assert turn.open and turn.plan.kept_tokens == 12
                assert len(turn.plan.take_layers()) == 1
                raise RuntimeError("the model failed")
        assert not turn.open and session.version != taken
        assert not session.resident and session.counters().requests == 1
        with pytest.raises(RuntimeError, match="already aborted"):
            turn.finish(_finished(prompt))
        with core.begin_turn(lease, prompt, 4) as turn:
            record = turn.finish(_finished(prompt))
        assert record.cache_stored and len(session.cached_ids()) == prompt.numel() + 2
        with pytest.raises(RuntimeError, match="already finished"):
            turn.finish(_finished(prompt))
        turn.abort()  # nothing once finished
        assert session.resident and session.counters().requests == 2


def test_a_turn_begins_only_on_a_held_lease():
    core, prompt = _core_after_a_turn()
    lease = core.acquire("a")
    with pytest.raises(TypeError):
        core.begin_turn(lease.session, prompt, 4)  # a session is no lease
    lease.release()
    with pytest.raises(RuntimeError, match="released"):
        core.begin_turn(lease, prompt, 4)
    assert core.find("a").resident


@pytest.mark.parametrize("how", ["dropped", "collected"])
def test_an_unfinished_turn_that_dies_aborts_without_deadlock(how):
    """A Turn garbage-collected unfinished aborts with the GIL released, so a
    thread waiting for the session's lease (without the GIL) and one holding
    it (with the GIL) cannot deadlock; the session is left as an abort leaves it."""
    core, prompt = _core_after_a_turn()
    lease = core.acquire("a")
    turn = core.begin_turn(lease, prompt, 4)
    taken = lease.session.version  # the session holds no layers now, as the turn left it
    got = threading.Event()

    def waiter():
        with core.acquire("a") as session:  # blocks until the lease below goes
            got.set()
            assert not session.resident

    thread = threading.Thread(target=waiter)
    thread.start()
    if how == "dropped":
        del turn
    else:  # in a reference cycle only the collector frees
        cycle = [turn]
        cycle.append(cycle)
        del turn, cycle
        gc.collect()
    assert core.find("a").version != taken  # aborted: what the turn left is dropped
    lease.release()
    thread.join(timeout=30)
    assert got.is_set() and not thread.is_alive()
    assert core.find("a").counters().requests == 1
