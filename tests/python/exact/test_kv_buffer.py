"""The decode path: kvchat's in-place KV buffer as a transformers cache layer."""

from __future__ import annotations

import torch
from helpers import MAX_NEW, SYSTEM, user_message
from kvchat import _C, SessionManager
from kvchat.bridge import BufferedLayer, CacheBridge
from kvchat.prompting import render_prompt
from transformers import DynamicCache


def test_buffered_layer_decodes_in_place_and_matches_dynamic_cache(llama, tokenizer):
    prompt = render_prompt(tokenizer, [SYSTEM, user_message(0)]).unsqueeze(0)
    bridge = CacheBridge(llama)
    cache = bridge.to_cache([], reserve=prompt.shape[1] + MAX_NEW)
    assert all(isinstance(layer, BufferedLayer) for layer in cache.layers)
    kwargs = dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    out = llama.generate(prompt, past_key_values=cache, **kwargs)
    plain = llama.generate(prompt, past_key_values=DynamicCache(config=llama.config), **kwargs)
    assert torch.equal(out, plain)
    layer = cache.layers[0]
    # Reserved once for the whole turn: every token was appended in place.
    assert layer.buffer.reallocations == 0
    assert layer.buffer.capacity == prompt.shape[1] + MAX_NEW
    assert layer.keys.data_ptr() == layer.buffer.keys().data_ptr()


def test_next_turn_appends_into_the_sessions_storage_without_copying(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    session = mgr._core.find("s")
    stored = session.layers_for(session.plan(torch.tensor(session.cached_ids() + [1])))
    keys, values = stored[0].keys, stored[0].values
    keys_before = keys.clone()
    buffer = stored[0].buffer()
    # The session owns its arena's tail, so the next turn extends it in place.
    buffer.append(torch.zeros_like(keys[:, :, :1]), torch.zeros_like(values[:, :, :1]))
    assert buffer.reallocations == 0
    # A second holder branching at the same point must copy: copy-on-write.
    other = stored[0].buffer()
    other.append(torch.ones_like(keys[:, :, :1]), torch.ones_like(values[:, :, :1]))
    assert other.reallocations == 1
    assert torch.equal(stored[0].keys, keys_before)  # what the session holds never changed
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)  # and the manager still works after


def test_kv_buffer_rejects_bad_input():
    buffer = _C.KvBuffer.empty_like(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 8)
    for keys in (torch.zeros(1, 3, 1, 4), torch.zeros(1, 2, 1, 4, dtype=torch.float64)):
        try:
            buffer.append(keys, keys)
        except ValueError as error:
            assert "KvBuffer.append" in str(error)
        else:
            raise AssertionError(f"append accepted {keys.shape} {keys.dtype}")
