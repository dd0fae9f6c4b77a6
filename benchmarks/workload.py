"""Models and seeded synthetic conversations for the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from kvchat.tiny import tiny_model, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# Random-weight presets shaped like public checkpoints (no hub needed).
PRESETS = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        # 8192 in the real model; 32k here, for the decode benchmark's longest context
        # (the default RoPE computes angles per position, so nothing else changes).
        max_position_embeddings=32768,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # The hybrid preset: LFM2-350M's shape, 10 short-conv and 6 attention layers.
    "lfm2-350m": dict(
        model_type="lfm2",
        hidden_size=1024,
        intermediate_size=6656,
        block_ff_dim=6656,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=65536,
        max_position_embeddings=32768,
        conv_L_cache=3,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    ),
    # Qwen3.5-0.8B's shape: three gated-DeltaNet layers to one gated attention layer.
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
    ),
    # Falcon-H1-0.5B's shape: Mamba2 and attention side by side in all 36 layers.
    "falcon-h1-0.5b": dict(
        model_type="falcon_h1",
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=36,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        mamba_d_ssm=1536,
        mamba_n_heads=24,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=128,
        vocab_size=32784,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    ),
    # Mamba2-130M's shape: 24 Mamba2 layers and nothing else, so the cache
    # cannot count its tokens and kvchat feeds generate only the new ones.
    "mamba2-130m": dict(
        model_type="mamba2",
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        expand=2,
        head_dim=64,
        num_heads=24,
        n_groups=1,
        conv_kernel=4,
        chunk_size=256,
        vocab_size=50288,
        tie_word_embeddings=True,
    ),
}
TINY = "tiny"

_WORDS = (
    "the a trip museum city river train ticket price hotel morning evening weather rain "
    "sun map plan day week walk visit open closed garden bridge market coffee lunch dinner "
    "station airport bus pass guide tour history art painting old new small large quiet "
    "busy famous local street square church tower park view night light water boat island"
).split()


def load_model(name: str, dtype: torch.dtype, device: str, seed: int = 0):
    """(model, tokenizer) for the tiny default, a preset, or a local checkpoint path."""
    if name == TINY:
        tokenizer = tiny_tokenizer()
        model = tiny_model("llama", "small", dtype=dtype, seed=seed, tokenizer=tokenizer)
    elif name in PRESETS:
        tokenizer = tiny_tokenizer()
        fields = dict(PRESETS[name])
        config = AutoConfig.for_model(
            fields.pop("model_type"),
            **fields,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    elif Path(name).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name)
    else:
        raise ValueError(
            f"--model must be {TINY!r}, one of {sorted(PRESETS)}, or a local directory; "
            f"got {name!r}"
        )
    return model.to(device=device, dtype=dtype).eval(), tokenizer


@dataclass
class Conversation:
    system: str
    user_turns: list[str]
    reply_tokens: list[int]  # how many tokens each reply generates


def _text_of(tokenizer, rng: random.Random, tokens: int) -> str:
    words = []
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words.extend(rng.choice(_WORDS) for _ in range(8))
    return " ".join(words).capitalize() + "."


def make_conversation(
    tokenizer,
    seed: int,
    turns: int,
    system_tokens: tuple[int, int] = (300, 1000),
    user_tokens: tuple[int, int] = (20, 200),
    reply_tokens: tuple[int, int] = (50, 300),
) -> Conversation:
    """A seeded conversation with the shapes real chats have."""
    rng = random.Random(seed)
    return Conversation(
        system=_text_of(tokenizer, rng, rng.randint(*system_tokens)),
        user_turns=[_text_of(tokenizer, rng, rng.randint(*user_tokens)) for _ in range(turns)],
        reply_tokens=[rng.randint(*reply_tokens) for _ in range(turns)],
    )
