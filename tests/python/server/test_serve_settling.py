"""Settling through ``kvchat serve`` (docs/settling.md): the server settles a
session on the reply as its client received it (cut at a stop string, say),
so an agent loop's next turn prefills only its new messages; where the client
sends back something else (tool calls it parsed from the reply), the turn
still reuses the longest common prefix, on a hybrid model too.

One ``kvchat serve tiny:lfm2`` process, the ``openai`` client, raw replies
(the random model's own tokens, which mostly do not re-tokenize), each reply
checked against plain ``generate`` on the full conversation.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import LONG_SYSTEM, MAX_NEW, common_prefix, history_ids, reference_turn
from serving import KEY_A, reference_model, start_server

pytestmark = pytest.mark.server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def lfm2_server():
    yield from start_server("tiny:lfm2")


def _turn(server, client, messages, key, **extra):
    """One request with the tools: (reply text, usage)."""
    response = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        prompt_cache_key=key,
        tools=TOOLS,
        **extra,
    )
    return response.choices[0].message.content, response.usage


def _plain(model, tokenizer, messages, stop=None):
    """Plain generate's reply, cut at ``stop`` as the server cuts it; (text, prompt ids)."""
    text, prompt, _ = reference_turn(model, tokenizer, messages, tools=TOOLS)
    if stop is not None and stop in text:
        text = text[: text.index(stop)]
    return text, prompt


def test_an_agent_loop_prefills_only_its_new_messages(lfm2_server, tokenizer):
    server, model = lfm2_server, reference_model("lfm2")
    client = server.client(KEY_A)
    messages = [LONG_SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]

    # Turn 1: the client parses the reply as a tool call and sends that back.
    reply, usage = _turn(server, client, messages, "agent")
    assert reply == _plain(model, tokenizer, messages)[0]
    server.settled()
    predicted = history_ids(tokenizer, [*messages, {"role": "assistant", "content": reply}], TOOLS)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    # Turn 2: a prediction that missed; the common prefix is reused still.
    reply, usage = _turn(server, client, messages, "agent")
    want, prompt = _plain(model, tokenizer, messages)
    assert reply == want
    lcp = common_prefix(predicted, prompt)
    assert usage.prompt_tokens_details.cached_tokens >= 0.99 * lcp, (usage, lcp)
    server.settled()

    # Turns 3 and 4: the reply sent back as received, the first cut at a stop
    # string that matches (taken from the reply it would give), then one
    # that never does: each turn prefills only its new message.
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks!"}]
    full, _ = _plain(model, tokenizer, messages)
    words = re.findall(r"[A-Za-z]{3,}", full[len(full) // 3 :])
    assert words, f"no stop string to take from {full!r}"
    for stop in (words[0], "never-in-a-reply"):
        reply, _ = _turn(server, client, messages, "agent", stop=[stop])
        assert reply == _plain(model, tokenizer, messages, stop)[0], stop
        if stop == words[0]:
            assert len(reply) < len(full)  # cut where it matched
        server.settled()
        history = [*messages, {"role": "assistant", "content": reply}]
        messages = [*history, {"role": "user", "content": f"And after {stop}?"}]
        reply, usage = _turn(server, client, messages, "agent")
        assert reply == _plain(model, tokenizer, messages)[0], stop
        fixed = len(history_ids(tokenizer, history, TOOLS))
        assert usage.prompt_tokens_details.cached_tokens == fixed, (stop, usage, fixed)
        assert usage.prompt_tokens - fixed < 30  # the new message and the generation prompt
        server.settled()
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]

    metrics = server.get("/metrics").text
    settles = float(re.search(r"^kvchat_settles_total (\S+)", metrics, re.M).group(1))
    assert settles >= 3, metrics
    assert float(re.search(r"^kvchat_settle_misses_total (\S+)", metrics, re.M).group(1)) >= 1


def test_concurrent_clients_sharing_a_system_prompt_reply_exactly(lfm2_server, tokenizer):
    """Six clients, each its own conversation, send one long system prompt
    (and the tools) at once to the hybrid: whichever rows copy the prefix in
    flight up to another's checkpoint (or share it once committed), each
    reply is plain generate's, and the system prompt was computed fewer
    times than there are clients (/metrics' copied tokens, usage's cached)."""
    import threading

    server, model = lfm2_server, reference_model("lfm2")
    before = _metric(server, "kvchat_prefix_tokens_copied_total")
    conversations = {
        f"crowd-{k}": [LONG_SYSTEM, {"role": "user", "content": f"Plan trip number {k}."}]
        for k in range(6)
    }
    results, errors = {}, []

    def client_turn(key, messages):
        try:
            results[key] = _turn(server, server.client(KEY_A), messages, key)
        except Exception as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=client_turn, args=item) for item in conversations.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for key, messages in conversations.items():
        assert results[key][0] == _plain(model, tokenizer, messages)[0], key
    prompts = [_plain(model, tokenizer, m)[1] for m in conversations.values()]
    system = min(common_prefix(prompts[0], prompt) for prompt in prompts[1:])
    copied = _metric(server, "kvchat_prefix_tokens_copied_total") - before
    cached = sum(usage.prompt_tokens_details.cached_tokens for _, usage in results.values())
    assert copied + cached >= system, (copied, cached, system)
    server.settled()


def _metric(server, name: str) -> float:
    match = re.search(rf"^{name} (\S+)", server.get("/metrics").text, re.M)
    assert match, name
    return float(match.group(1))
