"""Quantized weights, as a CPU user runs them (RESULTS §14): torchao's int8
weight-only linear layers keep a forward over a cache the forward over the
whole prompt, so kvchat reuses and stays exact; torch's int8 dynamic
quantization scales activations by each forward's own range, so it does not,
and the construction-time probe runs it as plain ``generate``. float32: the
quantized kernels take no float64."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_SYSTEM, MAX_NEW, exact_turns, user_message
from kvchat import SessionManager
from kvchat.fingerprint import weights_checksum
from kvchat.tiny import tiny_model
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # make test installs torchao


def _int8_weight_only():
    model = tiny_model("llama", dtype=torch.float32)
    quantize_(model, Int8WeightOnlyConfig())
    return model


def _conversation(manager, model, tokenizer, turns=4):
    return exact_turns(manager, "s", [LONG_SYSTEM], model, tokenizer, turns)[1]


def test_int8_weight_only_weights_are_fingerprinted_by_their_contents():
    model = _int8_weight_only()
    weight = model.model.layers[1].mlp.down_proj.weight
    assert type(weight).__name__ != "Parameter"  # a tensor subclass, with no raw words to view
    before = weights_checksum(model)
    assert before == weights_checksum(model)
    with torch.no_grad():
        weight.qdata[3, 5] += 1
    assert weights_checksum(model) != before


def test_int8_weight_only_reuses_and_stays_exact(tokenizer):
    model = _int8_weight_only()
    reports = _conversation(SessionManager(model, tokenizer), model, tokenizer)
    for report in reports[1:]:
        assert report.reused_tokens >= 0.8 * report.prompt_tokens, report


def test_int8_dynamic_quantization_runs_as_plain_generate(tokenizer):
    model = torch.ao.quantization.quantize_dynamic(
        tiny_model("llama", dtype=torch.float32), {torch.nn.Linear}, dtype=torch.qint8
    )
    reports = _conversation(SessionManager(model, tokenizer), model, tokenizer)
    assert all(r.reused_tokens == 0 for r in reports), reports
    assert {r.reason for r in reports} == {"unsupported_layers"}, reports


def test_two_quantizations_with_equal_data_have_different_fingerprints(tokenizer, tmp_path):
    """int8 weight-only and int8 dynamic-activation weights hold the same int8
    data and scales, and compute differently: their fingerprints differ, so a
    session saved from one is refused by the other."""
    from kvchat import SessionFileError
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    weight_only = _int8_weight_only()
    dynamic = tiny_model("llama", dtype=torch.float32)
    quantize_(dynamic, Int8DynamicActivationInt8WeightConfig())
    assert weights_checksum(weight_only) != weights_checksum(dynamic)
    saver = SessionManager(weight_only, tokenizer)
    saver.chat("s", [LONG_SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
    saver.save("s", tmp_path / "s.safetensors")
    with pytest.raises(SessionFileError, match="weights differ"):
        SessionManager(dynamic, tokenizer).load(tmp_path / "s.safetensors")
