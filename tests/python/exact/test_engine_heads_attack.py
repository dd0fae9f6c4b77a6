"""Attacks on prompts that begin alike prefilled as one sequence
(engine/one_sequence.py), in float64 against plain ``generate``."""

from __future__ import annotations

import pytest
import torch
from families import tiny_from_config
from helpers import model_for, reference_turn
from kvchat import SessionManager
from kvchat.engine.one_sequence import takes_4d_mask
from kvchat.tiny import tiny_tokenizer
from test_engine import chat_call, together
from test_engine_heads import _conversations, _head, _three_first_turns


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize(
    "options, sessions, shared",
    [
        (dict(isolate_namespaces=True), ["a/x", "b/x", "c/x"], False),
        (dict(share_prefixes=False), ["x", "y", "z"], False),
        (dict(isolate_namespaces=True), ["a/x", "a/y", "a/z"], True),
    ],
    ids=["other-namespaces", "sharing-off", "one-namespace"],
)
def test_a_head_runs_once_only_for_rows_that_may_share_a_prefix(
    options, sessions, shared, tokenizer
):
    """New conversations of different tenants (API keys: namespaces, with
    ``isolate_namespaces``), or any with ``share_prefixes=False``, that start
    together with one system prompt never run it once for all: one row's
    head (and past) would be another tenant's, and its first token's time
    would tell it what another tenant sent. They prefill side by side, each
    its own tokens; rows of one namespace still run the head once. Every
    reply is plain generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, **options)
    conversations = _conversations(3)
    reports = together(
        manager, [chat_call(manager, s, c, 5) for s, c in zip(sessions, conversations, strict=True)]
    )
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversations[k], 5)[2], k
    stats = manager.stats()
    assert stats.prompts_prefilled_together == 3, stats
    expected = 2 * _head(tokenizer, conversations) if shared else 0
    assert stats.head_tokens_run_once == expected, stats
    manager.close()


def test_alibi_attention_keeps_prompts_side_by_side(tokenizer):
    """Falcon with ALiBi (falcon-rw) builds its position biases from a 2D
    padding mask, and raised on the 4D one (every turn of a group failed):
    its new conversations that begin alike prefill side by side, each reply
    plain generate's."""
    fields = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True, bias=True)
    model = tiny_from_config("falcon", torch.float64, fields, tokenizer)
    assert not takes_4d_mask(model)
    stats, _ = _three_first_turns(model, tokenizer)
    assert stats.prompts_prefilled_together == 3 and stats.head_tokens_run_once == 0, stats


class FirstScores:
    """A logits processor that keeps the first scores it is given."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = scores.clone()
        return scores


def test_local_attention_by_index_keeps_prompts_side_by_side(tokenizer):
    """GPT-Neo's local layers mask keys past a window of indices themselves,
    on top of the mask given: in one sequence a tail's index is past the
    other rows' tails, not its position, so its first layer hid the head
    from a tail's first tokens, and every later key and logit moved. Its
    prompts prefill side by side: each row's first scores are
    plain generate's, and its reply."""
    fields = dict(
        hidden_size=64,
        num_heads=4,
        num_layers=2,
        attention_types=[[["local", "global"], 1]],
        window_size=4,
        max_position_embeddings=1024,
    )
    model = tiny_from_config("gpt_neo", torch.float64, fields, tokenizer)
    assert not takes_4d_mask(model)
    manager = SessionManager(model, tokenizer)
    conversations = _conversations(3)
    seen = [FirstScores() for _ in conversations]
    reports = together(
        manager,
        [
            chat_call(manager, f"s{k}", c, 5, logits_processor=[seen[k]])
            for k, c in enumerate(conversations)
        ],
    )
    for k, report in enumerate(reports):
        plain = FirstScores()
        expected = reference_turn(model, tokenizer, conversations[k], 5, logits_processor=[plain])
        assert report.output_ids == expected[2], k
        torch.testing.assert_close(seen[k].first, plain.first, rtol=0, atol=1e-6)
    stats = manager.stats()
    assert stats.prompts_prefilled_together == 3 and stats.head_tokens_run_once == 0, stats
    manager.close()
