"""More families, each tried as a new user would: a few turns, every reply
against plain ``generate`` on the whole conversation, and reuse from turn 2.

Tiny random configs, built here (they are test fixtures, not kvchat's tiny
families). float64 where the model runs in it; the mixture-of-experts families
(GraniteMoeHybrid, Jamba, gpt-oss, GLM-MoE-DSA) refuse float64 in transformers' grouped
matrix product ("Expected mat_a to be Float32, BFloat16 or Float16"), so they
run in float32, where these seeds leave no near-tie. Zamba2 runs in float64."""

from __future__ import annotations

import inspect

import pytest
import torch
from families import FAMILIES, MAMBA2, MOE, RECURRENT_ONLY, SHAPE, tiny_from_config
from helpers import (
    DEVICE,
    LONGER_SYSTEM,
    SYSTEM,
    assert_plain_turns,
    exact_turns,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import SessionManager
from kvchat.prompting import render_prompt


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_exact_and_reuses(family, tokenizer):
    model_type, dtype, fields, layers = FAMILIES[family]
    model = tiny_from_config(model_type, dtype, dict(SHAPE, **fields), tokenizer)
    manager = SessionManager(model, tokenizer)
    assert list(manager.layout.layer_classes) == layers
    _converse(manager, model, tokenizer, SYSTEM, max_new_tokens=8, min_reuse=0.5)


@pytest.mark.parametrize("family", ["nemotron_h", "gemma3n"])
def test_stateless_layer_families_reuse_a_normal_conversation(family, tokenizer):
    """NemotronH (MLP-only layers) and Gemma 3n (KV-shared layers) hold
    DummyLayers: from turn 2 on, a normal conversation (a 400-token system
    prompt, short questions and replies) reuses at least 90% of each prompt."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    _converse(manager, model, tokenizer, LONGER_SYSTEM, max_new_tokens=12, min_reuse=0.9)


def _converse(manager, model, tokenizer, system, max_new_tokens, min_reuse, turns=4):
    """``turns`` turns, each plain generate's reply; from the second, each
    extends or forks the cache and reuses at least ``min_reuse`` of its prompt."""
    _, reports = exact_turns(manager, "s", [system], model, tokenizer, turns, 0, max_new_tokens)
    for report in reports[1:]:
        assert report.reason in ("extend", "diverged"), report
        assert report.reused_tokens >= min_reuse * report.prompt_tokens, report


# GLM-MoE-DSA (DeepSeek-V3.2-style sparse attention): multi-head latent
# attention, and an indexer that picks each query's index_topk keys; with
# prompts of hundreds of tokens and index_topk=8 the selection is real.
DSA = dict(
    SHAPE,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
)
DSA_VARIANTS = {
    # Dense layers run in float64. The middle layer reuses the previous
    # layer's selection ("shared"), so its indexer keys stay empty.
    "dense-float64": (
        torch.float64,
        dict(
            num_hidden_layers=3, first_k_dense_replace=3, indexer_types=["full", "shared", "full"]
        ),
        2,
    ),
    # Its experts refuse float64 like the other MoE families here.
    "moe-float32": (
        torch.float32,
        dict(
            MOE,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=2,
            n_shared_experts=1,
        ),
        2,
    ),
}


def _dsa(variant, tokenizer, **fields):
    dtype, variant_fields, _ = DSA_VARIANTS[variant]
    return tiny_from_config("glm_moe_dsa", dtype, dict(DSA, **variant_fields, **fields), tokenizer)


@pytest.mark.parametrize("variant", DSA_VARIANTS)
def test_dsa_sparse_selection_runs_as_plain_generate_exactly(variant, tokenizer, caplog):
    """Once a prompt is longer than index_topk, GLM-MoE-DSA's forward over
    several tokens over a cache selects other keys than one forward over the
    whole prompt (in transformers itself: its logits move by about 0.2), so
    no reuse is exact. The probe finds it, with a prompt longer than the
    selection, and every turn is plain generate, with a warning. Before the
    probe ran on attention-only models, kvchat reused these prompts and its
    reply differed from plain generate's (1 turn in 6 of a short replay).
    On CUDA (an H200, torch 2.11) the split forward selected as the whole one
    did: the probe accepted both variants, and each of four turns (three
    reusing the cache) was plain generate's; there the promise checked is
    that exactness."""
    model = _dsa(variant, tokenizer)
    if DEVICE.type != "cpu":
        manager = SessionManager(model, tokenizer)
        _, reports = exact_turns(
            manager, "s", [LONGER_SYSTEM], model, tokenizer, 4, max_new_tokens=8
        )
    else:
        reports = _refused_by_the_probe_and_exact(model, tokenizer, caplog)
    for report in reports:
        assert report.prompt_tokens > 8 * DSA["index_topk"], report  # the selection is real


@pytest.mark.slow  # prompts of hundreds of tokens through sparse attention
@pytest.mark.parametrize("variant", DSA_VARIANTS)
def test_dsa_indexed_layers_carry_keys_values_and_indexer_keys(
    variant, tokenizer, tmp_path, monkeypatch
):
    """How kvchat carries a DynamicIndexedLayer were its forward exact: keys,
    values and per-token indexer keys, the indexer keys cropped like KV.
    With index_topk above every prompt's length the selection keeps every
    key, so reuse is exact; the probe (which uses a prompt longer than the
    selection, and so refuses this model) is bypassed. Every turn is plain
    generate's reply, from turn 2 at least 90% reused; a second session
    starts from the first one's system prompt, and a saved session
    continues exactly."""
    from kvchat.bridge import probe

    monkeypatch.setattr(probe, "_split_problem", lambda model, arguments: None)
    model = _dsa(variant, tokenizer, index_topk=1024)
    manager = SessionManager(model, tokenizer)
    layers = len(model.config.layer_types)
    assert list(manager.layout.layer_classes) == ["DynamicIndexedLayer"] * layers
    # One core layer per cache layer, then one per indexer that fills its keys.
    assert manager.layout.num_layers == layers + DSA_VARIANTS[variant][2]
    _converse(manager, model, tokenizer, LONGER_SYSTEM, max_new_tokens=8, min_reuse=0.9)

    messages = [LONGER_SYSTEM, user_message(5)]
    reply = manager.chat("other", messages, max_new_tokens=8)
    assert reply == reference_turn(model, tokenizer, messages, 8)[0]
    report = manager.last_turn("other")
    assert report.reason == "shared_prefix" and report.reused_tokens > 0, report
    assert report.prompt_tokens < 1024, report  # below the selection: exact

    manager.save("other", tmp_path / "other.safetensors")
    fresh = SessionManager(model, tokenizer)
    fresh.load(tmp_path / "other.safetensors")
    messages += [{"role": "assistant", "content": reply}, user_message(6)]
    reply = fresh.chat("other", messages, max_new_tokens=8)
    assert reply == reference_turn(model, tokenizer, messages, 8)[0]
    report = fresh.last_turn("other")
    assert report.reason in ("extend", "diverged") and report.reused_tokens > 0, report


def test_dsa_indexer_positions_run_as_plain_generate_exactly(tokenizer, caplog, monkeypatch):
    """A model that keeps per-token indexer positions in its cache
    (Qwen4-Exp's indexer_position_ids), which kvchat does not carry, runs every
    turn as plain generate, passing no cache, with the same tokens. A hook
    makes GLM-MoE-DSA keep them, so the test needs no second tiny family; the
    split probe, which refuses GLM-MoE-DSA on its own, is bypassed."""
    from kvchat.bridge import probe

    monkeypatch.setattr(probe, "_split_problem", lambda model, arguments: None)
    model = _dsa("dense-float64", tokenizer)

    def keep_positions(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # 5.24 renamed it
        if cache is not None:
            seen = cache.get_seq_length()
            positions = torch.arange(seen, seen + kwargs["input_ids"].shape[1])
            cache.layers[0].indexer_position_ids = positions.view(1, 1, -1)

    hook = model.model.register_forward_pre_hook(keep_positions, with_kwargs=True)
    try:
        manager = SessionManager(model, tokenizer)
        assert not manager.layout.supported
        assert "layer 0 keeps indexer_position_ids" in caplog.text
        assert_plain_turns(manager, model, tokenizer, turns=2, max_new_tokens=6)
    finally:
        hook.remove()


@pytest.mark.slow  # its float64 chunked scan: tens of seconds on a CPU
def test_mamba2_reuses_its_recurrent_state_exactly(tokenizer, tmp_path):
    """Mamba2 takes its cache as cache_params (cache from transformers 5.24),
    and its chunked scan starts from the cached state: from turn 2 on every
    turn reuses at least 90% of a normal conversation's prompt and is exact, a regenerate restores a
    checkpoint, and a saved session continues exactly (float64)."""
    fields = MAMBA2
    model = tiny_from_config("mamba2", torch.float64, fields, tokenizer)
    manager = SessionManager(model, tokenizer)
    assert list(manager.layout.layer_classes) == ["LinearAttentionLayer"] * 2
    # The name its forward declares: cache_params, or cache from transformers 5.24.
    declared = inspect.signature(model.forward).parameters
    assert manager._bridge.cache_argument == ("cache" if "cache" in declared else "cache_params")
    _converse(manager, model, tokenizer, LONGER_SYSTEM, max_new_tokens=8, min_reuse=0.9)
    replies = [m["content"] for m in manager.messages("s") if m["role"] == "assistant"]
    assert len(set(replies)) == len(replies), "the replies must depend on the context"
    # A regenerate goes back to the prompt's end: a checkpoint, since
    # recurrent state cannot crop.
    messages = manager.messages("s")[:-1]
    reply = manager.chat("s", messages, max_new_tokens=8)
    assert reply == reference_turn(model, tokenizer, messages, 8)[0]
    report = manager.last_turn("s")
    assert report.checkpoint_restored is not None and report.reused_tokens > 0, report
    # Its state and checkpoints save and load like any recurrent layer's.
    manager.save("s", tmp_path / "s.safetensors")
    fresh = SessionManager(model, tokenizer)
    fresh.load(tmp_path / "s.safetensors")
    messages = fresh.messages("s") + [user_message(7)]
    assert (
        fresh.chat("s", messages, max_new_tokens=8)
        == reference_turn(model, tokenizer, messages, 8)[0]
    )
    assert fresh.last_turn("s").reused_tokens > 0


def test_mamba2_processors_see_the_whole_prompt(tokenizer):
    """generate gets the whole prompt even where kvchat feeds the model only
    the uncached tail, so a repetition penalty and an n-gram ban, which read
    the prompt's ids, act as in plain generate; the returned ids are the whole
    sequence too. Feeding generate the tail alone failed this (float64)."""
    fields = MAMBA2
    model = tiny_from_config("mamba2", torch.float64, fields, tokenizer)
    manager = SessionManager(model, tokenizer)
    penalties = dict(repetition_penalty=3.0, no_repeat_ngram_size=2, max_new_tokens=12)
    messages = [LONGER_SYSTEM]
    for turn in range(3):
        messages.append(user_message(turn))
        prompt = render_prompt(tokenizer, messages).unsqueeze(0).to(model.device)
        output = manager.generate(prompt, "s", do_sample=False, **penalties)
        assert torch.equal(output, model.generate(prompt, do_sample=False, **penalties)), turn
        reply = tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    assert manager.last_turn("s").reused_tokens > 0


# Models whose Mamba (v1) selective scan over several tokens starts from
# zeros: (dtype, config fields). Jamba puts attention beside those layers and
# is a mixture of experts, so float32.
ZERO_START_SCANS = {
    "mamba": (torch.float64, RECURRENT_ONLY),
    "falcon_mamba": (torch.float64, RECURRENT_ONLY),
    "jamba": (
        torch.float32,
        dict(
            SHAPE,
            **MOE,
            initializer_range=0.2,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=1,
            use_mamba_kernels=False,
        ),
    ),
}


@pytest.mark.parametrize("half", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("model_type", sorted(ZERO_START_SCANS))
def test_a_scan_that_ignores_the_cache_runs_as_plain_generate(model_type, half, tokenizer, caplog):
    """Mamba's, FalconMamba's and Jamba's selective scan over several tokens
    starts from zeros, not from the cached state, so no reuse could be exact:
    a probe finds that, and every turn is plain generate. Before the probe,
    reuse gave a different reply by turn 4 on each of them; on Jamba, whose
    attention layers carry most of a random model's context, only with
    initializer_range=0.2 (Jamba had reused, and passed, at the default).
    The probe's bound follows the precision, so in bfloat16 and float16 too."""
    dtype, fields = ZERO_START_SCANS[model_type]
    dtype = half or dtype
    model = tiny_from_config(model_type, dtype, fields, tokenizer)
    manager = SessionManager(model, tokenizer)
    assert "does not continue the cached state" in caplog.text
    assert_plain_turns(manager, model, tokenizer, turns=4, max_new_tokens=8)


def test_a_dynamically_quantized_model_runs_as_plain_generate_exactly(tokenizer, caplog):
    """``torch.ao.quantization.quantize_dynamic`` (int8 weights, the CPU user's
    way to a faster model) quantizes each forward's activations with a scale
    taken over all its tokens, so a forward over the new tokens alone is not
    the forward over the whole prompt. Reusing such a model answered otherwise
    than plain generate (SmolLM2-135M-Instruct: turns 2 to 5 of 6 differed).
    The probe finds it, and every turn is plain generate."""
    from kvchat.tiny import tiny_model

    model = tiny_model("llama", tokenizer=tokenizer)
    model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    _refused_by_the_probe_and_exact(model, tokenizer, caplog)


def _refused_by_the_probe_and_exact(model, tokenizer, caplog) -> list:
    """The probe refuses ``model`` (with a warning); four turns are then each
    plain generate's reply, reusing nothing. Returns the turns' reports."""
    with caplog.at_level("WARNING", logger="kvchat"):
        manager = SessionManager(model, tokenizer)
    assert not manager.layout.supported
    assert "does not continue the cached state" in caplog.text
    _, reports = exact_turns(manager, "s", [LONGER_SYSTEM], model, tokenizer, 4, max_new_tokens=8)
    for report in reports:
        assert (report.reason, report.reused_tokens) == ("unsupported_layers", 0), report
    return reports
