"""Greedy output through kvchat is token-identical to plain model.generate on
the full conversation, and from turn 2 on only the new tokens are prefilled."""

from __future__ import annotations

import pytest
import torch
from helpers import MAX_NEW, SYSTEM, reference_turn, user_message
from kvchat import SessionManager
from kvchat._C import common_prefix_length
from kvchat.prompting import render_prompt


def chat_and_check(mgr, model, tokenizer, session_id, messages):
    """One chat turn, checked against the reference; returns the reply."""
    reply = mgr.chat(session_id, messages, max_new_tokens=MAX_NEW)
    ref_reply, prompt, ref_ids = reference_turn(model, tokenizer, messages)
    turn = mgr.last_turn(session_id)
    assert turn.output_ids == ref_ids, f"turn {len(messages)}: tokens differ from plain generate"
    assert reply == ref_reply
    assert turn.prompt_tokens == prompt.numel()
    assert turn.reused_tokens + turn.prefilled_tokens == prompt.numel()
    return reply, prompt, ref_ids


@pytest.mark.parametrize("settle", [False, True])
def test_ten_turns_identical_and_prefill_only_new(family_model, tokenizer, settle):
    """Unsettled, the cache holds the previous prompt and reply; settled (the
    session waits for it, as a user reading the reply does), it holds the
    history as the template renders it, and the turn prefills only the new
    message and the generation prompt."""
    mgr = SessionManager(family_model, tokenizer, settle=settle)
    messages = [SYSTEM]
    previous = None  # (prompt ids, output ids) of the previous turn
    for turn in range(10):
        messages.append(user_message(turn))
        mgr.wait_settled()
        held = torch.tensor(mgr.cached_ids("s") if previous else [])
        reply, prompt, output_ids = chat_and_check(mgr, family_model, tokenizer, "s", messages)
        report = mgr.last_turn("s")
        if previous is None:
            assert report.reused_tokens == 0 and report.reason == "no_cache"
        else:
            prev_prompt, prev_out = previous
            if not settle:  # the previous prompt plus all generated ids but the last
                cached = torch.cat([prev_prompt, torch.tensor(prev_out[:-1], dtype=torch.long)])
                assert torch.equal(held, cached)
            lcp = common_prefix_length(held.long(), prompt)
            assert report.prefilled_tokens == prompt.numel() - min(lcp, prompt.numel() - 1)
            # At worst, re-tokenizing the reply costs the reply: never the old prompt.
            assert report.reused_tokens >= prev_prompt.numel()
            if settle:  # the whole history
                other = {"role": "user", "content": "Zebra"}
                history = render_prompt(tokenizer, [*messages[:-1], other])
                assert lcp == common_prefix_length(history, prompt)
        previous = (prompt, output_ids)
        messages.append({"role": "assistant", "content": reply})
    stats = mgr.stats()
    assert stats.requests == 10
    assert stats.hit_rate > 0.5


def test_generate_prefills_exactly_the_new_tokens(family_model):
    # With ids under our control there is no re-tokenization: turn 2 prefills
    # the last generated token (never run through the model) plus the new ids.
    mgr = SessionManager(family_model)
    torch.manual_seed(1)
    prompt = torch.randint(10, 600, (1, 50)).to(family_model.device)
    out1 = mgr.generate(prompt, session_id="g", max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, family_model.generate(prompt, max_new_tokens=8, do_sample=False))
    extra = torch.randint(10, 600, (1, 17)).to(family_model.device)
    turn2 = torch.cat([out1, extra], dim=1)
    out2 = mgr.generate(turn2, session_id="g", max_new_tokens=8, do_sample=False)
    assert torch.equal(out2, family_model.generate(turn2, max_new_tokens=8, do_sample=False))
    report = mgr.last_turn("g")
    assert report.reason == "extend"
    assert report.reused_tokens == out1.shape[1] - 1
    assert report.prefilled_tokens == extra.shape[1] + 1


def test_edited_earlier_message(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM]
    for turn in range(3):
        messages.append(user_message(turn))
        reply, _, _ = chat_and_check(mgr, llama, tokenizer, "s", messages)
        messages.append({"role": "assistant", "content": reply})
    edited = [dict(m) for m in messages]
    edited[1]["content"] = "An edited first question about something else entirely."
    edited.append(user_message(3))
    chat_and_check(mgr, llama, tokenizer, "s", edited)
    report = mgr.last_turn("s")
    assert report.reason == "diverged"
    assert 0 < report.reused_tokens < report.prompt_tokens // 2


def test_regenerated_turn_reuses_all_but_the_last_token(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    first = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    again = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    report = mgr.last_turn("s")
    assert again == first
    assert report.reason == "prompt_cached"
    assert report.prefilled_tokens == 1
    assert report.reused_tokens == report.prompt_tokens - 1
    chat_and_check(mgr, llama, tokenizer, "s", messages)


def test_two_sessions_interleaved(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    conversations = {"alice": [SYSTEM], "bob": [{"role": "system", "content": "Be terse."}]}
    for turn in range(4):
        for sid, messages in conversations.items():
            messages.append(user_message(turn + (5 if sid == "bob" else 0)))
            reply, _, _ = chat_and_check(mgr, llama, tokenizer, sid, messages)
            messages.append({"role": "assistant", "content": reply})
            if turn > 0:
                assert mgr.last_turn(sid).reused_tokens > 0
    assert sorted(mgr.sessions()) == ["alice", "bob"]


@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_session_evicted_between_turns(llama, tokenizer, limit):
    kwargs = {"max_sessions": 1} if limit == "count" else {"max_cache_bytes": 1}
    # Both conversations are the same, so with sharing on the second would
    # start from the first's prefix (test_sharing.py); here eviction is alone.
    mgr = SessionManager(llama, tokenizer, share_prefixes=False, **kwargs)
    conversations = {"alice": [SYSTEM], "bob": [SYSTEM]}
    for turn in range(3):
        for sid, messages in conversations.items():
            messages.append(user_message(turn))
            reply, _, _ = chat_and_check(mgr, llama, tokenizer, sid, messages)
            messages.append({"role": "assistant", "content": reply})
            # Each session was evicted by the other (or by its own size): full prefill.
            assert mgr.last_turn(sid).reused_tokens == 0
    assert mgr.stats().evictions >= 5
    assert mgr.info("alice").messages == 6  # eviction keeps the history
