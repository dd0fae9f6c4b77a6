"""Cross-session prefix sharing: sessions that begin alike (a common system
prompt) start from one another's prefix and hold it once, copy-on-write.

Every output is compared with plain ``model.generate`` on the full
conversation (float64, greedy)."""

from __future__ import annotations

import pytest
from helpers import LONG_SYSTEM, model_for, reference_turn
from kvchat import SessionManager
from kvchat.prompting import render_prompt

MAX_NEW = 6


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in every layer of a plain attention model."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element


def long_system(tokenizer, min_tokens: int) -> dict:
    """A system prompt of at least ``min_tokens`` tokens."""
    content, part = "", 0
    while len(tokenizer(content)["input_ids"]) < min_tokens:
        part += 1
        content += f" Section {part}. " + LONG_SYSTEM["content"]
    return {"role": "system", "content": content.strip()}


def user(session: int, turn: int) -> dict:
    return {"role": "user", "content": f"User {session}, question {turn}: what about item {turn}?"}


def run_sessions(mgr, model, tokenizer, system, sessions: int, turns: int):
    """Round-robin turns over sessions, each checked against plain generate."""
    conversations = {s: [system] for s in range(sessions)}
    for turn in range(turns):
        for s in range(sessions):
            messages = conversations[s]
            messages.append(user(s, turn))
            _, _, expected = reference_turn(model, tokenizer, messages, MAX_NEW)
            reply = mgr.chat(f"s{s}", messages, max_new_tokens=MAX_NEW)
            report = mgr.last_turn(f"s{s}")
            assert report.output_ids == expected, (s, turn)
            messages.append({"role": "assistant", "content": reply})
    return conversations


@pytest.mark.slow
def test_32_sessions_hold_a_1000_token_system_prompt_once(llama, tokenizer):
    system = long_system(tokenizer, 1000)
    mgr = SessionManager(llama, tokenizer, max_sessions=32)
    run_sessions(mgr, llama, tokenizer, system, sessions=32, turns=2)

    stats = mgr.stats()
    assert stats.shared_prefixes == 1
    assert stats.prefix_shares == 31  # every session but the first started from it
    shared = stats.shared_tokens // 31
    assert shared >= 1000
    # The shared prefix ends where the system message ends.
    first_user = render_prompt(tokenizer, [system, user(0, 0)])
    assert shared < first_user.numel()

    per_token = kv_bytes_per_token(llama)
    own = sum(mgr.info(f"s{s}").cached_tokens - shared for s in range(32))
    # One copy of the prefix plus each session's own tokens, nothing else.
    assert stats.resident_bytes == (shared + own) * per_token
    unshared = sum(mgr.info(f"s{s}").cached_tokens for s in range(32)) * per_token
    assert stats.resident_bytes * 8 < unshared


def test_turn_report_names_the_shared_prefix(llama, tokenizer):
    system = long_system(tokenizer, 100)
    mgr = SessionManager(llama, tokenizer)
    run_sessions(mgr, llama, tokenizer, system, sessions=1, turns=1)
    mgr.chat("other", [system, user(9, 0)], max_new_tokens=MAX_NEW)
    report = mgr.last_turn("other")
    assert report.reason == "shared_prefix"
    assert report.reused_tokens == mgr.stats().shared_tokens


def test_sharing_off_keeps_private_copies(llama, tokenizer):
    system = long_system(tokenizer, 100)
    mgr = SessionManager(llama, tokenizer, share_prefixes=False)
    run_sessions(mgr, llama, tokenizer, system, sessions=3, turns=1)
    stats = mgr.stats()
    assert stats.shared_prefixes == 0 and stats.prefix_shares == 0
    cached = sum(mgr.info(f"s{s}").cached_tokens for s in range(3))
    assert stats.resident_bytes >= cached * kv_bytes_per_token(llama)


def test_a_different_system_prompt_shares_nothing(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    run_sessions(mgr, llama, tokenizer, long_system(tokenizer, 100), sessions=1, turns=1)
    other = {"role": "system", "content": "Reply in French. " + LONG_SYSTEM["content"]}
    messages = [other, user(1, 0)]
    _, _, expected = reference_turn(llama, tokenizer, messages, MAX_NEW)
    mgr.chat("fr", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("fr").output_ids == expected
    assert mgr.last_turn("fr").reused_tokens == 0
    assert mgr.stats().prefix_shares == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "lfm2", "qwen3_5", "bamba", "falcon_h1"])
def test_hybrid_sessions_share_their_system_prompt(family, tokenizer):
    """Attention KV is shared; sliding-window, conv and recurrent state at the
    prefix's end comes from the donor's checkpoint there."""
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    system = long_system(tokenizer, 150)
    run_sessions(mgr, model, tokenizer, system, sessions=4, turns=2)
    stats = mgr.stats()
    assert stats.prefix_shares == 3
    assert stats.shared_prefixes == 1
    unshared = SessionManager(model, tokenizer, share_prefixes=False)
    run_sessions(unshared, model, tokenizer, system, sessions=4, turns=2)
    if family in ("gemma3", "bamba", "falcon_h1", "lfm2"):  # these have full-attention KV
        assert stats.resident_bytes < unshared.stats().resident_bytes
