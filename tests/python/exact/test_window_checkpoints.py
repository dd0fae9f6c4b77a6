"""LFM2's checkpoints come off the one forward over a turn's tail (its conv
windows, ``bridge.windows``): they must hold what a forward stopping at each
checkpoint keeps, and a model that writes its conv state another way must get
the stopping forwards back, with a warning and every turn still exact."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_SYSTEM, MAX_NEW, model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.bridge import CacheBridge
from kvchat.prefill import ChunkedPrefill

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kept", [0, 9])
def test_windows_hold_what_a_forward_stopping_there_keeps(kept):
    model = model_for("lfm2")
    bridge = CacheBridge(model)
    assert bridge.checkpoints_from_windows
    prefill = ChunkedPrefill(model, bridge)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (1, 48), generator=torch.Generator().manual_seed(1))
    end = ids.shape[1]
    # The first stop is closer to the start than a conv window is wide.
    positions = [kept + 1, kept + 2, kept + 17, end - 1]

    def holding_kept():
        cache = bridge.new_cache()
        if kept:
            prefill.forward(ids, cache, 0, kept)
        return cache

    stopped = prefill.run(ids, holding_kept(), kept, positions)
    cache = holding_kept()
    with bridge.window_checkpoints(cache, kept, end, positions) as windows:
        middle = kept + 20  # a prefill in two chunks, as generate's prefill_chunk_size runs it
        prefill.forward(ids, cache, kept, middle)
        prefill.forward(ids, cache, middle, end)
    read = windows.checkpoints()
    assert windows.problem is None
    assert [c.position for c in read] == positions
    conv_layers = [j for j, state in enumerate(stopped[0].states) if state is not None]
    assert conv_layers and all(s is None for s in read[0].states if s is None)
    for a, b in zip(stopped, read, strict=True):
        for j in conv_layers:
            assert b.states[j].meta == a.states[j].meta
            for x, y in zip(a.states[j].tensors(), b.states[j].tensors(), strict=True):
                torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
    # The windows move from stop to stop: a stale window would fail above.
    first, last = read[0].states[conv_layers[-1]], read[-1].states[conv_layers[-1]]
    assert not torch.equal(first.tensors()[0], last.tensors()[0])


def test_a_model_that_bypasses_the_conv_layer_gets_stopping_forwards_back(
    monkeypatch, caplog, tokenizer
):
    """Here the model writes its conv state without handing the layer its
    inputs through the cache's method: the windows cannot be read, so the
    turn keeps no inner checkpoint, and from then on checkpoints stop the
    forward: a new session's first turn costs one forward more than
    generate's own (prefill, then one per new token but the last)."""
    from transformers.cache_utils import Cache

    def bypass(self, conv_states, layer_idx, state_idx=0, **kwargs):
        layer = self.layers[layer_idx]
        return type(layer).update_conv_state(layer, conv_states, state_idx, **kwargs)

    model = model_for("lfm2")
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        mgr = SessionManager(model, tokenizer, settle=False)
        extra = {}
        for session, patched in (("s", False), ("t", True), ("u", True)):
            if patched:
                monkeypatch.setattr(Cache, "update_conv_state", bypass)
            messages = [LONG_SYSTEM, user_message(0)]
            forwards.clear()
            with caplog.at_level("WARNING", logger="kvchat"):
                reply = mgr.chat(session, messages, max_new_tokens=MAX_NEW)
            extra[session] = len(forwards) - mgr.last_turn(session).generated_tokens
            assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0], session
    finally:
        hook.remove()
    assert extra == {"s": 0, "t": 0, "u": 1}, extra  # the stop comes back after the failure
    assert "did not hand conv layers" in caplog.text
    assert caplog.text.count("checkpoints will stop the prefill") == 1
    assert mgr.info("u").checkpoints == 2  # at the system prompt's end, and the prompt's
