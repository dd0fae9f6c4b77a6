"""Property tests (hypothesis): the radix tree against brute force, and the core
planner and manager driven by random token streams, edits, shared prefixes
and evictions.

The manager test stores attention states whose keys encode their token ids,
so any reuse that hands a session KV for other tokens (another session's, or
its own from before an edit) shows up as a mismatch."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvchat import _C

EOT = 2  # the end-of-turn token: message boundaries follow it
SYSTEM = [3, 4, 5, 3, 4, EOT]  # most conversations start alike, so sharing is common
MARKERS = _C.TurnMarkers([EOT], [])
LAYERS = 2

tokens = st.lists(st.integers(min_value=2, max_value=5), min_size=1, max_size=24)


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----------------------------------------------------------------- radix tree
radix_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from("abcdef"), tokens),
        st.tuples(st.just("erase"), st.sampled_from("abcdef"), st.just([])),
        st.tuples(st.just("query"), st.just(""), tokens),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(radix_ops)
def test_radix_tree_matches_brute_force(ops):
    tree, model = _C.TokenRadixTree(), {}
    for op, key, ids in ops:
        if op == "insert":
            tree.insert(key, ids)
            model[key] = list(ids)
        elif op == "erase":
            tree.erase(key)
            model.pop(key, None)
        else:
            length, found = tree.longest_common_prefix(ids)
            assert length == max((lcp(ids, seq) for seq in model.values()), default=0)
            if length:
                assert lcp(ids, model[found]) == length
            whole = [len(seq) for seq in model.values() if ids[: len(seq)] == seq]
            length, found = tree.longest_stored_prefix(ids)
            assert length == max(whole, default=0)
            if found:
                assert model[found] == ids[:length]
        assert len(tree) == len(model)
        assert all(key in tree for key in model)


# ------------------------------------------------------- planner and manager
def encoded(ids) -> _C.AttentionState:
    """An attention layer whose keys at position t are ids[t]."""
    keys = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2)
    return _C.AttentionState(keys.contiguous(), keys.contiguous() + 0.5)


def decoded(state) -> list[int]:
    keys = state.tensors()[0]
    return [int(v) for v in keys[0, 0, :, 0].tolist()]


def edit(cached: list[int], kind: str, at: int, new: list[int]) -> list[int]:
    """A next prompt: extend the conversation, or edit/truncate it at ``at``."""
    at = min(at, len(cached))
    if not cached:
        return SYSTEM + new if kind != "truncate" else new
    if kind == "extend":
        return cached + new
    if kind == "edit":
        return cached[:at] + new
    return cached[: max(at, 1)]  # regenerate from an earlier point


turn_ops = st.lists(
    st.tuples(
        st.sampled_from(["turn", "turn", "turn", "clear", "remove"]),
        st.sampled_from(["s0", "s1", "s2", "s3"]),
        st.sampled_from(["extend", "edit", "truncate"]),
        st.integers(min_value=0, max_value=30),
        tokens,
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn_ops, st.integers(min_value=0, max_value=6), st.booleans())
def test_manager_never_reuses_kv_of_other_tokens(ops, budget_tokens, share):
    per_token = LAYERS * 2 * 2 * 4  # keys + values, 2 floats each, per layer
    budget = budget_tokens * 8 * per_token  # 0: no byte limit
    limits = _C.ManagerLimits(
        max_sessions=3,
        max_cache_bytes=budget,
        num_layers=LAYERS,
        min_shared_tokens=2 if share else 0,
    )
    mgr = _C.SessionManager(limits, _C.TurnSettings(markers=MARKERS))
    conversations: dict[str, list[int]] = {}
    for op, sid, kind, at, new in ops:
        if op in ("clear", "remove"):
            if sid in mgr:
                getattr(mgr, op)(sid)
                conversations.pop(sid, None)
            continue
        prompt = edit(conversations.get(sid, []), kind, at, new)
        ids = torch.tensor(prompt, dtype=torch.long)
        with (lease := mgr.acquire(sid)), mgr.begin_turn(lease, ids, 2) as turn:
            # The turn path itself: begin_turn plans, shares and hands out layers.
            plan = turn.plan
            if plan.reason == _C.ReuseReason.shared_prefix:
                event("started from a shared prefix")
            kept = plan.kept_tokens
            assert kept <= len(prompt) - 1
            layers = plan.take_layers()
            if kept:
                event(f"reused ({plan.reason.name})")
                # What a turn reuses is exactly the prompt's own first tokens.
                for layer in layers:
                    assert layer.num_tokens == kept
                    assert decoded(layer) == prompt[:kept]
            else:
                assert layers == []
            reply = [EOT, 3]  # the "generated" tokens; the last one is never cached
            full = prompt + reply[:-1]
            result = _C.TurnResult(
                sequence=torch.tensor(prompt + reply, dtype=torch.long),
                layers=[encoded(full) for _ in range(LAYERS)],
                cached_tokens=len(full),
            )
            record = turn.finish(result)
            assert record.cache_stored and record.reused_tokens == kept
            conversations[sid] = full
        stats = mgr.stats()
        if stats.evictions:
            event("evicted")
        if budget:
            assert stats.resident_bytes <= budget
        for other in mgr.session_ids():  # every resident cache still encodes its own ids
            state = mgr.find(other).cached_state()
            for layer in state.layers:
                assert decoded(layer) == list(state.ids)
