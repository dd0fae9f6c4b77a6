"""Prompts that begin alike, prefilled together as one sequence with their
common head once (engine/one_sequence.py), in float64: every reply is still
its own plain ``generate``'s, token for token, and the head's tokens are run
once, not once per prompt."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.engine.one_sequence import takes_4d_mask
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together, wait_for
from test_engine_prompts import LONG_SYSTEM, reply_and_next
from test_engine_prompts_attack import FailOnce
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# Short enough that rows prefill it beside each other (under min_shared_tokens,
# 32), rather than one computing it and the others copying it.
SHORT_SYSTEM = {"role": "system", "content": "Be brief."}
# An attention implementation that one_sequence.py does not know to take a 4D mask.
OTHER_ATTENTION = "kvchat_test_other_attention"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _conversations(n: int) -> list[list[dict]]:
    """``n`` new conversations: one short system prompt, user messages of
    different lengths (so tails differ in length too)."""
    return [[SHORT_SYSTEM, user_message(3 * k + k % 2)] for k in range(n)]


def _head(tokenizer, conversations) -> int:
    """The tokens every conversation's prompt begins with (never a whole prompt)."""
    prompts = [render_prompt(tokenizer, c).tolist() for c in conversations]
    head = 0
    while all(head < len(p) - 1 and p[head] == prompts[0][head] for p in prompts):
        head += 1
    return head


def _three_first_turns(model, tokenizer):
    """Three new conversations (``_conversations``) started together on a
    new manager: each reply is plain generate's. Returns the manager's
    stats and the conversations."""
    manager = SessionManager(model, tokenizer)
    conversations = _conversations(3)
    reports = together(
        manager, [chat_call(manager, f"s{k}", c, 6) for k, c in enumerate(conversations)]
    )
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversations[k], 6)[2], k
    stats = manager.stats()
    manager.close()
    return stats, conversations


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_new_conversations_run_their_common_head_once(family, n, tokenizer):
    """``n`` new conversations start together with one short system prompt:
    one forward runs its tokens once and each tail after it; every reply is
    plain generate's. Their next turns (pasts of different lengths, no
    head in common) prefill side by side, exactly too."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = _conversations(n)
    head = _head(tokenizer, conversations)
    assert 4 < head < 32, head
    budgets = [5 + 2 * k for k in range(n)]  # they leave one by one
    for turn in range(2):
        reports = together(
            manager,
            [chat_call(manager, f"s{k}", conversations[k], budgets[k]) for k in range(n)],
        )
        for k, report in enumerate(reports):
            expected = reference_turn(model, tokenizer, conversations[k], budgets[k])[2]
            assert report.output_ids == expected, (turn, k)
            conversations[k] = reply_and_next(tokenizer, conversations[k], expected)
        stats = manager.stats()
        assert stats.prompts_prefilled_together == n * (turn + 1), stats
        assert stats.prefill_chunks == turn + 1, stats  # one forward per turn
        assert stats.head_tokens_run_once == (n - 1) * head, stats  # the first turn's only
    manager.close()


def test_eager_attention_takes_the_additive_mask(tokenizer):
    """The same, on a model whose attention is transformers' eager one,
    which adds the mask to its scores (SDPA also takes a boolean)."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    model.set_attn_implementation("eager")
    assert takes_4d_mask(model)
    stats, conversations = _three_first_turns(model, tokenizer)
    assert stats.head_tokens_run_once == 2 * _head(tokenizer, conversations), stats


def test_rows_that_hold_one_shared_prefix_run_the_rest_of_their_head_once(tokenizer):
    """Two new sessions start from the prefix a finished session holds (the
    core's sharing: a long system prompt) and go on alike past it: the
    forward's past is that prefix, their further common tokens run once,
    and both replies are plain generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    manager.chat("first", [LONG_SYSTEM, user_message(0)], max_new_tokens=4, settle=False)
    alike = "Please tell me, in a few words, all you know about"
    conversations = [
        [LONG_SYSTEM, {"role": "user", "content": f"{alike} {topic}."}]
        for topic in ("rivers", "mountains and their glaciers")
    ]
    reports = together(
        manager, [chat_call(manager, f"s{k}", c, 6) for k, c in enumerate(conversations)]
    )
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversations[k], 6)[2], k
        assert report.reused_tokens > 40, report  # started from the shared prefix
    assert reports[0].reused_tokens == reports[1].reused_tokens
    prompts = [render_prompt(tokenizer, c).tolist() for c in conversations]
    common = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    stats = manager.stats()
    assert stats.head_tokens_run_once == common - reports[0].reused_tokens > 5, stats
    manager.close()


def test_a_head_forward_that_fails_fails_its_turns_and_nothing_else(tokenizer):
    """Three new conversations with one head, in one forward that raises:
    each turn fails with that error and holds no cache, an idle session is
    untouched, and each next turn is exact."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    failing = FailOnce(model)
    manager = SessionManager(model, tokenizer)
    manager.chat("idle", [SHORT_SYSTEM, user_message(9)], max_new_tokens=4, settle=False)
    idle = manager.info("idle")
    conversations = _conversations(3)
    failing.armed = True
    errors = []

    def failure(call):
        def run():
            try:
                call()
            except RuntimeError as error:
                errors.append(str(error))

        return run

    together(
        manager, [failure(chat_call(manager, f"s{k}", c, 5)) for k, c in enumerate(conversations)]
    )
    assert errors == ["the grouped forward failed"] * 3
    assert failing.failed_mask_ndim == 4  # the one sequence's forward failed
    assert not failing.armed and manager.stats().head_tokens_run_once == 0
    assert manager.info("idle") == idle
    for k, messages in enumerate(conversations):
        assert manager.info(f"s{k}").cached_tokens == 0
        manager.chat(f"s{k}", messages, max_new_tokens=5, settle=False)
        assert (
            manager.last_turn(f"s{k}").output_ids
            == reference_turn(model, tokenizer, messages, 5)[2]
        )
    manager.close()


def test_every_first_token_goes_out_before_any_row_joins_the_batch(tokenizer):
    """Prompts prefilled in one forward each pick their first token, and
    only then join the decode batch (a join copies the row's cache): no
    first token waits for another row's join. Before, the last row's token
    came after every other row's join."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    loop = manager._engine._loop
    rows_at_first_token = {}
    lock = threading.Lock()

    class Seen:
        def __init__(self, name):
            self.name, self.tokens = name, 0

        def put(self, value):
            self.tokens += 1
            if self.tokens == 2:  # the prompt, then the first token
                with lock:
                    rows_at_first_token[self.name] = len(loop.batch.rows)

        def end(self):
            pass

    conversations = _conversations(3)

    def call(k):
        prompt = render_prompt(tokenizer, conversations[k])[None]
        return lambda: manager.generate(
            prompt, session_id=f"s{k}", max_new_tokens=4, streamer=Seen(k)
        )

    together(manager, [call(k) for k in range(3)])
    assert rows_at_first_token == {0: 0, 1: 0, 2: 0}
    assert manager.stats().prompts_prefilled_together == 3
    for k in range(3):
        expected = reference_turn(model, tokenizer, conversations[k], 4)[2]
        assert manager.last_turn(f"s{k}").output_ids == expected
    wait_for(lambda: not loop.batch.rows, "the batch empty")
    manager.close()


def test_only_attention_that_takes_a_4d_mask_runs_prompts_as_one(tokenizer):
    """FlashAttention's and flex attention's kernels read no 4D mask: a model
    using them keeps the padded side-by-side forward. Here an attention
    registered under another name (SDPA's kernel, so it runs on a CPU)
    stands for them: prompts that begin alike still prefill in one forward,
    side by side, exactly, and no head runs once."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    for name, takes in (
        ("sdpa", True),
        ("eager", True),
        ("flash_attention_2", False),
        ("flex_attention", False),
    ):
        model.config._attn_implementation = name
        assert takes_4d_mask(model) == takes, name
    AttentionInterface.register(OTHER_ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(OTHER_ATTENTION, sdpa_mask)
    model.set_attn_implementation(OTHER_ATTENTION)
    assert not takes_4d_mask(model)
    stats, _ = _three_first_turns(model, tokenizer)
    assert stats.prompts_prefilled_together == 3 and stats.prefill_chunks == 1, stats
    assert stats.head_tokens_run_once == 0, stats
