"""The model fingerprint changes when any weight does, so a cache saved from one
model never loads into another."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MAX_NEW, SYSTEM, model_for, user_message
from kvchat import SessionFileError, SessionManager
from kvchat.fingerprint import weights_checksum


def changed_in_a_middle_layer(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6
    return other


def test_one_value_in_a_middle_layer_changes_the_fingerprint(llama):
    assert weights_checksum(llama) == weights_checksum(copy.deepcopy(llama))
    assert weights_checksum(llama) != weights_checksum(changed_in_a_middle_layer(llama))


def test_swapped_rows_change_the_fingerprint(llama):
    other = copy.deepcopy(llama)
    with torch.no_grad():
        weight = other.model.layers[0].self_attn.q_proj.weight
        weight[[0, 1]] = weight[[1, 0]]
    assert weights_checksum(llama) != weights_checksum(other)


def test_a_buffer_changes_the_fingerprint(llama):
    other = copy.deepcopy(llama)
    with torch.no_grad():
        other.model.rotary_emb.inv_freq[0] += 1e-3
    assert weights_checksum(llama) != weights_checksum(other)


def test_fingerprint_leaves_the_weights_alone(llama):
    before = {name: p.detach().clone() for name, p in llama.named_parameters()}
    weights_checksum(llama)
    for name, param in llama.named_parameters():
        assert torch.equal(param, before[name]), name


def test_file_from_a_model_differing_in_a_middle_layer_is_refused(llama, tokenizer, tmp_path):
    saver = SessionManager(llama, tokenizer)
    saver.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
    path = tmp_path / "s.safetensors"
    saver.save("s", path)
    other = SessionManager(changed_in_a_middle_layer(llama), tokenizer)
    with pytest.raises(SessionFileError, match="weights differ"):
        other.load(path)
    assert other.sessions() == []


def test_lora_adapters_loaded_or_merged_change_the_fingerprint(tokenizer, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in make test's dependencies")
    base = model_for("llama")
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0
    )
    adapted = peft.get_peft_model(copy.deepcopy(base), config)
    merged = copy.deepcopy(adapted).merge_and_unload()
    sums = {weights_checksum(m) for m in (base, adapted, merged)}
    assert len(sums) == 3
    # A session saved on the base model is refused by the merged fine-tune.
    saver = SessionManager(base, tokenizer)
    saver.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
    saver.save("s", tmp_path / "s.safetensors")
    with pytest.raises(SessionFileError, match="weights differ"):
        SessionManager(merged, tokenizer).load(tmp_path / "s.safetensors")
