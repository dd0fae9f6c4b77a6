"""Embedded tiny models and tokenizer for demos and tests.

No model hub is needed: the tokenizer is a small byte-level BPE shipped with
the package (``python -m kvchat.tiny PATH`` trains it anew), and models are built
from configs with random weights and a fixed seed.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import torch

TOKENIZER_FILE = "tiny_tokenizer.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen and many others use it.
# ChatML; with ``tools`` it writes them into the system turn and renders tool
# calls and tool results Hermes-style, as Qwen2.5's template does. Without
# tools or tool messages it writes exactly plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each call, return a JSON object with the name and arguments within "
    "<tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-style: earlier assistant turns lose their <think>...</think> block,
# so history is rewritten between turns.
THINK_DROPPING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3.5 and DeepSeek-R1 write "<think>\n" into the generation prompt and
# never into history, so each next prompt diverges inside the last one's
# generation prompt.
THINK_OPENING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

_CORPUS = """\
You are a helpful assistant. Answer briefly and precisely.
Hello! How are you today? I am fine, thank you for asking.
Can you help me plan a trip to the mountains next weekend?
Sure. Pack warm clothes, water, a map and something to eat.
What is the capital of France? The capital of France is Paris.
Please summarise the conversation so far in two sentences.
Tell me a short story about a robot who learns to paint.
The robot studied colours every morning and painted the sea at night.
How do I sort a list in Python? Use sorted(items) or items.sort().
Explain what a key-value cache does in a transformer model.
It stores the keys and values of earlier tokens so they are not computed again.
Why is the second turn of a chat slower than it should be?
Because the whole conversation is read again unless the cache is kept.
Thank you, that was very useful. Could you give one more example?
Here is another example with numbers: 1, 2, 3, 10, 42, 100, 2024.
<think>The user wants a list, so I should answer with a list.</think>
Write a haiku about autumn leaves falling on a quiet river.
What time is it in Tokyo when it is noon in London?
It is nine in the evening in Tokyo during winter.
"""


def train_tiny_tokenizer(vocab_size: int = 1024):
    """Trains the byte-level BPE shipped as ``tiny_tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer


def tiny_tokenizer(chat_template: str = CHATML_TEMPLATE):
    """The shipped tiny tokenizer as a transformers tokenizer with a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = resources.files("kvchat").joinpath("data", TOKENIZER_FILE).read_text("utf-8")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(text),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def words_only(tokenizer, vocab_size: int | None = None) -> list[int]:
    """Token ids to suppress (``generate(suppress_tokens=...)``) so that a random
    model writes whole words a fresh tokenization gives back, as a trained
    model's replies mostly are. Ids from len(tokenizer) up to ``vocab_size`` (a
    model's larger embedding) are suppressed too."""
    keep = {tokenizer.eos_token_id}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if re.fullmatch(r" [a-zA-Z]+", text):
            if tokenizer(text, add_special_tokens=False)["input_ids"] == [i]:
                keep.add(i)
    return [i for i in range(vocab_size or len(tokenizer)) if i not in keep]


# Shapes per family; "small" is the demo's size, heavy enough that prefill
# time is visible on a CPU.
_SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}
# Families and their transformers model types. Hybrid ones mix layer kinds:
# every other layer is recurrent (conv, DeltaNet or Mamba2), or sliding.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",  # sliding-window attention with a few full layers
    "lfm2": "lfm2",  # short conv + attention
    "qwen3_5": "qwen3_5_text",  # gated DeltaNet + attention
    "bamba": "bamba",  # Mamba2 + attention
    "falcon_h1": "falcon_h1",  # Mamba2 beside attention in every layer
    "nemotron_h": "nemotron_h",  # Mamba2, attention and MLP-only layers (stateless)
    "gemma3n": "gemma3n_text",  # sliding and full attention; the last layers share KV
}
FAMILIES = tuple(MODEL_TYPES)
TINY_SLIDING_WINDOW = 16


def _alternating(layers: int, odd: str, even: str = "full_attention") -> list[str]:
    return [odd if i % 2 == 0 else even for i in range(layers)]


def _family_fields(family: str, shape: dict) -> dict:
    """Config fields a family needs beyond the shared shape."""
    layers, heads = shape["num_hidden_layers"], shape["num_attention_heads"]
    head_dim = shape["hidden_size"] // heads
    mamba = dict(
        mamba_n_heads=heads,
        mamba_d_head=head_dim,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
    )
    if family == "qwen3":
        return dict(head_dim=head_dim)
    if family == "gemma3":
        # Three sliding layers per full one, as Gemma 3 does (it uses five).
        types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(layers)]
        return dict(head_dim=head_dim, sliding_window=TINY_SLIDING_WINDOW, layer_types=types)
    if family == "lfm2":
        return dict(
            layer_types=_alternating(layers, "conv"),
            block_ff_dim=shape["intermediate_size"],
            conv_L_cache=3,
        )
    if family == "qwen3_5":
        return dict(
            head_dim=head_dim,
            layer_types=_alternating(layers, "linear_attention"),
            linear_num_key_heads=max(heads // 2, 1),
            linear_num_value_heads=heads,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
        )
    if family == "bamba":
        return dict(mamba, attn_layer_indices=list(range(1, layers, 2)), mamba_expand=1)
    if family == "falcon_h1":
        return dict(mamba, head_dim=head_dim, mamba_d_ssm=heads * head_dim)
    if family == "gemma3n":
        # Its last two layers read earlier layers' keys and values: DummyLayers.
        return dict(
            head_dim=head_dim,
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=[
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)
            ],
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.0] * layers,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=shape["vocab_size"],
            altup_num_inputs=2,
            laurel_rank=8,
        )
    if family == "nemotron_h":
        # Its own names for the Mamba2 fields; the cache holds a DummyLayer per MLP layer.
        kinds = ("mamba", "attention", "mlp")
        return dict(
            layers_block_type=[kinds[i % 3] for i in range(layers)],
            head_dim=head_dim,
            ssm_state_size=8,
            mamba_num_heads=heads,
            mamba_head_dim=head_dim,
            n_groups=1,
            chunk_size=16,
            use_mamba_kernels=False,
        )
    return {}


def tiny_config(family: str = "llama", size: str = "tiny", tokenizer=None, **overrides):
    """A transformers config for a tiny random model of ``family``."""
    from transformers import AutoConfig

    if family not in MODEL_TYPES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in _SIZES:
        raise ValueError(f"size must be one of {tuple(_SIZES)}, got {size!r}")
    tokenizer = tokenizer or tiny_tokenizer()
    shape = dict(_SIZES[size])
    if family not in ("llama", "qwen2", "qwen3"):
        # Room for both layer kinds, twice (three kinds: twice each).
        shape["num_hidden_layers"] = max(shape["num_hidden_layers"], 4)
    if family in ("nemotron_h", "gemma3n"):
        shape["num_hidden_layers"] = max(shape["num_hidden_layers"], 6)
    shape["vocab_size"] = len(tokenizer)
    fields = dict(
        shape,
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    fields.update(_family_fields(family, shape))
    fields.update(overrides)
    return AutoConfig.for_model(MODEL_TYPES[family], **fields)


def tiny_model(
    family: str = "llama",
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer=None,
    **overrides,
):
    """A tiny causal LM with random weights drawn from ``seed``, in eval mode."""
    from transformers import AutoModelForCausalLM

    from .quiet_imports import import_model_classes

    import_model_classes()  # without torchao's import-time warnings

    config = tiny_config(family, size, tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def write_tokenizer(path: str | Path) -> Path:
    """Trains the tiny tokenizer anew and writes it to ``path`` (the file the
    package ships is ``python/kvchat/data/tiny_tokenizer.json`` in a checkout)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(train_tiny_tokenizer().to_str())
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), "utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvchat.tiny",
        description="Train the embedded tiny tokenizer anew and write it to PATH (never into "
        "the installed package; to regenerate the shipped one, give "
        f"python/kvchat/data/{TOKENIZER_FILE} in a checkout).",
    )
    parser.add_argument(
        "path",
        nargs="?",
        default=TOKENIZER_FILE,
        help=f"where to write it (default: ./{TOKENIZER_FILE})",
    )
    args = parser.parse_args(argv)
    print(f"wrote {write_tokenizer(args.path)}")


if __name__ == "__main__":
    main()
