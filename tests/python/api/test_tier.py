"""A storage tier is one class: an in-memory one, written here in a few lines,
brings evicted sessions back on their next turn with identical output."""

from __future__ import annotations

import threading

import pytest
from helpers import LONG_SYSTEM, MAX_NEW, SYSTEM, exact_turns, reference_turn, user_message
from kvchat import _C, SessionManager, SharedTier, Tier


class MemoryTier(Tier):
    """Keeps evicted caches in a dict (a test tier: it holds the tensors it is given)."""

    keeps_evicted = True

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self.caches = {}

    def put(self, session_id, state):
        with self._lock:
            self.caches[session_id] = state
            self.writes += 1

    def find_if_cheaper(self, session_id, prompt):
        with self._lock:
            state = self.caches.get(session_id)
            self.loads += state is not None
            return state

    def forget(self, session_id):
        with self._lock:
            self.caches.pop(session_id, None)


@pytest.mark.parametrize("family_name", ["llama", "lfm2"])
def test_sessions_evicted_to_a_tier_come_back_exactly(family_name, tokenizer):
    from helpers import model_for

    model = model_for(family_name)
    tier = MemoryTier()
    mgr = SessionManager(model, tokenizer, max_sessions=1, share_prefixes=False, tier=tier)
    conversations = {sid: [LONG_SYSTEM] for sid in ("a", "b", "c")}
    reasons = []
    for turn in range(3):  # round robin: max_sessions=1 evicts the others to the tier
        for sid, messages in conversations.items():
            conversations[sid], (report,) = exact_turns(
                mgr, sid, messages, model, tokenizer, 1, turn
            )
            reasons.append(report.reason)
    stats = mgr.stats()
    assert stats.evictions > 0 and stats.tier_writes > 0 and stats.tier_loads > 0
    # The disk tier's counters count the disk tier only.
    assert stats.spill_writes == stats.spill_loads == 0
    assert "spill_reload" in reasons
    mgr.remove("a")
    assert "a" not in tier.caches


def test_tier_argument_errors(llama, tokenizer, tmp_path):
    with pytest.raises(TypeError, match="tier"):
        SessionManager(llama, tokenizer, tier=object())
    with pytest.raises(ValueError, match="spill_dir or tier"):
        SessionManager(llama, tokenizer, tier=MemoryTier(), spill_dir=tmp_path)


def test_a_tier_that_skips_super_init_or_keeps_a_cost_of_its_own_still_works(llama, tokenizer):
    # The base class's own state (its reload-cost rates) must not depend on
    # the subclass calling super().__init__(), nor take a name a subclass uses.
    class Minimal(Tier):
        keeps_evicted = True

        def __init__(self):
            self.caches, self.cost = {}, 0.02  # no super().__init__(); a "cost" of its own

        def put(self, session_id, state):
            self.caches[session_id] = state

        def find_if_cheaper(self, session_id, prompt):
            return self.caches.get(session_id)

        def forget(self, session_id):
            self.caches.pop(session_id, None)

    mgr = SessionManager(llama, tokenizer, max_sessions=1, share_prefixes=False, tier=Minimal())
    histories = {sid: [LONG_SYSTEM, user_message(0)] for sid in ("a", "b")}
    for sid, messages in histories.items():
        messages.append({"role": "assistant", "content": mgr.chat(sid, messages, max_new_tokens=4)})
        messages.append(user_message(1))
    for sid, messages in histories.items():
        _, _, expected = reference_turn(llama, tokenizer, messages)
        mgr.chat(sid, messages, max_new_tokens=MAX_NEW)
        assert mgr.last_turn(sid).output_ids == expected
    assert mgr.last_turn("a").reason == "spill_reload"


def test_a_shared_tier_must_be_a_shared_tier(llama, tokenizer):
    # The manager asks a shared tier what only a SharedTier answers
    # (deleted_since, available, ...): a plain Tier claiming shared=True is
    # refused by name, not an AttributeError at its first turn.
    class Claims(MemoryTier):
        shared = True

    with pytest.raises(TypeError, match="tier: a tier with shared=True must subclass"):
        SessionManager(llama, tokenizer, tier=Claims())

    # A tier written to the old base, which took every turn's result on a
    # plain Tier: refused by name, not silently never called.
    class WritesTurns(MemoryTier):
        writes_turns = True

        def turn_finished(self, session_id, state, messages):
            pass

    with pytest.raises(TypeError, match="tier: a tier with writes_turns must subclass"):
        SessionManager(llama, tokenizer, tier=WritesTurns())


def test_a_tier_says_its_reload_reason_and_a_reason_that_is_no_reload_is_refused(llama, tokenizer):
    """A tier's reload_reason is "spill_reload" or "store_reload" (the name or
    the core's enum), read once the tier is bound; anything else is refused
    when the manager is built, not at the first reload."""
    for reason in ("my_reload", "extend", _C.ReuseReason.extend, 3, None):

        class Named(MemoryTier):
            reload_reason = reason

        with pytest.raises(TypeError, match="tier: reload_reason must be"):
            SessionManager(llama, tokenizer, tier=Named())

    class SaysSoWhenBound(MemoryTier):
        def bind(self, *args):
            super().bind(*args)
            self.reload_reason = "store_reload"

    mgr = SessionManager(llama, tokenizer, tier=SaysSoWhenBound(), max_sessions=1)
    mgr.tier.reload_reason = "my_reload"  # too late: read once, when the manager was built
    messages = [LONG_SYSTEM, user_message(0)]
    mgr.chat("a", messages, max_new_tokens=MAX_NEW)
    mgr.chat("b", [SYSTEM, user_message(1)], max_new_tokens=MAX_NEW)  # evicts "a" to the tier
    mgr.chat("a", [*messages, {"role": "assistant", "content": "ok"}, user_message(1)])
    assert mgr.last_turn("a").reason == "store_reload"

    class BadWhenBound(MemoryTier):
        def bind(self, *args):
            super().bind(*args)
            self.reload_reason = "my_reload"

    with pytest.raises(TypeError, match="tier: reload_reason must be"):
        SessionManager(llama, tokenizer, tier=BadWhenBound())


def test_a_tier_reading_the_old_bridge_attribute_gets_the_layout(llama, tokenizer):
    tier = MemoryTier()
    SessionManager(llama, tokenizer, tier=tier)
    with pytest.warns(DeprecationWarning, match="Tier.layout"):
        assert tier.bridge is tier.layout and tier.layout.slots == [None, None]


def test_a_shared_tier_written_to_the_interface_continues_sessions_exactly(llama, tokenizer):
    """A SharedTier that overrides only put/find/forget (the defaults know of
    no other process) is asked at every turn, gets every turn's result, and
    a session it hands back continues exactly."""

    class Memory(SharedTier):
        def __init__(self):
            super().__init__()
            self.caches, self.asked = {}, []

        def turn_finished(self, session_id, state, messages):
            self.caches[session_id] = state

        def find_if_cheaper(self, session_id, prompt, have=0, local=None):
            self.asked.append((session_id, have))
            state = self.caches.get(session_id)
            return state if state is not None and len(state.ids) > have else None

    tier = Memory()
    mgr = SessionManager(llama, tokenizer, tier=tier)
    messages = [LONG_SYSTEM, user_message(0)]
    messages.append({"role": "assistant", "content": mgr.chat("s", messages, max_new_tokens=4)})
    messages.append(user_message(1))
    assert "s" in tier.caches  # every turn's result, not only evictions
    mgr.remove("s", local_only=True)  # gone here; the shared tier still holds it
    _, _, expected = reference_turn(llama, tokenizer, messages)
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").output_ids == expected
    assert mgr.last_turn("s").reason == "spill_reload"
    assert [sid for sid, _ in tier.asked] == ["s", "s"]
