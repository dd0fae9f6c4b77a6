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

pytestmark = pytest.mark.slow

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


def _sequences(tokenizer) -> list[list[int]]:
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    rng = random.Random(0)
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(300)]  # as a random model writes
    specials = [i for i in tokenizer.all_special_ids if i is not None]
    with_specials = ids[:7] + specials + ids[7:]
    return [ids, random_ids, with_specials]


@pytest.mark.parametrize("name", ["tiny", "qwen2", "llama-bpe", "gpt-2", "phi-3"])
def test_pieces_join_to_the_whole_decode(name):
    tokenizer = _tokenizer(name)
    for ids in _sequences(tokenizer):
        text = IncrementalText(tokenizer)
        pieces = [text.push(i) for i in ids] + [text.finish()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny", "qwen2", "llama-bpe", "gpt-2", "phi-3"])
def test_only_an_incomplete_character_is_held_back(name):
    # After every token, all that is not released is at most 3 characters of
    # U+FFFD (bytes that may yet form a character): never a word waiting for a
    # space, and never the rest of a reply of invalid bytes, as a random model
    # writes (the random sequence) and as the streamer once held until the end.
    tokenizer = _tokenizer(name)
    for ids in _sequences(tokenizer):
        text = IncrementalText(tokenizer)
        released = ""
        for k, token in enumerate(ids, start=1):
            released += text.push(token)
            whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
            assert whole.startswith(released), k
            held = whole[len(released) :]
            assert len(held) <= 3 and set(held) <= {"\ufffd"}, (k, held)
