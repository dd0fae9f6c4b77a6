"""The engine's decode batch counts in max_cache_bytes: its buffers copy every
decoding conversation's cache, so while two conversations decode together
the least recently used idle session is evicted to make room for them (and
spilled, when the manager has a spill_dir), though all four sessions' own
caches fit the budget."""

from __future__ import annotations

import threading
import time

from helpers import LONGER_SYSTEM, MAX_NEW, SYSTEM, model_for, user_message
from kvchat import SessionManager

IDLE = {"A": [LONGER_SYSTEM, user_message(0)], "B": [SYSTEM, user_message(1)]}
BATCHED = {"C": [SYSTEM, user_message(2)], "D": [SYSTEM, user_message(3)]}


def wait_for(condition, what: str) -> None:
    """Polls ``condition``; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + 300
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.002)


class Pause:
    """A streamer that stops the engine's thread at the ``at``-th token it
    streams until ``go`` is set: the batch then holds every row, still."""

    def __init__(self, at: int):
        self.left = at + 1  # the first put is the prompt
        self.reached, self.go = threading.Event(), threading.Event()

    def put(self, value):
        self.left -= 1
        if self.left == 0:
            self.reached.set()
            assert self.go.wait(300), "never released"  # a hang guard

    def end(self):
        pass


def run_turns(manager: SessionManager, inspect) -> None:
    """A and B's turns one after the other (A is then the least recently
    used), then C and D's decoding together; ``inspect()`` runs while C and
    D are both in the batch, the engine paused."""
    for session, messages in IDLE.items():
        manager.chat(session, messages, max_new_tokens=MAX_NEW)
    pause, errors = Pause(at=3), []

    def turn(session, **kwargs):
        try:
            manager.chat(session, BATCHED[session], max_new_tokens=MAX_NEW, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [
        threading.Thread(target=turn, args=("C",), kwargs={"streamer": pause}),
        threading.Thread(target=turn, args=("D",)),
    ]
    with manager._engine.hold():  # both start together: C's row, then D's
        for i, thread in enumerate(threads):
            thread.start()
            wait_for(lambda i=i: manager.stats().queued + len(errors) > i, f"turn {i} queued")
    wait_for(lambda: pause.reached.is_set() or errors, "C's third token")
    try:
        if not errors:
            inspect()
    finally:
        pause.go.set()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def test_the_decode_batch_evicts_the_idle_lru_session(tokenizer, tmp_path):
    model = model_for("llama")
    options = {"share_prefixes": False, "settle": False}  # each session's bytes its own
    probe = SessionManager(model, tokenizer, **options)
    seen = {}
    run_turns(probe, lambda: seen.update(batch=probe.stats().batch_bytes))
    size = {session: probe.info(session).nbytes for session in [*IDLE, *BATCHED]}
    batch = seen["batch"]
    assert probe.stats().evictions == 0
    # The case: the four sessions' caches fit, but A and B's do not beside
    # the batch; without A, B and every session the batch leaves fit beside it.
    assert size["C"] + size["D"] < batch and size["C"] + size["D"] < size["A"], (size, batch)
    budget = size["A"] + size["B"] + batch - 1
    probe.close()

    manager = SessionManager(
        model, tokenizer, max_cache_bytes=budget, spill_dir=tmp_path, **options
    )
    during = {}

    def inspect():
        stats = manager.stats()
        during.update(
            rows=stats.batch_rows,
            batch=stats.batch_bytes,
            resident_bytes=stats.resident_bytes,
            evictions=stats.evictions,
            resident=sorted(s for s in manager.sessions() if manager.info(s).resident),
        )

    run_turns(manager, inspect)
    assert during == {
        "rows": 2,
        "batch": batch,
        "resident_bytes": size["B"],  # A went for the batch; C and D hold nothing yet
        "evictions": 1,
        "resident": ["B"],
    }
    assert during["resident_bytes"] + during["batch"] <= budget
    stats = manager.stats()
    assert (stats.evictions, stats.batch_bytes) == (1, 0)
    assert sorted(s for s in manager.sessions() if manager.info(s).resident) == ["B", "C", "D"]
    assert stats.resident_bytes == size["B"] + size["C"] + size["D"] <= budget
    # Evicted on the engine's thread, A's cache still went to the spill dir,
    # and its next turn reads it back.
    assert stats.spill_writes == 1
    manager.chat("A", [*manager.messages("A"), user_message(4)], max_new_tokens=MAX_NEW)
    assert manager.stats().spill_loads == 1
    assert manager.last_turn("A").reused_tokens > 0
    manager.close()


def test_the_batch_reports_its_bytes_when_its_buffers_change_not_every_step(tokenizer):
    manager = SessionManager(model_for("llama"), tokenizer, settle=False)
    batch = manager._engine._loop.batch
    core_setter, reports = batch.on_bytes, []

    def record(nbytes: int) -> None:
        reports.append(nbytes)
        core_setter(nbytes)

    batch.on_bytes = record
    seen = {}

    def inspect():
        seen.update(batch=manager.stats().batch_bytes, core=manager._core.reserved_bytes)

    run_turns(manager, inspect)
    steps = manager.stats().decode_steps
    # A and B alone: allocated, freed. C and D: C's row allocated, D's
    # joining rebuilt it for two rows, freed when both left.
    assert reports[:4] == [reports[0], 0, reports[2], 0]
    assert reports[4:] == [reports[4], seen["batch"], 0]
    assert reports[4] < seen["batch"] == seen["core"]
    assert len(reports) == 7 < steps
    assert manager._core.reserved_bytes == 0
    manager.close()
