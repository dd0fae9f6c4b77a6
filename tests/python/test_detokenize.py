"""IncrementalText: each token's text as soon as it is final, and the pieces
joined are exactly the whole decode, on the embedded tokenizer and on real
vocabularies (byte-level BPE, and SentencePiece with byte fallback)."""

from __future__ import annotations

import functools
import random

import pytest
from kvchat.detokenize import IncrementalText
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch

TEXT = (
    "Héllo wörld! 你好，世界 🌍🚀 `code_with_a_long_identifier(x)` "
    'https://example.com/a?b=c {"city": "Paris"}\n\n    indented\ttab'
)


@functools.cache
def _tokenizer(name: str):
    if name == "tiny":
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fetch(), gguf_file=f"ggml-vocab-{name}.gguf")


class _DecodeOnly:
    """A tokenizer with no streaming decoder behind it: only ``decode``."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def _sequences(tokenizer) -> list[list[int]]:
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    rng = random.Random(0)
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(300)]  # as a random model writes
    specials = [i for i in tokenizer.all_special_ids if i is not None]
    with_specials = ids[:7] + specials + ids[7:]
    return [ids, random_ids, with_specials]


def _pieces(text: IncrementalText, ids: list[int]) -> list[str]:
    return [text.push(i) for i in ids] + [text.finish()]


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "window"])
@pytest.mark.parametrize("name", ["tiny", "qwen2", "llama-bpe", "gpt-2", "phi-3"])
def test_pieces_join_to_the_whole_decode(name, fast):
    tokenizer = _tokenizer(name)
    for ids in _sequences(tokenizer):
        text = IncrementalText(tokenizer if fast else _DecodeOnly(tokenizer))
        pieces = _pieces(text, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "window"])
@pytest.mark.parametrize("name", ["tiny", "qwen2", "phi-3"])
def test_text_is_released_once_its_characters_are_whole(name, fast):
    # After each token, everything whose bytes are complete has been released:
    # the text so far equals the whole decode of the ids so far, minus at most
    # an incomplete character at its end (never a whole word held back).
    tokenizer = _tokenizer(name)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    text = IncrementalText(tokenizer if fast else _DecodeOnly(tokenizer))
    released = ""
    for k, token in enumerate(ids, start=1):
        released += text.push(token)
        whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert whole.startswith(released)
        assert "\ufffd" in whole[len(released) :] or len(whole) - len(released) <= 1, (
            k,
            whole[len(released) :],
        )
