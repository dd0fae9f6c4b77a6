"""Helpers shared by the tests: the models, the reference path and the conversation.

KVCHAT_TEST_DEVICE (default cpu) puts the models on another device, such as
cuda; `make test-gpu` runs the exactness, hybrid, sharing, persistence and
generate-argument tests that way."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model

DEVICE = torch.device(os.environ.get("KVCHAT_TEST_DEVICE", "cpu"))

# One family per layer mix: attention, sliding window, conv, DeltaNet, Mamba2
# in its own layers (Bamba) and beside attention in every layer (FalconH1), and
# stateless DummyLayers: MLP-only ones (NemotronH) and KV-shared ones (Gemma 3n).
REUSE_FAMILIES = (
    "llama",
    "gemma3",
    "lfm2",
    "qwen3_5",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "gemma3n",
)
# The families whose layers cannot crop back, so take checkpoints.
CHECKPOINT_FAMILIES = REUSE_FAMILIES[1:]
# Of those, the ones whose every such state is a convolution window (LFM2's
# short convs): a checkpoint is read off the forward, which never stops there.
WINDOW_FAMILIES = ("lfm2",)


@functools.cache
def model_for(family: str, seed: int = 0):
    """The tiny float64 model of ``family`` (one per family and seed, shared
    by every test: tests never change a model's weights)."""
    return tiny_model(family, dtype=torch.float64, seed=seed).to(DEVICE)


MAX_NEW = 12
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."}


def reference_ids(
    model, prompt, /, max_new_tokens=MAX_NEW, seed=None, first_scores=False, **kwargs
):
    """The reference: plain generate on ``prompt`` (1-D ids), no cache; the ids
    it generates, as a tuple. Greedy, or sampled after ``torch.manual_seed(seed)``.
    ``kwargs`` go to generate (a grammar's logits processor, say). With
    ``first_scores``: (ids, the first step's scores, one row)."""
    if seed is not None:
        torch.manual_seed(seed)
    kwargs.setdefault("do_sample", seed is not None)
    out = model.generate(
        prompt.unsqueeze(0).to(model.device),
        max_new_tokens=max_new_tokens,
        output_scores=first_scores,
        return_dict_in_generate=True,
        **kwargs,
    )
    ids = tuple(out.sequences[0, prompt.numel() :].tolist())
    return (ids, out.scores[0][0]) if first_scores else ids


def reference_turn(model, tokenizer, messages, /, max_new_tokens=MAX_NEW, tools=None, **kwargs):
    """``reference_ids`` on the full conversation: (reply text, prompt ids,
    output ids). ``kwargs`` go to generate."""
    prompt = render_prompt(tokenizer, messages, tools=tools)
    output_ids = reference_ids(model, prompt, max_new_tokens, **kwargs)
    return tokenizer.decode(output_ids, skip_special_tokens=True), prompt, output_ids


# Logits of these random models spread by about 0.15; bfloat16 rounding moved
# them by at most 0.004 between a cached and a full prefill (one bfloat16 step
# at their size). A lead of five times that is a clear first token.
MARGIN = 0.02  # in the model's dtype: bfloat16, float16, float32


def plain_with_margin(model, prompt):
    """Plain generate's ids, and by how much its first token led the next."""
    ids, scores = reference_ids(model, prompt, first_scores=True)
    top = scores.float().topk(2).values
    return ids, float(top[0] - top[1])


def exact_turn(manager, session, messages, model, tokenizer, max_new_tokens=MAX_NEW, **kwargs):
    """One turn on ``messages`` through ``manager``, asserted token-identical
    to ``reference_turn`` (``kwargs`` go to both): (reply, report)."""
    reply = manager.chat(session, messages, max_new_tokens=max_new_tokens, **kwargs)
    expected = reference_turn(model, tokenizer, messages, max_new_tokens, **kwargs)[2]
    report = manager.last_turn(session)
    where = f"{session!r} turn {sum(m['role'] == 'user' for m in messages)}"
    assert report.output_ids == expected, f"{where} differs from generate"
    return reply, report


def exact_turns(
    manager, session, messages, model, tokenizer, turns, start=0, max_new_tokens=MAX_NEW, **kwargs
):
    """The conversation helper: ``turns`` user turns (``user_message(start)``
    on) after ``messages``, each an ``exact_turn`` and its reply fed back as
    the model wrote it. Returns the conversation (a new list) and each turn's
    report."""
    messages, reports = list(messages), []
    for turn in range(start, start + turns):
        messages.append(user_message(turn))
        reply, report = exact_turn(
            manager, session, messages, model, tokenizer, max_new_tokens, **kwargs
        )
        reports.append(report)
        messages.append({"role": "assistant", "content": reply})
    return messages, reports


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two id sequences (lists or 1-D tensors)."""
    a, b = (x.tolist() if hasattr(x, "tolist") else list(x) for x in (a, b))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def history_ids(tokenizer, history: list[dict], tools=None) -> list[int]:
    """The ids every next prompt after ``history`` starts with, whatever the
    next message: where renders with two different ones part (a user's, or
    after a call, the tool's result). Written apart from kvchat's own
    prediction, with other messages, for the settling tests to check it
    against."""
    last = history[-1] if history else {}
    if last.get("role") == "assistant" and last.get("tool_calls"):
        call_id = last["tool_calls"][0]["id"]
        nexts = [{"role": "tool", "tool_call_id": call_id, "content": t} for t in ("Zebra", "42")]
    else:
        nexts = [{"role": "user", "content": text} for text in ("Zebra crossing", "42")]
    a, b = (render_prompt(tokenizer, [*history, message], tools=tools) for message in nexts)
    return a[: common_prefix(a, b)].tolist()


def user_message(turn: int) -> dict:
    topics = [
        "the weather",
        "a trip to Paris",
        "sorting lists in Python",
        "a robot who paints",
        "haiku about autumn",
        "the capital of France",
        "time in Tokyo",
        "key-value caches",
        "a short story",
        "one more example",
    ]
    return {"role": "user", "content": f"Turn {turn}: tell me about {topics[turn % len(topics)]}."}


# A realistic system prompt (about 200 tokens): a normal conversation's new
# tokens per turn are then a small share of its prompt, as in real chats.
LONG_SYSTEM = {
    "role": "system",
    "content": (
        "You are a helpful assistant for a small travel company. Answer briefly and "
        "precisely, in plain words. When the user asks about a trip, give the capital, "
        "the time, the weather and one thing to see. When the user asks about code, "
        "answer with a short example in Python and explain it in two sentences. "
        "Never invent prices. If you do not know, say so and suggest where to look. "
        "Keep every answer under one hundred words. Use lists when the user asks for "
        "a list, and full sentences otherwise. Be kind, be clear, and thank the user "
        "when the conversation ends. Remember what the user said earlier in the "
        "conversation and do not ask the same question twice. The user may change "
        "the topic at any time; follow them. Summarise the conversation so far when "
        "asked, in two sentences at most."
    ),
}


# Twice as long (about 400 tokens): a turn's new tokens (the last reply and the
# new question, about 45) are then under 10% of the prompt, so a session can
# reuse 90% of it; with LONG_SYSTEM alone even a perfect cache reuses 88%.
LONGER_SYSTEM = dict(LONG_SYSTEM, content=LONG_SYSTEM["content"] + " " + LONG_SYSTEM["content"])


# The test tree (helpers.py's folder, which the RESTART child processes put on
# their path) and the repository's root.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[1]


def doc_table_rows(page: str, heading: str) -> list[str]:
    """The first cell of each body row of the table under ``heading`` in the
    docs page ``page`` (a path from the repository's root)."""
    text = "\n" + (ROOT / page).read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [line.split("|")[1].strip() for line in lines[2:]]  # past the header and rule


def assert_plain_turns(manager, model, tokenizer, turns, max_new_tokens=MAX_NEW):
    """``turns`` turns of a conversation, each plain generate's reply and run
    as plain generate (reason ``unsupported_layers``, nothing reused)."""
    messages = [SYSTEM]
    for turn in range(turns):
        messages.append(user_message(turn))
        reply = manager.chat("s", messages, max_new_tokens=max_new_tokens)
        assert reply == reference_turn(model, tokenizer, messages, max_new_tokens)[0], turn
        report = manager.last_turn("s")
        assert (report.reason, report.reused_tokens) == ("unsupported_layers", 0), report
        messages.append({"role": "assistant", "content": reply})


def check_low_precision_replies(reports, expected, turn, sessions, tokenizer) -> int:
    """What half precision promises for each ``(k, report)`` of a round of
    turns: a first turn gives plain generate's ids (``expected[k]``: ids and
    their margin from ``plain_with_margin``), a later one its first token
    where that token's margin is clear (``MARGIN``). Appends each plain reply
    to ``sessions[k]``; returns how many later turns had a clear first token."""
    checked = 0
    for k, report in reports:
        ids, margin = expected[k]
        if turn == 0:
            assert report.reused_tokens == 0 and report.output_ids == ids, k
        elif margin > MARGIN:
            assert report.output_ids[0] == ids[0], (k, turn, margin)
            checked += 1
        reply = tokenizer.decode(ids, skip_special_tokens=True)
        sessions[k].append({"role": "assistant", "content": reply})
    return checked


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module; its sibling modules (machine,
    workload, peers) import by bare name, as when it runs as a script."""
    import importlib.util
    import sys

    folder = ROOT / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module
