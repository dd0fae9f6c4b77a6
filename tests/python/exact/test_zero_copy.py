"""Tensors cross between the core and transformers by reference, never copied."""

from __future__ import annotations

import torch
from kvchat import _C, SessionManager


def test_attention_state_holds_the_callers_tensors():
    keys, values = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    state = _C.AttentionState(keys, values)
    assert state.keys.data_ptr() == keys.data_ptr()
    cropped = state.cropped(3)
    assert cropped.keys.data_ptr() == keys.data_ptr()
    assert cropped.num_tokens == 3
    assert cropped.nbytes() == state.nbytes() == keys.nbytes + values.nbytes


def test_session_stores_generate_cache_by_reference(llama):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 16), generator=torch.Generator().manual_seed(8))
    out = mgr.generate(
        ids, session_id="z", max_new_tokens=4, do_sample=False, return_dict_in_generate=True
    )
    session = mgr._core.find("z")
    plan = session.plan(torch.cat([out.sequences[0], torch.tensor([5, 6])]))
    stored = session.layers_for(plan)
    for state, layer in zip(stored, out.past_key_values.layers, strict=True):
        assert state.keys.data_ptr() == layer.keys.data_ptr()
    # The cache built for the next turn holds views of the same storage
    # (to_cache consumes the list, so note the pointer first).
    storage = stored[0].keys.data_ptr()
    cache = mgr._bridge.to_cache(stored)
    assert cache.layers[0].keys.data_ptr() == storage
    assert stored[0] is None
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
