"""The core's layer kinds and checkpoints, through the bindings."""

from __future__ import annotations

import pytest
import torch
from kvchat import _C


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

    session = _C.ChatSession("h", num_layers=2, max_checkpoints=4)
    ids = torch.arange(100, 130)
    checkpoint = _C.Checkpoint(12, [None, layers(12)[1]])
    session.commit(ids, layers(30), 0, _C.TurnMarkers([2], []), checkpoints=[checkpoint])
    prompt = torch.cat([ids[:20], torch.tensor([1, 2, 3])])
    plan = session.plan(prompt)
    assert (plan.kept_tokens, plan.checkpoint_position) == (12, 12)
    restored = session.layers_for(plan)
    assert restored[0].num_tokens == 12
    assert restored[1].tensors()[0][0, 0].item() == 12.0
    info = session.cache_info()
    assert info.checkpoints == 1 and info.checkpoint_bytes == 3 * 4
