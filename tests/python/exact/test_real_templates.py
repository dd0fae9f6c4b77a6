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
cache can reuse, and on every family, hybrids included, since the session
settles between turns (docs/settling.md).

Replies come two ways: "raw", as the random model writes them (most do not
re-tokenize as generated: byte-level merges, invalid UTF-8 decoded to U+FFFD,
a generation prompt's last token merging with the reply's first), and
"words", restricted to whole-word tokens so that they do. Where the app sends
back something else than the reply (a tool call it parsed, the reply with a
reasoning block), it says so with ``settle()``, as an agent loop would; every
turn after that prefills only the new messages and the generation prompt.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import DEVICE, common_prefix, history_ids, reference_ids, user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model, words_only
from llama_cpp_models import fetch

pytestmark = pytest.mark.slow

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
    # "template@case": the same template with another vocabulary or family:
    # the two raw-reply cases that lost reuse before settling (0% and 68.7%),
    # and tool calls sent back on a hybrid.
    "LFM2.5-Instruct@qwen2": ("qwen2", "lfm2", "LFM2's own turns"),
    "ibm-granite-granite-4.0@llama-bpe": ("llama-bpe", "falcon_h1", "a default system prompt"),
    "Qwen-Qwen2.5-7B-Instruct@lfm2": ("qwen2", "lfm2", "tool calls and tool messages"),
}
NO_SYSTEM = {"google-gemma-2-2b-it"}
WITH_TOOLS = {
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct@lfm2",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
}
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
    name = template.partition("@")[0]
    tokenizer.chat_template = (fetch() / "templates" / f"{name}.jinja").read_text("utf-8")
    return tokenizer


@functools.cache
def _suppressed(vocab: str) -> list[int]:
    """Only whole-word tokens, so replies re-tokenize as generated (a random
    model's raw output would diverge inside every reply)."""
    return words_only(_vocabulary(vocab))


@functools.cache
def model_for(family: str, vocab: str):
    tokenizer = _vocabulary(vocab)
    return tiny_model(family, dtype=torch.float64, tokenizer=tokenizer).to(DEVICE)


def _sent_back(template, messages, turn, reply):
    """(the history after ``reply`` as an app sends it back, what comes next),
    or the history None when the app sends back the reply as it came."""
    if template in WITH_TOOLS and turn == 0:
        # The app reads the reply as a tool call, runs it and sends the result.
        call = {"name": "get_weather", "arguments": {"city": "Paris"}}
        calls = [{"id": "call_1", "type": "function", "function": call}]
        result = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                  "content": '{"temperature_c": 21, "sky": "clear"}'}  # fmt: skip
        return [*messages, {"role": "assistant", "content": None, "tool_calls": calls}], [result]
    if "reasoning" in CASES[template][2] or "<think>" in CASES[template][2]:
        thought = f"<think>The user asks about turn {turn}.</think>\n\n{reply}"
        return [*messages, {"role": "assistant", "content": thought}], [user_message(turn + 1)]
    return None, [user_message(turn + 1)]


@pytest.mark.parametrize("replies", ["raw", "words"])
@pytest.mark.parametrize("template", sorted(CASES))
def test_real_template_replay_is_exact_and_reuses_the_common_prefix(template, replies):
    vocab, family, _ = CASES[template]
    tokenizer = _tokenizer(template)
    model = model_for(family, vocab)
    suppress = _suppressed(vocab) if replies == "words" else None
    tools = [WEATHER_TOOL] if template in WITH_TOOLS else None
    mgr = SessionManager(model, tokenizer)
    messages = ([] if template in NO_SYSTEM else [SYSTEM]) + [user_message(0)]
    history = None
    for turn in range(TURNS):
        mgr.wait_settled()  # the time a user takes to read and type
        held = mgr.cached_ids("s") if turn else []
        prompt = render_prompt(tokenizer, messages, tools=tools)
        sent_back = _sent_back(template, messages, turn, "")[0] is not None
        reply = mgr.chat(
            "s",
            messages,
            max_new_tokens=MAX_NEW,
            tools=tools,
            suppress_tokens=suppress,
            settle=not sent_back,
        )
        t = mgr.last_turn("s")
        want = reference_ids(model, prompt, MAX_NEW, suppress_tokens=suppress)
        assert t.prompt_tokens == prompt.numel(), (template, turn)
        assert t.output_ids == want, (template, turn)
        lcp = min(common_prefix(held, prompt), prompt.numel() - 1)
        if turn:
            # Settled: the whole history is held, so every family reuses the
            # LCP and prefills only the new messages and the generation prompt.
            fixed = common_prefix(history_ids(tokenizer, history, tools), prompt)
            assert t.reused_tokens == lcp == fixed, (template, turn, t, lcp, fixed)
        history, following = _sent_back(template, messages, turn, reply)
        if history is None:
            history = [*messages, {"role": "assistant", "content": reply}]
        else:
            mgr.settle("s", history, tools=tools)
        messages = history + following
    assert mgr.stats().settle_misses == 0
