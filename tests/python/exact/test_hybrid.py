"""Reuse on every layer mix: attention, sliding window, conv, DeltaNet and Mamba2.

Each test compares kvchat, turn by turn, with plain ``model.generate`` on the
full conversation (float64, greedy), and asserts how much was reused and why.
Tests of how a turn matches a cache that departs from its prompt (a reply
that re-tokenizes otherwise, a template that rewrites history, a regenerate)
turn settling off: settling would bring the session to the next prompt
between the turns (test_settling.py), and they test the turn's own fallback.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CHECKPOINT_FAMILIES,
    LONG_SYSTEM,
    MAX_NEW,
    SYSTEM,
    WINDOW_FAMILIES,
    assert_plain_turns,
    exact_turn,
    exact_turns,
    model_for,
    reference_ids,
    user_message,
)
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import (
    THINK_DROPPING_TEMPLATE,
    THINK_OPENING_TEMPLATE,
    tiny_model,
    tiny_tokenizer,
    words_only,
)

pytestmark = pytest.mark.slow


def checked_turns(mgr, model, tokenizer, system, turns):
    """Runs ``turns`` checked turns; returns the conversation and the last report."""
    messages, reports = exact_turns(mgr, "s", [system], model, tokenizer, turns)
    return messages, reports[-1]


def test_eight_turns_identical_when_replies_retokenize_differently(any_family, tokenizer):
    """A random model's replies rarely survive decode + re-tokenize, so the next
    prompt diverges inside the last reply: layers that cannot crop come back
    from the checkpoint at the previous prompt's last token."""
    family, model = any_family
    mgr = SessionManager(model, tokenizer, settle=False)
    messages, previous_prompt, diverged = [SYSTEM], None, 0
    for turn in range(8):
        messages.append(user_message(turn))
        reply, t = exact_turn(mgr, "s", messages, model, tokenizer)
        if previous_prompt is not None:
            # Everything up to the previous reply is reused, whatever the reply.
            assert t.reused_tokens >= previous_prompt - 1, (turn, t)
            if t.reason == "diverged":
                diverged += 1
                if family in CHECKPOINT_FAMILIES:
                    assert t.checkpoint_restored == t.reused_tokens, (turn, t)
        previous_prompt = t.prompt_tokens
        messages.append({"role": "assistant", "content": reply})
    assert diverged > 0, "no reply re-tokenized differently; the case was not exercised"


def test_normal_conversation_reuses_at_least_90_percent(any_family, tokenizer):
    family, model = any_family
    mgr = SessionManager(model, tokenizer)
    suppress = words_only(tokenizer)
    messages = [LONG_SYSTEM]
    for turn in range(8):
        messages.append(user_message(turn))
        reply, t = exact_turn(mgr, "s", messages, model, tokenizer, suppress_tokens=suppress)
        if turn > 0:
            assert t.reason == "extend", (family, turn, t)
            assert t.reused_tokens >= 0.9 * t.prompt_tokens, (family, turn, t)
        messages.append({"role": "assistant", "content": reply})


def test_template_that_drops_earlier_think_blocks(any_family):
    """Qwen3-style templates rewrite history: the last reply loses its <think>
    block, so the prompt diverges right after the previous generation prompt."""
    family, model = any_family
    tokenizer = tiny_tokenizer(THINK_DROPPING_TEMPLATE)
    mgr = SessionManager(model, tokenizer, settle=False)
    messages, previous_prompt = [SYSTEM], None
    for turn in range(4):
        messages.append(user_message(turn))
        if turn > 0:
            assert "<think>" not in tokenizer.apply_chat_template(messages, tokenize=False)
        reply, t = exact_turn(mgr, "s", messages, model, tokenizer)
        if previous_prompt is not None:
            assert t.reused_tokens >= previous_prompt - 1, (turn, t)
            if family in CHECKPOINT_FAMILIES:
                assert t.checkpoint_restored == t.reused_tokens, (turn, t)
        previous_prompt = t.prompt_tokens
        messages.append({"role": "assistant", "content": f"<think>{reply}</think>\nDone."})


@pytest.mark.parametrize("checkpoints", ["last", "every"])
def test_template_that_opens_a_think_block_in_the_generation_prompt(any_family, checkpoints):
    """Qwen3.5- and DeepSeek-R1-style templates put "<think>\n" in the
    generation prompt but not in history: the next prompt diverges inside the
    previous generation prompt, before the checkpoint at its end. kvchat finds
    that tail by probing the template and stops its prefill where it starts,
    so every layer reuses the whole common prefix."""
    family, model = any_family
    tokenizer = tiny_tokenizer(THINK_OPENING_TEMPLATE)
    mgr = SessionManager(model, tokenizer, checkpoints=checkpoints, settle=False)
    messages, held, previous_prompt = [SYSTEM], [], None
    for turn in range(4):
        messages.append(user_message(turn))
        prompt = render_prompt(tokenizer, messages).tolist()
        reply, t = exact_turn(mgr, "s", messages, model, tokenizer)
        if previous_prompt is not None:
            common = next(
                (i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b),
                min(len(held), len(prompt)),
            )
            assert common < previous_prompt, (turn, common, previous_prompt)  # inside it
            assert t.reused_tokens == common, (turn, t, common)
            if family in CHECKPOINT_FAMILIES:
                assert t.checkpoint_restored == common, (turn, t)
        held, previous_prompt = mgr.cached_ids("s"), t.prompt_tokens
        messages.append({"role": "assistant", "content": f"Let me see.</think>\n\n{reply}"})


@pytest.mark.parametrize("checkpoints", ["every", "last"])
def test_regenerated_turn_reuses_up_to_its_checkpoint(any_family, tokenizer, checkpoints):
    """Attention crops to all but the last prompt token. Layers that cannot
    crop come back from a checkpoint: with "every", the one before the last
    prompt token; with "last", the free one where the turn started."""
    family, model = any_family
    mgr = SessionManager(model, tokenizer, checkpoints=checkpoints, settle=False)
    messages, first = checked_turns(mgr, model, tokenizer, SYSTEM, 3)
    reply = messages.pop()["content"]  # the user asks for another answer to the same question
    again, t = exact_turn(mgr, "s", messages, model, tokenizer)
    assert again == reply and t.output_ids == first.output_ids
    assert t.reason == "prompt_cached"
    if family not in CHECKPOINT_FAMILIES:
        assert t.reused_tokens == t.prompt_tokens - 1
    elif checkpoints == "every":
        assert t.reused_tokens == t.checkpoint_restored == t.prompt_tokens - 1
    else:
        assert 0 < first.reused_tokens < t.prompt_tokens - 1
        assert t.reused_tokens == t.checkpoint_restored == first.reused_tokens


def test_edited_earlier_message_restores_a_checkpoint_before_it(any_family, tokenizer):
    family, model = any_family
    mgr = SessionManager(model, tokenizer)
    messages, _ = checked_turns(mgr, model, tokenizer, LONG_SYSTEM, 4)
    before = render_prompt(tokenizer, messages)
    messages[1] = {"role": "user", "content": "Actually, tell me about Tokyo instead."}
    messages.append(user_message(4))
    after = render_prompt(tokenizer, messages)
    _, t = exact_turn(mgr, "s", messages, model, tokenizer)
    system_text = tokenizer.apply_chat_template(messages[:1], tokenize=False)
    # The checkpoint sits right after the system message's end-of-turn token,
    # before the newline the template writes after it.
    system_end = len(tokenizer(system_text.rstrip("\n"), add_special_tokens=False)["input_ids"])
    first_difference = int((before[: after.numel()] != after[: before.numel()]).nonzero()[0])
    assert t.reason == "diverged"
    # Reused: the long system prompt, and at most what precedes the first edited token.
    assert system_end <= t.reused_tokens <= first_difference, (system_end, first_difference, t)
    if family in CHECKPOINT_FAMILIES:
        # The system prompt's checkpoint is costly to lose, so thinning kept it.
        assert t.checkpoint_restored == t.reused_tokens


class ForwardCounter:
    """Counts the model's forward passes (a hook on its outermost module)."""

    def __init__(self, model):
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1

    def close(self):
        self._handle.remove()


@pytest.mark.parametrize("checkpoints", ["last", "every"])
def test_checkpoints_last_adds_no_forward_after_the_first_turn(any_family, tokenizer, checkpoints):
    """generate runs one forward per new token: one prefill, then one per decoded
    token but the last. With "last" a hybrid's turn adds nothing to that after
    the first turn, which stops once at the long system prompt's end; with
    "every" each message boundary costs a forward on every turn. LFM2's
    checkpoints are conv windows, read off the one forward: no stop costs a
    forward, with either policy."""
    family, model = any_family
    # Settling's forwards run between turns, off their path (test_settling.py).
    mgr = SessionManager(model, tokenizer, checkpoints=checkpoints, settle=False)
    messages = [LONG_SYSTEM]
    counter = ForwardCounter(model)
    extra = []
    try:
        for turn in range(3):
            messages.append(user_message(turn))
            before = counter.calls
            reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
            t = mgr.last_turn("s")
            extra.append(counter.calls - before - t.generated_tokens)
            messages.append({"role": "assistant", "content": reply})
    finally:
        counter.close()
    if family not in CHECKPOINT_FAMILIES or family in WINDOW_FAMILIES:
        assert extra == [0, 0, 0], extra
    elif checkpoints == "last":
        assert extra == [1, 0, 0], extra
    else:
        assert min(extra) >= 2, extra  # message ends, the generation prompt, the last token


def test_text_mode_keeps_the_whole_cache_when_retokenization_differs(any_family, tokenizer):
    """match='text' tokenizes only the new text; the ids can then differ from a
    fresh tokenization, and are identical to plain generate on those ids."""
    family, model = any_family
    # Special tokens inside a reply vanish from its decoded text, which would
    # (safely) fall back to token matching; keep them out to test text matching.
    suppress = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")]
    mgr = SessionManager(model, tokenizer, match="text")
    messages, cached, fresh_differs = [SYSTEM], None, 0
    for turn in range(8):
        messages.append(user_message(turn))
        reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW, suppress_tokens=suppress)
        t = mgr.last_turn("s")
        used = torch.tensor(mgr.cached_ids("s")[: t.prompt_tokens])
        plain = reference_ids(model, used, suppress_tokens=suppress)
        assert t.output_ids == plain, (family, turn)
        if cached is not None:
            assert t.reason == "extend" and t.reused_tokens == cached, (family, turn, t)
        fresh_differs += not torch.equal(used, render_prompt(tokenizer, messages))
        cached = mgr.info("s").cached_tokens
        messages.append({"role": "assistant", "content": reply})
    assert fresh_differs > 0, "no turn exercised a re-tokenization difference"


@pytest.mark.parametrize("settle", [False, True])
@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", "falcon_h1"])
def test_checkpoint_memory_stays_bounded_over_30_turns(family, tokenizer, settle):
    model = model_for(family)
    # One checkpoint's bytes, measured on a throwaway session.
    probe = SessionManager(model, tokenizer, max_checkpoints=1)
    probe.chat("p", [SYSTEM, user_message(0)], max_new_tokens=2)
    one = probe.info("p").checkpoint_bytes
    assert one > 0
    bound = int(2.5 * one)
    mgr = SessionManager(
        model, tokenizer, max_checkpoints=4, max_checkpoint_bytes=bound, settle=settle
    )
    messages = [SYSTEM]
    for turn in range(30):
        messages.append(user_message(turn))
        reply, t = exact_turn(mgr, "s", messages, model, tokenizer)
        mgr.wait_settled()
        info, stats = mgr.info("s"), mgr.stats()
        assert 1 <= info.checkpoints <= 2, (turn, info)  # 2.5 checkpoints' bytes hold 2
        assert info.checkpoint_bytes <= bound, (turn, info)
        assert stats.checkpoint_bytes == info.checkpoint_bytes
        assert stats.resident_bytes >= info.checkpoint_bytes  # counted toward the budget
        messages.append({"role": "assistant", "content": reply})
    # At least one per turn (the prompt's end), thinned to the bound of two.
    assert stats.checkpoints_taken >= 30
    if settle:  # every turn extends the settled history
        assert stats.settles >= 29 and stats.settle_misses == 0
    else:  # random replies re-tokenize differently: turns restored the newest checkpoint
        assert stats.checkpoint_restores > 0


def test_stats_count_checkpoints_only_where_layers_need_them(tokenizer):
    """Unsettled, each next turn of LFM2 restores a checkpoint (its cache
    cannot crop back to where the reply's re-rendering departs); settled
    before it (``wait_settled``), none does. Llama takes none either way.
    (Settled without waiting, whether a turn restores depends on which
    comes first, the settle or the turn: this test failed now and then on a
    busy machine when it did not say which.)"""
    for family, expect_checkpoints in (("llama", False), ("lfm2", True)):
        for settled in (False, True):
            model = model_for(family)
            mgr = SessionManager(model, tokenizer, settle=settled)
            messages = [SYSTEM]
            for turn in range(3):
                messages.append(user_message(turn))
                reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
                messages.append({"role": "assistant", "content": reply})
                if settled:
                    assert mgr.wait_settled(timeout=300)
            stats = mgr.stats()
            case = (family, settled, stats)
            assert (stats.checkpoints_taken > 0) == expect_checkpoints, case
            assert (stats.checkpoint_bytes > 0) == expect_checkpoints, case
            restores = expect_checkpoints and not settled
            assert (stats.checkpoint_restores > 0) == restores, case
            mgr.close()


def test_unknown_layer_class_falls_back_to_no_reuse(monkeypatch, caplog, tokenizer):
    """A cache layer kvchat does not know (here: LFM2's conv layer, hidden from
    the bridge) means no reuse, with a warning; never a wrong answer."""
    from kvchat.bridge import probe

    parts = {k: v for k, v in probe.PARTS.items() if k.__name__ != "LinearAttentionLayer"}
    monkeypatch.setattr(probe, "PARTS", parts)
    model = model_for("lfm2")
    with caplog.at_level("WARNING", logger="kvchat"):
        mgr = SessionManager(model, tokenizer)
    assert "LinearAttentionLayer" in caplog.text
    assert_plain_turns(mgr, model, tokenizer, turns=2)
    assert not mgr.info("s").resident


def _forget_state_on_long_forwards(module, args, kwargs):
    """Zeroes a cache's recurrent tensors before a forward over several tokens:
    a model whose scan over a chunk starts from zeros, as Mamba's does."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # 5.24 renamed it
    if cache is None or kwargs["input_ids"].shape[-1] == 1:
        return
    for layer in cache.layers:
        for kind in ("conv", "recurrent"):
            # {state index: initialized}, as LinearAttentionLayer keeps it.
            for i, initialized in getattr(layer, f"is_{kind}_states_initialized", {}).items():
                if initialized:
                    getattr(layer, f"{kind}_states")[i].zero_()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_a_hybrid_whose_scan_ignores_the_cache_runs_as_plain_generate(caplog, tokenizer, dtype):
    """kvchat prefills the tail after a checkpoint in one forward from the
    restored state, so a model whose forward over several tokens starts its
    recurrent layers from zeros cannot reuse exactly: the probe at
    construction finds that (here FalconH1, made to forget its state), and
    every turn is plain generate, exact. In the half dtypes too, where the
    probe allows more rounding."""
    if dtype == torch.float64:
        model = model_for("falcon_h1")
    else:
        model = tiny_model("falcon_h1", dtype=dtype)
    hook = model.register_forward_pre_hook(_forget_state_on_long_forwards, with_kwargs=True)
    try:
        with caplog.at_level("WARNING", logger="kvchat"):
            mgr = SessionManager(model, tokenizer)
        assert "does not continue the cached state" in caplog.text
        assert_plain_turns(mgr, model, tokenizer, turns=2)
    finally:
        hook.remove()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_convolution_windows_no_history_reaches_are_not_held_to_the_history(
    caplog, tokenizer, dtype
):
    """LFM2's first two layers are convolutions (LFM2-350M: conv, conv,
    attention, ...): their windows are filled from the probe's last tokens
    whatever came before, so only rounding moves them, and at LFM2-350M's
    width that was ten roundings, over the allowance: the probe refused a
    model that continues its state exactly, and every turn ran as plain
    generate. Such windows are not compared now; a window behind an attention
    layer still is, and a model that loses its state is still refused."""
    layers = ["conv", "conv", "full_attention", "conv"]
    model = tiny_model("lfm2", dtype=dtype, layer_types=layers)
    with caplog.at_level("DEBUG", logger="kvchat"):
        mgr = SessionManager(model, tokenizer)
    assert "layer 0 conv 0 holds no history" in caplog.text
    assert "layer 1 conv 0 holds no history" in caplog.text
    assert "name='layer 3 conv 0'" in caplog.text  # behind attention: compared
    assert mgr.stats().requests == 0 and mgr.layout.supported
    _, reports = exact_turns(mgr, "s", [LONG_SYSTEM], model, tokenizer, 3)
    assert all(r.reused_tokens > 0.8 * r.prompt_tokens for r in reports[1:]), reports

    # FalconH1-0.5B's first window (beside its attention and Mamba2 scan)
    # was refused the same way, at 4.2 roundings; the second is compared.
    caplog.clear()
    with caplog.at_level("DEBUG", logger="kvchat"):
        SessionManager(tiny_model("falcon_h1", dtype=dtype), tokenizer)
    assert "layer 0 conv 0 holds no history" in caplog.text
    assert "name='layer 1 conv 0'" in caplog.text

    caplog.clear()
    hook = model.register_forward_pre_hook(_forget_state_on_long_forwards, with_kwargs=True)
    try:
        with caplog.at_level("WARNING", logger="kvchat"):
            SessionManager(model, tokenizer)
        assert "does not continue the cached state" in caplog.text
    finally:
        hook.remove()
