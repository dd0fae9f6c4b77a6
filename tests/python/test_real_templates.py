"""Multi-turn replays with public models' chat templates and real vocabularies.

Templates and vocabularies come from llama.cpp's sources as the
``llama-cpp-python`` sdist vendors them (see llama_cpp_models.py; ``make test``
fetches them into build/llama-cpp). Real templates rewrite history in ways
kvchat's own do not: dates in the system header, a system prompt moved into the
last user message, earlier reasoning dropped, no system role, tool calls. Real
byte-level vocabularies merge across message boundaries as they will.

Each turn asserts two things: the reply is token for token plain ``generate``
on the full conversation (float64), and the reuse is the longest common prefix
(LCP) of what the session held and the new prompt, the most any exact prefix
cache can reuse. Layers that cannot crop (a hybrid model) reuse up to their
checkpoint at or before the LCP, so there the sum over turns must reach 99%.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import CHECKPOINT_FAMILIES, DEVICE
from helpers import user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model, words_only
from llama_cpp_models import fetch

SYSTEM = {
    "role": "system",
    "content": "You are a travel assistant. Answer in one short paragraph and name your sources.",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
# template (llama.cpp's file stem): (vocabulary, tiny model family, what it does)
CASES = {
    "Qwen-Qwen3-0.6B": ("qwen2", "qwen3_5", "drops earlier <think> blocks"),
    "Qwen3.5-4B": ("qwen2", "qwen3_5", "drops earlier reasoning"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("qwen2", "llama", "drops earlier reasoning"),
    "Qwen-Qwen2.5-7B-Instruct": ("qwen2", "llama", "tool calls and tool messages"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama-bpe", "llama", "a date in the system header"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama-bpe", "lfm2", "today's date in the header"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("llama-bpe", "llama", "tool calls"),
    "HuggingFaceTB-SmolLM3-3B": ("llama-bpe", "llama", "a reasoning-mode system header"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("phi-3", "llama", "moves the system prompt"),
    "microsoft-Phi-3.5-mini-instruct": ("phi-3", "falcon_h1", "plain turns"),
    "google-gemma-2-2b-it": ("phi-3", "gemma3", "no system role"),
    "openai-gpt-oss-120b": ("gpt-2", "llama", "drops earlier analysis"),
    "LFM2.5-Instruct": ("gpt-2", "lfm2", "LFM2's own turns"),
    "ibm-granite-granite-4.0": ("gpt-2", "bamba", "a default system prompt"),
}
NO_SYSTEM = {"google-gemma-2-2b-it"}
WITH_TOOLS = {"Qwen-Qwen2.5-7B-Instruct", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"}
TURNS = 4
MAX_NEW = 10


@functools.cache
def _vocabulary(name: str):
    from transformers import AutoTokenizer

    folder = fetch()
    return AutoTokenizer.from_pretrained(folder, gguf_file=f"ggml-vocab-{name}.gguf")


@functools.cache
def _tokenizer(template: str):
    """The template's vocabulary with the template: a copy, since several
    templates share a vocabulary."""
    tokenizer = copy.deepcopy(_vocabulary(CASES[template][0]))
    tokenizer.chat_template = (fetch() / "templates" / f"{template}.jinja").read_text("utf-8")
    return tokenizer


@functools.cache
def _suppressed(vocab: str) -> list[int]:
    """Only whole-word tokens, so replies re-tokenize as generated (a random
    model's raw output would diverge inside every reply)."""
    return words_only(_vocabulary(vocab))


@functools.cache
def _model(family: str, vocab: str):
    tokenizer = _vocabulary(vocab)
    return tiny_model(family, dtype=torch.float64, tokenizer=tokenizer).to(DEVICE)


def _common_prefix(a: list[int], b: torch.Tensor) -> int:
    b = b.tolist()
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _next_messages(template, messages, turn, reply):
    """The conversation after ``reply``, as an app would send it next."""
    if template in WITH_TOOLS and turn == 0:
        # The app reads the reply as a tool call, runs it and sends the result.
        call = {"name": "get_weather", "arguments": {"city": "Paris"}}
        return messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": call}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
             "content": '{"temperature_c": 21, "sky": "clear"}'},
        ]  # fmt: skip
    if "reasoning" in CASES[template][2] or "<think>" in CASES[template][2]:
        reply = f"<think>The user asks about turn {turn}.</think>\n\n{reply}"
    return messages + [{"role": "assistant", "content": reply}, user_message(turn + 1)]


@pytest.mark.parametrize("template", sorted(CASES))
def test_real_template_replay_is_exact_and_reuses_the_common_prefix(template):
    vocab, family, _ = CASES[template]
    tokenizer = _tokenizer(template)
    model = _model(family, vocab)
    suppress = _suppressed(vocab)
    tools = [WEATHER_TOOL] if template in WITH_TOOLS else None
    mgr = SessionManager(model, tokenizer)
    messages = ([] if template in NO_SYSTEM else [SYSTEM]) + [user_message(0)]
    reused = common = 0
    for turn in range(TURNS):
        held = list(mgr._core.find("s").cached_ids()) if turn else []  # test-only access
        prompt = render_prompt(tokenizer, messages, tools=tools)
        reply = mgr.chat(
            "s", messages, max_new_tokens=MAX_NEW, tools=tools, suppress_tokens=suppress
        )
        t = mgr.last_turn("s")
        want = model.generate(
            prompt.unsqueeze(0).to(model.device),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            suppress_tokens=suppress,
        )
        assert t.prompt_tokens == prompt.numel(), (template, turn)
        assert t.output_ids == tuple(want[0, prompt.numel() :].tolist()), (template, turn)
        lcp = min(_common_prefix(held, prompt), prompt.numel() - 1)
        if turn:
            assert t.reused_tokens <= lcp, (template, turn, t, lcp)
            if family not in CHECKPOINT_FAMILIES:
                assert t.reused_tokens == lcp, (template, turn, t, lcp)
            reused, common = reused + t.reused_tokens, common + lcp
        messages = _next_messages(template, messages, turn, reply)
    assert reused >= 0.99 * common, (template, reused, common)
