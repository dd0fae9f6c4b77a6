"""Tiny random configs of more families than kvchat's own tiny models, and
the function that builds them: fixtures of test_families.py and
test_bfloat16.py (not kvchat's tiny families)."""

from __future__ import annotations

import torch
from helpers import DEVICE
from transformers import AutoConfig, AutoModelForCausalLM

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    bos_token_id=None,
    tie_word_embeddings=False,
)
MOE = dict(num_experts_per_tok=1)
# family: (model type, dtype, config fields, the cache layer classes it builds)
FAMILIES = {
    "mistral-sliding": (
        "mistral",
        torch.float64,
        dict(num_hidden_layers=2, sliding_window=16),
        ["DynamicSlidingWindowLayer"] * 2,
    ),
    "olmo3": (
        "olmo3",
        torch.float64,
        dict(
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
        ["DynamicSlidingWindowLayer"] * 3 + ["DynamicLayer"],
    ),
    "granitemoehybrid": (
        "granitemoehybrid",
        torch.float32,
        dict(
            MOE,
            num_hidden_layers=4,
            layer_types=["mamba", "attention"] * 2,
            num_local_experts=2,
            shared_intermediate_size=128,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            mamba_expand=1,
        ),
        ["LinearAttentionLayer", "DynamicLayer"] * 2,
    ),
    "gpt-oss": (
        "gpt_oss",
        torch.float32,
        dict(
            MOE,
            num_hidden_layers=2,
            sliding_window=16,
            num_local_experts=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
        ["DynamicSlidingWindowLayer", "DynamicLayer"],
    ),
    # Mamba2 layers, and hybrid layers where a shared attention block sits
    # beside Mamba2: LinearAttentionLayer and LinearAttentionAndFullAttentionLayer.
    "zamba2": (
        "zamba2",
        torch.float64,
        dict(
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid"] * 2,
            hybrid_layer_ids=[1, 3],
            attention_head_dim=16,
            mamba_d_state=8,
            mamba_headdim=16,
            n_mamba_heads=8,
            mamba_ngroups=1,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            use_mem_rope=True,
        ),
        ["LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer"] * 2,
    ),
}

# Conv windows beside attention, as kvchat's tiny lfm2 (helpers.WINDOW_FAMILIES):
# every state that cannot crop is a conv window, so checkpoints come off the
# prefill's forward (bridge/windows.py). model type: config fields.
CONV_WINDOWS = {
    "lfm2_moe": dict(
        SHAPE,
        **MOE,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3,
        num_experts=2,
        moe_intermediate_size=64,
        num_dense_layers=1,
        # The grouped kernel takes no float64.
        experts_implementation="eager",
    ),
    "lfm3": dict(
        SHAPE, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3
    ),
}

# Caches of recurrent layers alone, which cannot count their tokens: kvchat
# does, and cuts generate's first forward to the tokens the cache lacks.
# initializer_range 0.2, so these random models' replies depend on context.
RECURRENT_ONLY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    state_size=16,
    expand=2,
    conv_kernel=4,
    initializer_range=0.2,
    bos_token_id=None,
)
MAMBA2 = dict(RECURRENT_ONLY, head_dim=16, num_heads=8, n_groups=1, chunk_size=16)


def tiny_from_config(model_type, dtype, fields, tokenizer):
    """A random model of ``model_type`` from ``fields``, seeded, on the test device."""
    config = AutoConfig.for_model(
        model_type,
        **fields,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).to(dtype).to(DEVICE).eval()
