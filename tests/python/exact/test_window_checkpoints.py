"""LFM2's checkpoints come off the one forward over a turn's tail (its conv
windows, ``bridge.windows``): they must hold what a forward stopping at each
checkpoint keeps, and a model that writes its conv state another way must get
the stopping forwards back, with a warning and every turn still exact."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    LONG_SYSTEM,
    MAX_NEW,
    REUSE_FAMILIES,
    WINDOW_FAMILIES,
    exact_turn,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import SessionManager
from kvchat.bridge import CacheBridge
from kvchat.prefill import ChunkedPrefill
from kvchat.prompting import render_prompt

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
        prefill.forward(ids, cache, kept, end)
    read, problem = windows.finish()
    assert problem is None
    assert [c.position for c in read] == positions
    # The same layers hold a state in both: the conv layers, not attention.
    conv_layers = [j for j, state in enumerate(stopped[0].states) if state is not None]
    assert conv_layers and [s is None for s in read[0].states] == [
        s is None for s in stopped[0].states
    ]
    for a, b in zip(stopped, read, strict=True):
        for j in conv_layers:
            assert b.states[j].meta == a.states[j].meta
            for x, y in zip(a.states[j].tensors(), b.states[j].tensors(), strict=True):
                torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
    # The windows move from stop to stop: a stale window would fail above.
    first, last = read[0].states[conv_layers[-1]], read[-1].states[conv_layers[-1]]
    assert not torch.equal(first.tensors()[0], last.tensors()[0])


def test_only_a_model_of_conv_windows_alone_reads_its_checkpoints_off_the_forward():
    """Decided from the probed layers: of the families kvchat tests, LFM2
    alone keeps nothing that cannot crop but conv windows (Qwen3.5's
    DeltaNet and the Mamba2 families keep a recurrent state beside theirs,
    Gemma's sliding layers keys)."""
    reading = {f for f in REUSE_FAMILIES if CacheBridge(model_for(f)).checkpoints_from_windows}
    assert reading == set(WINDOW_FAMILIES)


def test_a_chunked_prefill_stops_the_forward_and_keeps_windows_for_later_turns(tokenizer):
    """generate's prefill_chunk_size splits the prefill, and a one-token
    chunk skips LFM2's update_conv_state: such a turn stops the forward at
    its checkpoints instead, exact, and later turns still read windows."""
    model = model_for("lfm2")
    mgr = SessionManager(model, tokenizer, settle=False)
    messages = [LONG_SYSTEM, user_message(0)]
    tokens = len(render_prompt(tokenizer, messages))
    chunk = tokens - 1  # a one-token last chunk
    reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW, prefill_chunk_size=chunk)
    assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    assert mgr.info("s").checkpoints == 2  # the system prompt's end, and the prompt's
    assert mgr._bridge.checkpoints_from_windows
    again = [LONG_SYSTEM, user_message(1)]  # diverges after the system prompt
    exact_turn(mgr, "s", again, model, tokenizer)
    assert mgr.last_turn("s").checkpoint_restored == mgr.last_turn("s").reused_tokens > 0


def test_a_chunk_size_from_the_models_own_generation_config_is_seen(tokenizer):
    """generate completes a generation_config passed in from the model's own,
    so a prefill_chunk_size set on the model chunks the prefill even when
    the caller's config has none: the turn stops its forward (exact), and
    windows are not switched off for every later turn."""
    from transformers import GenerationConfig

    model = model_for("lfm2")
    messages = [LONG_SYSTEM, user_message(0)]
    expected = reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    model.generation_config.prefill_chunk_size = 64
    try:
        mgr = SessionManager(model, tokenizer, settle=False)
        config = GenerationConfig(do_sample=False)
        reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW, generation_config=config)
        assert reply == expected
        assert mgr.info("s").checkpoints == 2  # the system prompt's end, and the prompt's
        assert mgr._bridge.checkpoints_from_windows
    finally:
        model.generation_config.prefill_chunk_size = None


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
    assert mgr.info("t").checkpoints == 1  # the failed turn kept only the prompt's end
    assert mgr.info("u").checkpoints == 2  # at the system prompt's end, and the prompt's
    # "u" restores its system prompt's checkpoint, taken by a stopped forward.
    _, report = exact_turn(mgr, "u", [LONG_SYSTEM, user_message(3)], model, tokenizer)
    assert report.checkpoint_restored == report.reused_tokens > 0, report
