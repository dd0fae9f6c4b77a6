"""The core's layer kinds and checkpoints, through the bindings."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_SYSTEM, REUSE_FAMILIES, model_for, user_message
from kvchat import _C, SessionManager


def test_sliding_window_and_recurrent_states_crop_rules():
    kv = torch.zeros(1, 2, 6, 4)
    assert _C.SlidingWindowState(kv, kv, 6).can_crop_to(3)
    slid = _C.SlidingWindowState(kv, kv, 20)
    assert slid.kind == _C.LayerKind.sliding_window
    assert slid.held_tokens == 6 and slid.num_tokens == 20
    assert not slid.can_crop_to(19)
    recurrent = _C.RecurrentState([torch.zeros(1, 3, 4)], 20)
    assert recurrent.can_crop_to(20) and not recurrent.can_crop_to(19)
    with pytest.raises(IndexError, match="restore a checkpoint"):
        recurrent.cropped(10)


def test_session_restores_a_checkpoint_through_the_bindings():
    def layers(n):
        kv = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 4).contiguous()
        return [_C.AttentionState(kv, kv), _C.RecurrentState([torch.full((1, 3), float(n))], n)]

    core = _C.SessionManager(
        _C.ManagerLimits(num_layers=2, checkpoints=_C.CheckpointPolicy(max_count=4)),
        _C.TurnSettings(markers=_C.TurnMarkers([2], [])),
    )
    ids = torch.arange(100, 130)
    checkpoint = _C.Checkpoint(12, [None, layers(12)[1]])
    # A turn whose prompt is `ids` but its last, and whose reply caches the rest.
    with (lease := core.acquire("h")) as session, core.begin_turn(lease, ids[:-1], 2) as turn:
        sequence = torch.cat([ids, torch.tensor([3])])
        result = _C.TurnResult(
            sequence=sequence, layers=layers(30), cached_tokens=30, checkpoints=[checkpoint]
        )
        assert turn.finish(result).cache_stored
    assert list(session.cached_ids()) == ids.tolist()
    prompt = torch.cat([ids[:20], torch.tensor([1, 2, 3])])
    plan = session.plan(prompt)
    assert (plan.kept_tokens, plan.checkpoint_position) == (12, 12)
    restored = session.layers_for(plan)
    assert restored[0].num_tokens == 12
    assert restored[1].tensors()[0][0, 0].item() == 12.0
    info = session.cache_info()
    assert info.checkpoints == 1 and info.checkpoint_bytes == 3 * 4


@pytest.mark.parametrize("family", REUSE_FAMILIES)
def test_every_stored_state_describes_itself_and_rebuilds_from_that(family, tokenizer):
    """`state.meta` and `state.tensors()` are all a session file keeps of a state."""
    mgr = SessionManager(model_for(family), tokenizer)
    mgr.chat("s", [LONG_SYSTEM, user_message(0)], max_new_tokens=6)
    cached = mgr._core.find("s").cached_state()
    states = list(cached.layers)
    for checkpoint in cached.checkpoints:
        states += [s for s in checkpoint.states if s is not None]
    assert states
    for state in states:
        rebuilt = _C.LayerState.from_state(state.meta, state.tensors())
        assert type(rebuilt) is type(state)
        assert rebuilt.meta == state.meta
        assert all(
            torch.equal(a, b) for a, b in zip(rebuilt.tensors(), state.tensors(), strict=True)
        )


def test_a_malformed_description_is_a_value_error_naming_it():
    kv = torch.zeros(1, 2, 6, 4)
    meta = _C.AttentionState(kv, kv).meta
    assert meta == {"kind": "attention", "tokens": 6, "tensors": 2, "parts": []}
    cases = [
        ("not a dict", "must be a dict"),
        ({**meta, "kind": "mamba"}, "unknown kind 'mamba'"),
        ({**meta, "tokens": "6"}, "'tokens' must be an int"),
        ({**meta, "tensors": True}, "'tensors' must be an int"),
        ({**meta, "tokens": 7}, "holds 6"),
        ({"kind": "attention", "tensors": 2}, "no 'tokens'"),
        ({**meta, "parts": [meta]}, "has no parts"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.LayerState.from_state(bad, [kv, kv])
