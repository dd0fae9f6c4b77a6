"""The engine's cheap minimum-length processors (engine/processors.py) give
transformers' own scores, bit for bit, below, at and past the minimum, and
are the ones an engine turn runs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import reference_ids, user_message
from kvchat import SessionManager
from kvchat.engine.processors import for_row
from kvchat.prompting import render_prompt
from transformers import LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)

VOCAB = 97
# One end token twice, one past the vocabulary (isin ignores it), one at its end.
EOS = [3, 3, VOCAB + 5, VOCAB - 1]


def _processors():
    return [
        MinLengthLogitsProcessor(9, EOS),
        MinNewTokensLengthLogitsProcessor(
            prompt_length_to_skip=4, min_new_tokens=6, eos_token_id=EOS
        ),
        MinNewTokensLengthLogitsProcessor(
            prompt_length_to_skip=4, min_new_tokens=0, eos_token_id=3
        ),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 5, 8, 9, 10, 30])
def test_the_cheap_processors_give_transformers_scores(dtype, length):
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (1, length), generator=generator)
    scores = torch.randn(1, VOCAB, generator=generator).to(dtype)
    for original in _processors():
        (cheap,) = for_row(LogitsProcessorList([original]))
        assert type(cheap) is not type(original)
        want, got = original(ids, scores), cheap(ids, scores)
        assert got.dtype == want.dtype and torch.equal(got, want), (type(original), length)
        # Twice: the mask built on the first call is the one reused.
        assert torch.equal(cheap(ids, scores), want)
    blocked = _processors()[0](ids, scores)[0, 3] == -math.inf
    assert bool(blocked) == (length < 9)


def test_for_row_keeps_everything_else_and_leaves_generates_list_alone():
    class Mine(MinLengthLogitsProcessor):  # a subclass may compute otherwise
        pass

    warper, mine = TemperatureLogitsWarper(0.5), Mine(3, EOS)
    given = LogitsProcessorList([warper, MinLengthLogitsProcessor(3, EOS), mine])
    row = for_row(given)
    assert row is not given and row[0] is warper and row[2] is mine
    assert type(row[1]) is not MinLengthLogitsProcessor
    assert type(given[1]) is MinLengthLogitsProcessor
    plain = LogitsProcessorList([warper])
    assert for_row(plain) is plain and for_row(None) is None


def test_an_engine_turn_with_a_minimum_length_never_calls_transformers_processors(
    llama, tokenizer, monkeypatch
):
    """generate builds both processors for ``min_new_tokens``; the engine's
    row runs the cheap ones instead, and the reply is plain generate's."""
    called = []

    def spy(original):  # input_ids and scores only: LogitsProcessorList reads the signature
        def call(self, input_ids, scores):
            called.append(type(self).__name__)
            return original(self, input_ids, scores)

        return call

    for cls in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor):
        monkeypatch.setattr(cls, "__call__", spy(cls.__call__))
    manager = SessionManager(llama, tokenizer)
    messages = [user_message(0)]
    manager.chat("s", messages, max_new_tokens=8, min_new_tokens=8)
    report = manager.last_turn("s")
    assert manager.stats().decode_steps > 0 and called == []
    want = reference_ids(llama, render_prompt(tokenizer, messages), 8, min_new_tokens=8)
    assert "MinNewTokensLengthLogitsProcessor" in called  # the spy sees plain generate's
    assert tuple(report.output_ids) == want
    manager.close()
