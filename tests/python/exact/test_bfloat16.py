"""What bfloat16 and float16 can promise, on the test device (KVCHAT_TEST_DEVICE).

Reuse changes the shapes of the matrix products (a turn prefills only its new
tokens, against a cache), so a cached turn's logits differ from plain
generate's by rounding. float64 makes that difference far too small to flip a
greedy token, which is why the exactness tests run in float64. bfloat16 keeps
8 bits of mantissa: its rounding moves logits by about 1e-2, enough to flip a
near-tie, after which the two continuations differ. What bfloat16 can promise:

- a turn with nothing to reuse runs the same computation as plain generate,
  so its reply is the same, token for token;
- a later turn's first token is plain generate's wherever plain generate's
  best token leads the runner-up by more than that rounding (``MARGIN``).

Every hybrid family reuses in these dtypes too: the construction probe must
tell their rounding from a lost state (it refused FalconH1 and NemotronH in
bfloat16, and FalconH1 in float16, on an AVX2 CPU). float32 runs beside them.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, MAMBA2, SHAPE, tiny_from_config
from helpers import (
    DEVICE,
    LONG_SYSTEM,
    MARGIN,
    MAX_NEW,
    check_low_precision_replies,
    plain_with_margin,
    user_message,
)
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model
from test_engine import together

pytestmark = pytest.mark.slow

TURNS = 6


# Every hybrid family kvchat supports, and two attention-only ones.
TINY_FAMILIES = ["llama", "gemma3", "lfm2", "qwen3_5", "bamba", "falcon_h1", "nemotron_h"]
FIXTURE_FAMILIES = ["zamba2", "granitemoehybrid", "mamba2"]  # built as test_families does
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _build(family, dtype, tokenizer):
    if family in TINY_FAMILIES:
        return tiny_model(family, dtype=dtype, seed=0).to(DEVICE)
    if family == "mamba2":
        fields = MAMBA2
        return tiny_from_config("mamba2", dtype, fields, tokenizer)
    model_type, _, fields, _ = FAMILIES[family]
    return tiny_from_config(model_type, dtype, dict(SHAPE, **fields), tokenizer)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("family", TINY_FAMILIES + FIXTURE_FAMILIES)
def test_bfloat16_turns_keep_plain_generates_clear_first_tokens(family, dtype, tokenizer):
    model = _build(family, dtype, tokenizer)
    manager = SessionManager(model, tokenizer)
    assert manager.layout.supported, f"{family} in {dtype} runs as plain generate"
    messages, checked = [LONG_SYSTEM], 0
    for turn in range(TURNS):
        messages.append(user_message(turn))
        expected, margin = plain_with_margin(model, render_prompt(tokenizer, messages))
        manager.chat("s", messages, max_new_tokens=MAX_NEW)
        report = manager.last_turn("s")
        if turn == 0:
            assert report.reused_tokens == 0 and report.output_ids == expected
        else:
            assert report.reused_tokens > 0, report
            if margin > MARGIN:
                assert report.output_ids[0] == expected[0], (turn, margin)
                checked += 1
        # Both go on from plain generate's reply, so every prompt is the same.
        reply = tokenizer.decode(expected, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    assert checked >= TURNS // 2, f"only {checked} turns had a clear first token"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_half_precision_promises_hold_for_rows_decoding_together(family, dtype, tokenizer):
    """The same promises with three conversations decoding in one batch (the
    engine): a first turn is plain generate's reply, and every later turn's
    first token is plain generate's where its best token leads clearly."""
    model = _build(family, dtype, tokenizer)
    manager = SessionManager(model, tokenizer)
    sessions = [[LONG_SYSTEM] + [user_message(10 * k + j) for j in range(k)] for k in range(3)]
    checked = 0
    for turn in range(3):
        expected = {}
        for k, messages in enumerate(sessions):
            messages.append(user_message(turn))
            expected[k] = plain_with_margin(model, render_prompt(tokenizer, messages))
        reports = _turns_together(manager, sessions)
        checked += check_low_precision_replies(reports.items(), expected, turn, sessions, tokenizer)
    stats = manager.stats()
    assert stats.max_batch_rows == 3
    if family == "llama":  # full attention: prompts share forwards and prefixes too
        assert stats.prompts_prefilled_together > 0 and stats.prefix_tokens_copied > 0, stats
    assert checked >= 3, f"only {checked} later turns had a clear first token"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_half_precision_promises_hold_for_prompts_run_as_one_sequence(family, dtype, tokenizer):
    """The same promises where new conversations start together with one short
    system prompt, so their first turns prefill as one sequence, its head once
    (engine/one_sequence.py), and their later turns side by side over caches
    of different lengths."""
    model = tiny_model(family, dtype=dtype, seed=0).to(DEVICE)
    manager = SessionManager(model, tokenizer)
    system = {"role": "system", "content": "Be brief."}
    sessions = [[system] for _ in range(3)]
    checked = 0
    for turn in range(4):
        expected = {}
        for k, messages in enumerate(sessions):
            messages.append(user_message(3 * k + turn))
            expected[k] = plain_with_margin(model, render_prompt(tokenizer, messages))
        reports = _turns_together(manager, sessions)
        checked += check_low_precision_replies(reports.items(), expected, turn, sessions, tokenizer)
    stats = manager.stats()
    assert stats.head_tokens_run_once > 0 and stats.prompts_prefilled_together >= 9, stats
    assert checked >= 3, f"only {checked} later turns had a clear first token"
    manager.close()


def _turns_together(manager, sessions) -> dict:
    """One turn of each session, their rows starting together (test_engine's
    ``together``, which re-raises a turn's error: a thread of its own here
    once lost one, and the test then checked only the turns that ended);
    each session's report by index."""

    def call(k):
        def turn():
            manager.chat(f"s{k}", sessions[k], max_new_tokens=MAX_NEW)
            return manager.last_turn(f"s{k}")

        return turn

    return dict(enumerate(together(manager, [call(k) for k in range(len(sessions))])))
