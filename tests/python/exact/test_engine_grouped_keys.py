"""Masked prefills on the engine's thread keep grouped keys grouped
(engine/grouped_keys.py), in float64: transformers copies keys and values to
every query head under a mask only outside the engine, and the replies are
plain ``generate``'s either way."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import model_for, reference_turn
from kvchat import SessionManager
from kvchat.engine import grouped_keys
from kvchat.tiny import tiny_tokenizer
from test_engine import chat_call, together
from test_engine_prompts import own_system, reply_and_next
from transformers.integrations import sdpa_attention


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


class RepeatCount:
    """Counts transformers' ``repeat_kv`` calls, per thread name."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {}
        original = sdpa_attention.repeat_kv

        def counted(hidden_states, n_rep):
            name = threading.current_thread().name
            self.calls[name] = self.calls.get(name, 0) + (n_rep > 1)
            return original(hidden_states, n_rep)

        monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompts_over_pasts_prefill_without_repeating_keys(family, tokenizer, monkeypatch):
    """A GQA model (2 key/value heads for 4 query heads): three conversations'
    second turns prefill together over pasts of different lengths (a mask),
    then one turn alone over its cache (a mask too). The engine's thread never
    repeats keys, every reply is plain generate's, and off the engine's
    thread transformers decides as before."""
    model = model_for(family)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = [own_system(k) for k in range(3)]
    for turn in range(2):
        calls = [chat_call(manager, f"s{k}", conversations[k], 6) for k in range(3)]
        reports = together(manager, calls)
        for k, report in enumerate(reports):
            expected = reference_turn(model, tokenizer, conversations[k], 6)[2]
            assert report.output_ids == expected, (turn, k)
            conversations[k] = reply_and_next(tokenizer, conversations[k], expected)
        if turn == 0:
            counts = RepeatCount(monkeypatch)  # from the turns over pasts on
    alone = manager.chat("s0", conversations[0], max_new_tokens=6, settle=False)
    assert alone == reference_turn(model, tokenizer, conversations[0], 6)[0]
    assert manager.stats().prompts_prefilled_together == 6
    assert counts.calls.get("kvchat-engine", 0) == 0, counts.calls
    manager.close()
    # Off the engine's thread, transformers decides as before: keys repeat under a mask.
    keys = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    assert not sdpa_attention.use_gqa_in_sdpa(mask, keys, keys)
    grouped_keys.on_this_thread(True)
    try:
        assert sdpa_attention.use_gqa_in_sdpa(mask, keys, keys)
        assert not sdpa_attention.use_gqa_in_sdpa(mask[:, :, :1], keys, keys)  # a decode step
    finally:
        grouped_keys.on_this_thread(False)


def test_a_users_wrapper_installed_between_managers_is_called_once(tokenizer, monkeypatch):
    """A user wraps ``use_gqa_in_sdpa`` after a first manager put the engine's
    answer in front of transformers' (as a profiler or a test does), then
    makes a second manager: the question is answered (no wrapper calling
    itself without end), the user's wrapper still sees every question, and
    the second manager's turn is plain generate's with keys kept grouped."""
    model = model_for("llama")
    SessionManager(model, tokenizer).close()  # the engine's answer installed
    engines = sdpa_attention.use_gqa_in_sdpa
    asked = []

    def users(attention_mask, key, value, *args, **kwargs):
        asked.append(threading.current_thread().name)
        return engines(attention_mask, key, value, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", users)
    manager = SessionManager(model, tokenizer)
    messages = own_system(0)
    counts = RepeatCount(monkeypatch)
    reply = manager.chat("a", messages, max_new_tokens=6, settle=False)
    second = reply_and_next(tokenizer, messages, reference_turn(model, tokenizer, messages, 6)[2])
    calls_before = dict(counts.calls)
    assert (
        manager.chat("a", second, max_new_tokens=6, settle=False)
        == reference_turn(model, tokenizer, second, 6)[0]
    )
    manager.close()
    assert reply == reference_turn(model, tokenizer, messages, 6)[0]
    assert "kvchat-engine" in asked
    assert counts.calls.get("kvchat-engine", 0) == calls_before.get("kvchat-engine", 0)
    keys = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    assert not sdpa_attention.use_gqa_in_sdpa(mask, keys, keys)  # off the engine's thread


def test_transformers_5_0s_question_of_two_arguments_is_answered(monkeypatch):
    """transformers 5.0 (which kvchat accepts) asks ``use_gqa_in_sdpa(mask,
    key)``, with no value: the engine's answer takes that call on every
    thread, passes it to transformers' own as it came, and on the engine's
    thread keeps grouped keys grouped under a mask of several query rows."""
    received = []

    def transformers_5_0(attention_mask, key):
        received.append((attention_mask, key))
        return attention_mask is None

    monkeypatch.setattr(grouped_keys, "_original", transformers_5_0)
    keys = torch.zeros(1, 2, 5, 8, dtype=torch.float64)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    answer = grouped_keys._use_gqa_in_sdpa
    assert not answer(mask, keys) and answer(None, keys)  # off the engine's thread
    assert len(received) == 2 and received[0][0] is mask and received[0][1] is keys
    grouped_keys.on_this_thread(True)
    try:
        assert answer(mask, keys)
        assert not answer(mask[:, :, :1], keys)  # a decode step: transformers decides
    finally:
        grouped_keys.on_this_thread(False)
    assert len(received) == 3
