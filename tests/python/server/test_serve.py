"""kvchat serve end to end: a real uvicorn server in a subprocess on a free
127.0.0.1 port, driven by the official ``openai`` client and by httpx. Replies
are compared with plain ``model.generate`` on the full conversation (float64
tiny models, greedy), and ``cached_tokens`` with what the session reused."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import (
    LONG_SYSTEM,
    TESTS,
    doc_table_rows,
    model_for,
    reference_ids,
    reference_turn,
    user_message,
)
from kvchat.tiny import tiny_model, tiny_tokenizer
from serving import (
    KEY_A,
    KEY_B,
    MAX_NEW,
    Server,
    ask,
    auth,
    client_for,
    family_of,
    reference_model,
    start_server,
)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def llama_server():
    yield from start_server(
        "tiny:llama",
        "--api-key",
        KEY_B,
        "--max-context-length",
        "4096",
        "--max-body-bytes",
        "256KiB",
        "--max-sessions",
        "64",  # every session these tests make stays resident
    )


@pytest.fixture(scope="module")
def falcon_server():
    yield from start_server("tiny:falcon_h1")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("which", ["llama_server", "falcon_server"])
def test_an_eight_turn_conversation_is_exact_and_reports_cached_tokens(
    which, stream, tokenizer, request
):
    server = request.getfixturevalue(which)
    model = reference_model(family_of(server))
    client = client_for(server)
    key = f"conversation-{stream}"
    messages = [LONG_SYSTEM]
    for turn in range(8):
        messages.append(user_message(turn))
        reply, usage = ask(client, messages, key, stream)
        want, prompt, _ = reference_turn(model, tokenizer, messages, MAX_NEW)
        assert reply == want, f"turn {turn}"
        assert usage.prompt_tokens == prompt.numel()
        cached = usage.prompt_tokens_details.cached_tokens
        last = server.session(key)["last_turn"]
        assert cached == last["reused_tokens"]
        assert usage.completion_tokens == last["generated_tokens"]
        if turn == 0:  # nothing of its own yet; another conversation's system prompt, maybe
            assert last["reason"] in ("no_cache", "shared_prefix")
        else:
            assert cached > 0.9 * usage.prompt_tokens, f"turn {turn}: {last}"
        messages.append({"role": "assistant", "content": reply})


def test_a_tool_calling_conversation_is_exact_and_reuses(llama_server, tokenizer):
    model, client = reference_model("llama"), client_for(llama_server)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [LONG_SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]
    previous_prompt = 0
    for turn in range(6):
        reply, usage = ask(client, messages, "agent", stream=turn % 2 == 1, tools=tools)
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        assert reply == tokenizer.decode(
            reference_ids(model, ids[0], MAX_NEW), skip_special_tokens=True
        )
        cached = usage.prompt_tokens_details.cached_tokens
        if turn:
            # Everything the last turn's prompt held is reused, tool calls included.
            assert cached >= previous_prompt, f"turn {turn}"
        previous_prompt = usage.prompt_tokens
        if turn % 2 == 0:  # the model "called" a tool, and the tool answered
            call = {
                "id": f"call_{turn}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": "sunny"})
        else:
            messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": f"And tomorrow ({turn})?"})


def test_eight_concurrent_clients_get_their_own_exact_replies(llama_server, tokenizer):
    model = reference_model("llama")
    results: dict[int, list] = {}

    def conversation(i: int) -> None:
        client = client_for(llama_server)
        messages = [{"role": "system", "content": f"You are assistant number {i}."}]
        replies = []
        for turn in range(3):
            messages.append(user_message(turn + i))
            reply, usage = ask(client, messages, f"client-{i}", stream=(i + turn) % 2 == 0)
            replies.append((list(messages), reply, usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": reply})
        results[i] = replies

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(results) == list(range(8))
    for i, replies in results.items():
        for turn, (messages, reply, cached) in enumerate(replies):
            want, _, _ = reference_turn(model, tokenizer, messages, MAX_NEW)
            assert reply == want, f"client {i} turn {turn}"
            assert (cached > 0) == (turn > 0)


def test_a_client_that_disconnects_stops_generation_and_the_session_stays_exact(
    llama_server, tokenizer
):
    model = reference_model("llama")
    messages = [LONG_SYSTEM, user_message(0)]
    body = {
        "model": "tiny:llama",
        "messages": messages,
        "max_tokens": 3000,
        "min_tokens": 3000,
        "stream": True,
        "prompt_cache_key": "leaver",
    }
    received = ""
    with httpx.stream(
        "POST",
        f"{llama_server.url}/v1/chat/completions",
        json=body,
        headers=auth(KEY_A),
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                received += delta.get("content") or ""
                if len(received) > 20:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60
    while llama_server.session("leaver")["requests"] < 1:
        assert time.monotonic() < deadline, "the cancelled turn was never committed"
        time.sleep(0.1)
    last = llama_server.session("leaver")["last_turn"]
    assert last["generated_tokens"] < 200, last  # stopped within a few tokens, not 3000

    # The next turn starts from what the session holds and equals plain generate.
    history = llama_server.session("leaver")["history"]
    follow = [*history, user_message(1)]
    reply, usage = ask(client_for(llama_server), follow, "leaver", stream=False)
    want, _, _ = reference_turn(model, tokenizer, follow, MAX_NEW)
    assert reply == want
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_without_a_key_a_conversation_continues_its_own_session(llama_server, tokenizer):
    client = client_for(llama_server)
    # A conversation no other test has, so no other session holds more of it.
    system = {"role": "system", "content": LONG_SYSTEM["content"] + " (auto)"}
    messages, sessions = [system], []
    for turn in range(3):
        messages.append(user_message(turn))
        raw = client.chat.completions.with_raw_response.create(
            model="tiny:llama", messages=messages, max_tokens=MAX_NEW, temperature=0
        )
        sessions.append(raw.headers["x-session-id"])
        completion = raw.parse()
        if turn:
            assert completion.usage.prompt_tokens_details.cached_tokens > 0
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
    assert len(set(sessions)) == 1 and sessions[0].startswith("auto-")
    # A fork of an earlier point is a conversation of its own: it never takes
    # over the session (which would destroy its cache), and that one continues.
    fork = [*messages[:3], {"role": "user", "content": "Something else entirely."}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny:llama", messages=fork, max_tokens=MAX_NEW, temperature=0
    )
    assert raw.headers["x-session-id"] != sessions[0]
    # It starts from the longest prefix another session holds (the system prompt).
    assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0
    messages.append(user_message(3))
    raw = client.chat.completions.with_raw_response.create(
        model="tiny:llama", messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    assert raw.headers["x-session-id"] == sessions[0]
    last = llama_server.session(sessions[0])["last_turn"]
    assert last["reason"] == "extend", last


def test_api_keys_namespace_sessions(llama_server):
    client_a, client_b = client_for(llama_server, KEY_A), client_for(llama_server, KEY_B)
    ask(client_a, [user_message(0)], "mine", stream=False)
    llama_server.settled()  # the session's own settle may still grow its cache
    before = llama_server.session("mine", KEY_A)
    assert "mine" in [s["id"] for s in llama_server.get("/v1/sessions", KEY_A).json()["data"]]
    assert "mine" not in [s["id"] for s in llama_server.get("/v1/sessions", KEY_B).json()["data"]]
    assert llama_server.get("/v1/sessions/mine", KEY_B).status_code == 404
    deleted = httpx.delete(f"{llama_server.url}/v1/sessions/mine", headers=auth(KEY_B))
    assert deleted.status_code == 404
    # The same key name from B is B's own session: A's is untouched, and B
    # never starts from A's cache, not even from a shared system prompt.
    _, usage = ask(client_a, [LONG_SYSTEM, user_message(2)], "a-long", stream=False)
    _, usage = ask(client_b, [LONG_SYSTEM, user_message(3)], "mine", stream=False)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert llama_server.session("mine", KEY_A) == before
    ok = httpx.delete(f"{llama_server.url}/v1/sessions/mine", headers=auth(KEY_A))
    assert ok.status_code == 200 and ok.json()["deleted"] is True
    assert llama_server.get("/v1/sessions/mine", KEY_A).status_code == 404
    assert llama_server.get("/v1/sessions/mine", KEY_B).status_code == 200


def _metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed as Prometheus text: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_are_prometheus_text(llama_server):
    client = client_for(llama_server)
    ask(client, [user_message(5)], "metrics", stream=False)
    before = _metrics(llama_server)
    _, usage = ask(
        client,
        [user_message(5), {"role": "assistant", "content": "ok"}, user_message(6)],
        "metrics",
        stream=False,
    )
    after = _metrics(llama_server)

    def grew(name):
        return after[name] - before.get(name, 0.0)

    # One more request, with the prompt tokens it reported, each either reused or prefilled.
    assert grew("kvchat_requests_total{status=200}") == 1
    assert grew("kvchat_prompt_tokens_total") == usage.prompt_tokens
    reused = usage.prompt_tokens_details.cached_tokens
    assert grew("kvchat_reused_tokens_total") == reused > 0
    assert grew("kvchat_prefilled_tokens_total") == usage.prompt_tokens - reused
    assert grew("kvchat_ttft_seconds_count") == 1
    assert 0 <= after["kvchat_hit_rate"] <= 1
    assert after["kvchat_tracked_sessions"] >= 1
    assert after["kvchat_resident_bytes"] > 0
    assert "kvchat_evictions_total" in after
    models = llama_server.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny:llama"


# ------------------------------------------------------------------ errors
def _chat_body(**fields) -> dict:
    return {"model": "tiny:llama", "messages": [user_message(0)], "max_tokens": 4, **fields}


def _raw(**fields) -> dict:
    """A request whose JSON may hold lone surrogates (escaped, as JSON allows),
    and lists nested deeper than json.dumps would write (``_nested``)."""
    text = json.dumps(_chat_body(**fields))
    text = re.sub(r'"nested-(\d+)"', lambda m: "[" * int(m[1]) + "1" + "]" * int(m[1]), text)
    return {"content": text.encode()}


def _nested(depth: int) -> str:
    """A list nested ``depth`` deep, as ``_raw`` writes it."""
    return f"nested-{depth}"


def _tool(name: str = "get_weather", parameters=None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def _tool_call_message(call) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# docs/serving.md "Bad requests" row -> (request, status, error code, param)
SERVE_ERROR_CASES = {
    "malformed JSON": [({"content": b"{not json"}, 400, "invalid_json", None)],
    "a field of the wrong type": [
        ({"json": _chat_body(temperature="hot")}, 400, "invalid_value", "temperature"),
        ({"json": _chat_body(messages="hi")}, 400, "invalid_value", "messages"),
        ({"json": _chat_body(stream="yes")}, 400, "invalid_value", "stream"),
        ({"json": _chat_body(max_tokens=0)}, 400, "invalid_value", "max_tokens"),
        ({"json": [1, 2]}, 400, "invalid_value", None),
        *(
            (
                {"json": _chat_body(), "headers": {"X-Session-ID": value}},
                400,
                "invalid_value",
                "X-Session-ID",
            )
            # Too long, a latin-1 byte (never echoed back), a tab inside.
            for value in ("x" * 600, "caf\xe9".encode("latin-1"), "a\tb")
        ),
    ],
    "an unknown `model`": [({"json": _chat_body(model="gpt-9")}, 404, "model_not_found", "model")],
    "prompt + `max_tokens` over": [
        ({"json": _chat_body(max_tokens=10**6)}, 400, "context_length_exceeded", "messages"),
        (
            {"json": _chat_body(max_completion_tokens=10**6)},
            400,
            "context_length_exceeded",
            "messages",
        ),
    ],
    "a missing or wrong API key": [
        ({"json": _chat_body(), "key": None}, 401, "invalid_api_key", None),
        ({"json": _chat_body(), "key": "wrong"}, 401, "invalid_api_key", None),
    ],
    "a field kvchat cannot serve": [
        ({"json": _chat_body(n=2)}, 400, "invalid_value", "n"),
        ({"json": _chat_body(logprobs=True)}, 400, "invalid_value", "logprobs"),
        ({"json": _chat_body(frobnicate=1)}, 400, "unknown_parameter", "frobnicate"),
        (
            {
                "json": _chat_body(
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
                            ],
                        }
                    ]
                )
            },
            400,
            "invalid_value",
            "messages",
        ),
    ],
    "a `tool_choice` or `response_format` that cannot be constrained": [
        ({"json": _chat_body(**extra)}, 400, "invalid_value", param)
        for extra, param in [
            (dict(tool_choice="required"), "tool_choice"),
            (
                dict(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "x"}}),
                "tool_choice",
            ),
            (dict(response_format={"type": "xml"}), "response_format"),
            (
                dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
                "response_format",
            ),
            (
                dict(
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                    }
                ),
                "response_format",
            ),
            (dict(tools=[_tool()], parallel_tool_calls="yes"), "parallel_tool_calls"),
            (dict(tools=[_tool()], tool_choice="required", min_tokens=3), "min_tokens"),
            (dict(tools=[_tool()], tool_choice="sometimes"), "tool_choice"),
        ]
    ],
    "a body over `--max-body-bytes`": [
        (
            {"json": _chat_body(messages=[{"role": "user", "content": "x" * 300_000}])},
            413,
            "request_too_large",
            None,
        ),
    ],
    "an unknown session": [
        ({"path": "/v1/sessions/ghost", "method": "GET"}, 404, "session_not_found", "session_id")
    ],
    "a `prompt_cache_key` or `user` that cannot be an HTTP header": [
        ({"json": _chat_body(stream=stream, **{field: value})}, 400, "invalid_value", field)
        for value, field, stream in [
            ("\u2603", "prompt_cache_key", False),
            ("\u2603", "user", True),
            ("a\nb", "prompt_cache_key", True),
            ("a\nb", "user", False),
            (" ", "prompt_cache_key", False),
            (" ", "user", True),
            ("tab\tkey", "prompt_cache_key", False),
        ]
    ],
    "JSON nested too deeply": [
        ({"content": b"[" * 100_000 + b"]" * 100_000}, 400, "invalid_json", None),
        (
            _raw(messages=[{**user_message(0), "name": _nested(950)}]),
            400,
            "invalid_value",
            "messages",
        ),
        (_raw(tools=[_tool(parameters=_nested(200))]), 400, "invalid_value", "tools"),
        (
            _raw(chat_template_kwargs={"deep": _nested(100)}),
            400,
            "invalid_value",
            "chat_template_kwargs",
        ),
    ],
    "text that is not valid Unicode": [
        (_raw(messages=[{**user_message(0), "name": "\ud800"}]), 400, "invalid_value", "messages"),
        (
            _raw(messages=[{**user_message(0), "name": "\ud800"}], prompt_cache_key="surrogate"),
            400,
            "invalid_value",
            "messages",
        ),
        (_raw(tools=[_tool(name="\ud800")]), 400, "invalid_value", "tools"),
        (_raw(stop=["\ud800"]), 400, "invalid_value", "stop"),
        (_raw(chat_template_kwargs={"x": "\udfff"}), 400, "invalid_value", "chat_template_kwargs"),
        (_raw(**{"\ud800": 1}), 400, "unknown_parameter", "\\ud800"),
    ],
    "messages the chat template refuses": [
        (_raw(messages=[_tool_call_message(1)]), 400, "invalid_value", "messages"),
        (_raw(messages=[_tool_call_message({})]), 400, "invalid_value", "messages"),
        (_raw(messages=[_tool_call_message({"function": 3})]), 400, "invalid_value", "messages"),
        (_raw(tools=[{"type": "function"}]), 400, "invalid_value", "tools"),
        (_raw(tools=[1]), 400, "invalid_value", "tools"),
    ],
    "`chat_template_kwargs` that are no template variable": [
        (_raw(chat_template_kwargs={name: value}), 400, "invalid_value", "chat_template_kwargs")
        for name, value in [
            ("chat_template", "{{ raise_exception('no') }}"),
            ("chat_template", "{% for %}"),
            ("tokenize", True),
            ("add_generation_prompt", False),
            ("continue_final_message", True),
            ("return_tensors", "pt"),
            ("return_whatever", 1),
            ("return_max_context_length", True),  # names the limit; no context-length error
            ("tools", []),
            ("documents", []),
            ("messages", []),
            ("tokenizer_kwargs", {}),
            ("eos_token", "x" * 100_000),
            ("bos_token", "x"),
            ("additional_special_tokens", []),
            ("self", 1),
        ]
    ],
}


def _send(server: Server, request: dict) -> httpx.Response:
    request = dict(request)
    key = request.pop("key", KEY_A)
    method = request.pop("method", "POST")
    path = request.pop("path", "/v1/chat/completions")
    headers = {**auth(key), "Content-Type": "application/json", **request.pop("headers", {})}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **request)


@pytest.mark.parametrize("row", list(SERVE_ERROR_CASES))
def test_bad_requests_get_openai_errors_and_touch_nothing(row, llama_server):
    ask(client_for(llama_server), [user_message(7)], "witness", stream=False)
    llama_server.settled()
    witness = llama_server.session("witness")
    sessions = llama_server.get("/v1/sessions").json()["data"]
    for request, status, code, param in SERVE_ERROR_CASES[row]:
        response = _send(llama_server, request)
        assert response.status_code == status, (row, request, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == (code, param), error
        assert error["message"]
        if row == "prompt + `max_tokens` over":  # named as the request named it
            # max_completion_tokens, OpenAI's newer name, wins over max_tokens (4 here).
            names = ("max_completion_tokens", "max_tokens")
            field = next(name for name in names if name in request["json"])
            assert f"plus {field}=1000000 exceeds max_context_length=4096" in error["message"]
            assert error["message"].endswith(f"send fewer or shorter messages or a smaller {field}")
            assert "max_new_tokens" not in error["message"]
    # The server is up, and no session was created or changed.
    assert llama_server.get("/health").status_code == 200
    assert llama_server.session("witness") == witness
    assert llama_server.get("/v1/sessions").json()["data"] == sessions


def test_too_many_requests_at_once_get_429():
    server = Server("tiny:llama", "--max-pending", "1")
    try:
        body = _chat_body(max_tokens=3000, min_tokens=3000, stream=True, prompt_cache_key="long")
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, timeout=60
        ) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            second = server.post("/v1/chat/completions", key=None, json=_chat_body())
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
        # Once the first is gone, requests are served again.
        deadline = time.monotonic() + 60
        while (
            third := server.post("/v1/chat/completions", key=None, json=_chat_body())
        ).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert third.status_code == 200
    finally:
        server.stop()


def test_a_model_that_fails_gets_500_and_the_session_keeps_its_history(tokenizer):
    from fastapi.testclient import TestClient
    from kvchat import SessionManager
    from kvchat.serve import ServeConfig, create_app

    model = model_for("llama")
    manager = SessionManager(model, tokenizer, isolate_namespaces=True)
    app = create_app(manager, ServeConfig(model_name="tiny"))
    client = TestClient(app, raise_server_exceptions=False)
    body = {"model": "tiny", "messages": [user_message(0)], "max_tokens": 4, "user": "u"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    history = client.get("/v1/sessions/u").json()["history"]
    original = model.generate

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    model.generate = broken
    try:
        failed = client.post("/v1/chat/completions", json={**body, "messages": history})
    finally:
        model.generate = original
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    session = client.get("/v1/sessions/u").json()
    assert session["history"] == history and session["cached_tokens"] == 0
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_every_readme_bad_request_row_is_covered():
    rows = doc_table_rows("docs/serving.md", "## Bad requests")
    extra = {
        "more requests at once than `--max-pending`": "test_too_many_requests_at_once_get_429",
        "the model fails": "test_a_model_that_fails_gets_500_and_the_session_keeps_its_history",
        "a `DELETE` the shared store cannot carry out": (
            "test_redis_tier.py::test_a_delete_the_store_cannot_carry_out_is_a_503_until_it_can"
        ),
        "`/v1/responses`: a `previous_response_id` that does not exist": (
            "test_serve_responses.py::test_stored_responses_are_each_keys_own"
        ),
        "`/v1/responses`: a field it cannot serve": (
            "test_serve_responses.py::test_bad_responses_requests_get_openai_errors_and_touch_nothing"
        ),
        "a grammar llguidance refuses (when built": (
            "test_serve_agents.py::test_a_grammar_llguidance_refuses_is_a_400_and_the_session_keeps_its_cache"
        ),
        "a grammar llguidance refuses while decoding": (
            "test_serve_agents.py::test_a_grammar_refused_while_decoding_ends_the_reply_as_a_400"
        ),
        "a tool kvchat cannot call": (
            "test_serve_agents.py::test_bad_tools_are_refused_through_the_sdk_and_touch_no_session"
        ),
        'a forced call (or `"auto"` beside': (
            "test_serve_agents.py::test_a_special_token_in_an_enum_or_key_is_refused_by_name"
        ),
        "`/v1/completions`:": (
            "test_serve_completions.py::test_bad_completions_get_openai_errors_and_touch_nothing"
        ),
    }
    assert len(rows) == len(SERVE_ERROR_CASES) + len(extra)
    for row in rows:
        keys = [k for k in [*SERVE_ERROR_CASES, *extra] if row.startswith(k)]
        assert len(keys) == 1, f"docs/serving.md row {row!r} has no test"
    for test in extra.values():  # each named test exists
        file, _, name = test.rpartition("::")
        (path,) = TESTS.rglob(file or Path(__file__).name)  # in whichever test folder
        source = path.read_text("utf-8")
        assert f"def {name}(" in source, test


def test_idle_sessions_expire_but_never_mid_turn():
    server = Server("tiny:llama", "--session-ttl", "1")
    try:
        body = _chat_body(prompt_cache_key="idle")
        assert server.post("/v1/chat/completions", key=None, json=body).status_code == 200
        long = _chat_body(max_tokens=3000, min_tokens=3000, stream=True, prompt_cache_key="busy")
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=long, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            deadline = time.monotonic() + 30
            while server.get("/v1/sessions/idle", key=None).status_code == 200:
                assert time.monotonic() < deadline, "the idle session never expired"
                time.sleep(0.2)
            # Idle for longer than the TTL, but in a turn: still there.
            time.sleep(1.5)
            assert server.get("/v1/sessions/busy", key=None).status_code == 200
        metrics = server.get("/metrics", key=None).text
        assert "kvchat_sessions_expired_total" in metrics
        expired = re.search(r"^kvchat_sessions_expired_total (\S+)$", metrics, re.M)
        assert float(expired.group(1)) >= 1
    finally:
        server.stop()


def _status(server: Server, body: dict) -> int | str:
    """The response's status, or the name of what went wrong on the way."""
    try:
        return server.post("/v1/chat/completions", key=None, json=body).status_code
    except httpx.HTTPError as error:
        return type(error).__name__


def test_a_session_key_that_cannot_be_a_header_runs_nothing_and_leaks_no_slot():
    server = Server("tiny:llama", "--max-pending", "1")
    try:
        statuses = {}
        for stream in (False, True):
            for field in ("prompt_cache_key", "user"):
                for value in ("\u2603", "a\nb", " "):
                    body = _chat_body(stream=stream, **{field: value})
                    statuses[stream, field, value] = _status(server, body)
        # Nothing ran: no session, no turn counted.
        sessions = server.get("/v1/sessions", key=None).json()["data"]
        counted = re.search(
            r'^kvchat_requests_total\{status="200"\} (\S+)$', server.get("/metrics").text, re.M
        )
        # And no slot was kept: with --max-pending 1, every request after them runs.
        after = []
        for i, stream in enumerate((True, False, True)):
            body = _chat_body(stream=stream, prompt_cache_key=f"after-{i}")
            after.append(_status(server, body))
        assert statuses == dict.fromkeys(statuses, 400)
        assert sessions == [] and counted is None
        assert after == [200, 200, 200]
    finally:
        server.stop()


def _slow_reader(
    server: Server, body: dict, path: str = "/v1/chat/completions", key: str | None = None
) -> socket.socket:
    """A request whose reader holds a tiny receive window and reads nothing
    until told: the server's writes then wait on it (small segments keep the
    server's send buffer small, as over a real network)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(120)
    sock.connect(("127.0.0.1", server.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_a_session_never_expires_while_its_reply_is_still_being_read():
    server = Server("tiny:llama", "--session-ttl", "1")
    try:
        # About 400 kB of events: more than the buffers on the way hold
        # (uvicorn keeps 64 kB, the kernel grows its send buffer to 256 kB here).
        body = _chat_body(max_tokens=1600, min_tokens=1600, stream=True, prompt_cache_key="slow")
        sock = _slow_reader(server, body)
        try:
            first = sock.recv(2048)
            assert first.startswith(b"HTTP/1.1 200"), first
            # The turn ends (it is committed: the lease is given back) long
            # before this reader has read its reply.
            deadline = time.monotonic() + 120
            while True:
                response = server.get("/v1/sessions/slow", key=None)
                assert response.status_code == 200, "expired while its reply is being sent"
                if response.json()["requests"] >= 1:
                    break
                assert time.monotonic() < deadline, "the turn never ended"
                time.sleep(0.1)
            time.sleep(2.5)  # well past the TTL, the reply still unread
            response = server.get("/v1/sessions/slow", key=None)
            assert response.status_code == 200, "expired while its reply is being sent"
            assert len(response.json()["history"]) == 2
            rest = bytearray(first)
            while chunk := sock.recv(65536):
                rest += chunk
            assert b"data: [DONE]" in rest[-100:], bytes(rest[-200:])  # in its last chunk
        finally:
            sock.close()
        # Read to its end, it is idle from then on, and expires.
        deadline = time.monotonic() + 30
        while server.get("/v1/sessions/slow", key=None).status_code == 200:
            assert time.monotonic() < deadline, "never expired once its reply was read"
            time.sleep(0.2)
    finally:
        server.stop()


def test_a_session_stays_in_use_until_its_reply_has_been_sent():
    """A client that pauses longer than the TTL while the last events of its
    stream are still being sent keeps its session: it is idle only from when
    the reply's last byte was sent, and the next turn on it reuses its cache."""
    # Every chunk carries the model's name. With a 120 kB one, the reply is
    # 720 kB, and its chunks after the turn ends (its finish_reason, its usage)
    # wait for room in the buffers on the way (uvicorn's 64 kB, the kernel's
    # send buffer, this reader's tiny window), which the chunks before filled.
    name = "m" * 120_000
    server = Server("tiny:llama", "--session-ttl", "1", "--served-model-name", name)
    try:
        body = _chat_body(
            model=name,
            max_tokens=3,
            min_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            prompt_cache_key="slow",
        )
        sock = _slow_reader(server, body)
        try:
            received = bytearray()
            # Read a little at a time until the turn has ended (the server
            # counts a request once it has finished its turn) ...
            while not _requests_counted(server):
                chunk = sock.recv(16384)
                assert chunk, "the reply ended before its turn did"
                received += chunk
            # ... then pause past the TTL and a sweep, the reply's end unsent,
            # and read the rest.
            time.sleep(2.5)
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
        assert received.startswith(b"HTTP/1.1 200"), bytes(received[:200])
        assert received.count(b'"finish_reason": "length"') == 1
        assert b"data: [DONE]" in received[-100:], bytes(received[-200:])  # its last event
        # The reply's last byte was sent a moment ago: the session is there,
        # and the next turn on it reuses its cache.
        assert server.get("/v1/sessions/slow", key=None).status_code == 200
        messages = [user_message(0), {"role": "assistant", "content": _reply_text(received)}]
        messages.append(user_message(1))
        body = _chat_body(model=name, messages=messages, prompt_cache_key="slow")
        response = server.post("/v1/chat/completions", key=None, json=body)
        assert response.status_code == 200, response.text[:500]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.stop()


def _requests_counted(server: Server) -> bool:
    """Whether the server has counted a finished request (/metrics)."""
    metrics = server.get("/metrics", key=None).text
    return re.search(r'^kvchat_requests_total\{status="200"\} 1\.0$', metrics, re.M) is not None


def _reply_text(stream: bytes) -> str:
    """The content of a chat completion's server-sent chunks."""
    text = ""
    for line in bytes(stream).split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


SLOW_STREAMS = {
    # About 400 kB of events each, more than the buffers on the way hold.
    "completions": (
        "/v1/completions",
        {"model": "tiny:llama", "prompt": "Once", "max_tokens": 1600, "min_tokens": 1600},
        b"data: [DONE]",
    ),
    "responses": (
        "/v1/responses",
        {"model": "tiny:llama", "input": "Once", "max_output_tokens": 1600, "min_tokens": 1600},
        b"event: response.incomplete",  # max_output_tokens reached, as OpenAI says
    ),
}


@pytest.mark.parametrize("stream", sorted(SLOW_STREAMS))
def test_a_slow_reader_of_a_stream_holds_up_no_other_request(llama_server, stream):
    """A client that reads its text completion or Responses stream slowly
    holds its own connection only: the turn ends and commits, another
    client's request runs meanwhile, and the slow one still gets every event
    to the last."""
    path, body, last = SLOW_STREAMS[stream]
    sock = _slow_reader(llama_server, {**body, "stream": True}, path, KEY_A)
    try:
        first = sock.recv(2048)
        assert first.startswith(b"HTTP/1.1 200"), first
        other = llama_server.post("/v1/chat/completions", json=_chat_body())
        assert other.status_code == 200, other.text
        time.sleep(1)  # the slow reader has still read nothing more
        rest = bytearray(first)
        while chunk := sock.recv(65536):
            rest += chunk
        assert len(rest) > 300_000, len(rest)  # the buffers on the way were full
        # The stream's last event is its end (the last "data:" or "event:" line).
        kind = last.split(b" ")[0] + b" "
        assert rest[rest.rindex(kind) :].startswith(last), bytes(rest[-300:])
    finally:
        sock.close()


def test_a_session_id_with_a_slash_is_read_and_deleted_by_its_owner_alone(llama_server):
    client = client_for(llama_server)
    url = llama_server.url

    def delete(path: str, key: str) -> httpx.Response:
        return httpx.delete(f"{url}{path}", headers=auth(key), timeout=60)

    for path in ("/v1/sessions/team/a/b", "/v1/sessions/team%2Fa%2Fb", "/v1/sessions/team/a%2Fb"):
        ask(client, [user_message(0)], "team/a/b", stream=False)
        # Another key never reaches it, by any spelling.
        assert llama_server.get(path, KEY_B).status_code == 404
        assert delete(path, KEY_B).status_code == 404
        listed = [s["id"] for s in llama_server.get("/v1/sessions", KEY_A).json()["data"]]
        assert "team/a/b" in listed
        got = llama_server.get(path, KEY_A)
        assert got.status_code == 200, (path, got.text)
        assert got.json()["id"] == "team/a/b" and len(got.json()["history"]) == 2
        deleted = delete(path, KEY_A)
        assert deleted.status_code == 200, (path, deleted.text)
        assert deleted.json() == {"id": "team/a/b", "object": "session.deleted", "deleted": True}
        assert llama_server.get(path, KEY_A).status_code == 404
    # Other routes are what they were.
    assert llama_server.get("/v1/sessions/", KEY_A).status_code == 404


def test_a_fork_never_takes_over_a_session_its_client_continues_by_header(llama_server):
    client = client_for(llama_server)
    system = {"role": "system", "content": LONG_SYSTEM["content"] + " (takeover)"}
    messages = [system, user_message(0)]

    def ask(messages, session=None):
        headers = {"X-Session-ID": session} if session else None
        raw = client.chat.completions.with_raw_response.create(
            model="tiny:llama",
            messages=messages,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_headers=headers,
        )
        completion = raw.parse()
        return raw.headers["x-session-id"], completion.choices[0].message.content, completion.usage

    session, reply, _ = ask(messages)
    assert session.startswith("auto-")
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    # The client continues its session by the X-Session-ID it was given.
    same, reply, usage = ask(messages, session)
    assert same == session
    messages.append({"role": "assistant", "content": reply})
    history = llama_server.session(session)["history"]
    assert history == messages
    # Another request forks the older conversation: a session of its own.
    fork = [*messages[:3], {"role": "user", "content": "Something else entirely."}]
    forked, _, _ = ask(fork)
    assert forked != session
    assert llama_server.session(session)["history"] == history
    # The first client's next turn reuses its whole previous prompt and reply.
    messages.append(user_message(2))
    again, _, next_usage = ask(messages, session)
    assert again == session
    last = llama_server.session(session)["last_turn"]
    assert last["reason"] == "extend", last
    assert next_usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens
    # A request by messages alone continues it too, from where it now is.
    messages.append(
        {"role": "assistant", "content": llama_server.session(session)["history"][-1]["content"]}
    )
    messages.append(user_message(3))
    by_messages, _, _ = ask(messages)
    assert by_messages == session
    assert llama_server.session(session)["last_turn"]["reason"] == "extend"


def test_a_tiny_temperature_answers_greedily(llama_server, tokenizer):
    model = reference_model("llama")
    messages = [user_message(4)]
    want, _, _ = reference_turn(model, tokenizer, messages, MAX_NEW)
    for temperature in (5e-324, 1e-300, 1e-6):
        body = {**_chat_body(messages=messages, max_tokens=MAX_NEW), "temperature": temperature}
        response = llama_server.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == want


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_a_client_template_is_refused_fast_and_costs_no_memory():
    server = Server("tiny:llama")
    try:
        # 259 bytes that once rendered a 6M-token prompt before any limit was checked.
        template = "{% for i in range(99999) %}{% for j in range(60) %}x {% endfor %}{% endfor %}"
        body = {
            "model": "tiny:llama",
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": template},
        }
        server.post("/v1/chat/completions", key=None, json=_chat_body())  # warm up
        server.settled()  # the warm-up's session, as it stays
        sessions = server.get("/v1/sessions", key=None).json()["data"]
        before = _rss_mb(server.process.pid)
        # Refused before anything renders (so no time limit is asserted: the
        # memory says whether the template ran).
        response = server.post("/v1/chat/completions", key=None, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "chat_template_kwargs")
        assert "chat_template" in error["message"]
        assert _rss_mb(server.process.pid) - before < 50
        assert server.get("/v1/sessions", key=None).json()["data"] == sessions
    finally:
        server.stop()


def _gauge(server: Server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_server_process_tracks_only_sessions_that_exist():
    """A real `kvchat serve`, under new keys every request: refused turns
    (over the context, refused by the template), sessions made then deleted,
    keyless ones too. Its tables then hold only the one session kept
    (``kvchat_tracked_sessions`` in /metrics)."""
    server = Server("tiny:llama", "--max-context-length", "256", "--session-ttl", "3600")
    try:
        body = {"model": "tiny:llama", "messages": [user_message(0)], "max_tokens": 2}
        call = _tool_call_message({})
        for i in range(10):
            for refused in (
                {**body, "max_tokens": 10**6, "user": f"r{i}"},
                {**body, "messages": [call], "user": f"t{i}"},
                {**body, "messages": [call, user_message(i)]},
            ):
                response = server.post("/v1/chat/completions", key=f"k{i}", json=refused)
                assert response.status_code == 400, response.text
            made = server.post("/v1/chat/completions", key=f"k{i}", json={**body, "user": f"d{i}"})
            assert made.status_code == 200, made.text
            deleted = httpx.delete(
                f"{server.url}/v1/sessions/d{i}", headers=auth(f"k{i}"), timeout=60
            )
            assert deleted.status_code == 200, deleted.text
            made = server.post(
                "/v1/chat/completions", key=f"k{i}", json={**body, "messages": [user_message(i)]}
            )
            assert made.status_code == 200, made.text
            session = made.headers["x-session-id"]
            deleted = httpx.delete(
                f"{server.url}/v1/sessions/{session}", headers=auth(f"k{i}"), timeout=60
            )
            assert deleted.status_code == 200, deleted.text
        kept = server.post("/v1/chat/completions", key="keeper", json={**body, "user": "kept"})
        assert kept.status_code == 200, kept.text
        assert _gauge(server, "kvchat_sessions") == 1
        assert _gauge(server, "kvchat_tracked_sessions") == 1
    finally:
        server.stop()


def test_the_idle_and_routing_tables_hold_only_sessions_that_exist(tokenizer):
    from fastapi.testclient import TestClient
    from kvchat import SessionManager
    from kvchat.serve import ServeConfig, create_app

    manager = SessionManager(
        model_for("llama"), tokenizer, isolate_namespaces=True, max_context_length=256
    )
    app = create_app(manager, ServeConfig(model_name="tiny", session_ttl=3600))
    client = TestClient(app, raise_server_exceptions=False)
    body = {"model": "tiny", "messages": [user_message(0)], "max_tokens": 2}
    for i in range(40):
        # Refused after the session was named: too long for the context.
        refused = client.post(
            "/v1/chat/completions", json={**body, "max_tokens": 10**6, "user": f"r{i}"}
        )
        assert refused.status_code == 400, refused.text
        # Refused by the template.
        call = _tool_call_message({})
        refused = client.post(
            "/v1/chat/completions", json={**body, "messages": [call], "user": f"t{i}"}
        )
        assert refused.status_code == 400, refused.text
        # The same, keyless: an automatic session named, never made.
        refused = client.post(
            "/v1/chat/completions", json={**body, "messages": [call, user_message(i)]}
        )
        assert refused.status_code == 400, refused.text
        # Made, then deleted.
        assert (
            client.post("/v1/chat/completions", json={**body, "user": f"d{i}"}).status_code == 200
        )
        assert client.delete(f"/v1/sessions/d{i}").status_code == 200
        # Made automatically, then deleted.
        made = client.post("/v1/chat/completions", json={**body, "messages": [user_message(i)]})
        assert made.status_code == 200
        assert client.delete(f"/v1/sessions/{made.headers['x-session-id']}").status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "user": "kept"}).status_code == 200
    assert manager.sessions() == ["open/kept"]
    assert app.state.expiry.tracked() <= {"open/kept"}
    assert app.state.router.tracked() <= {"open/kept"}


def test_a_long_first_word_streams_token_by_token_from_a_server_process(tmp_path):
    """A checkpoint whose replies are one long word (every token holding
    whitespace, or not whole characters on its own, is suppressed), served by
    a real `kvchat serve`: the stream sends each token's text as its own
    piece, so the first reaches the client one token after the prefill, not
    with the reply's last token; joined, the pieces are the whole reply."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", dtype=torch.float64)
    vocab = model.config.vocab_size
    split = [
        i
        for i in range(len(tokenizer))
        if any(c.isspace() or c == "\ufffd" for c in tokenizer.decode([i]))
    ]
    model.generation_config.suppress_tokens = sorted(
        {*split, *range(len(tokenizer), vocab), tokenizer.eos_token_id}
    )
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    server = Server(str(tmp_path))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        kwargs = dict(model=str(tmp_path), messages=[user_message(0)], max_tokens=24)
        pieces = []
        for chunk in client.chat.completions.create(**kwargs, stream=True, temperature=0):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        whole = client.chat.completions.create(**kwargs, temperature=0)
        reply = whole.choices[0].message.content
        assert "".join(pieces) == reply
        assert reply and not any(c.isspace() for c in reply), reply
        assert whole.usage.completion_tokens == 24
        assert len(pieces) == 24, pieces  # one piece per token: none waited for a space
    finally:
        server.stop()


def test_the_models_own_template_refusing_a_message_is_a_400_from_a_server_process(tmp_path):
    """A checkpoint whose chat template calls ``raise_exception`` on a system
    message (as Gemma's and Mistral's did): a real `kvchat serve` answers that
    request 400 on ``messages`` with the template's words, keeps no session
    of it, and serves the next request."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}" + tokenizer.chat_template
    )
    tiny_model("llama", dtype=torch.float64).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    server = Server(str(tmp_path))
    try:
        body = {"model": str(tmp_path), "max_tokens": 2, "user": "s"}
        refused = server.post(
            "/v1/chat/completions",
            key=None,
            json={
                **body,
                "messages": [{"role": "system", "content": "Be brief."}, user_message(0)],
            },
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "messages"), error
        assert "System role not supported" in error["message"]
        assert server.get("/v1/sessions", key=None).json()["data"] == []
        served = server.post(
            "/v1/chat/completions", key=None, json={**body, "messages": [user_message(0)]}
        )
        assert served.status_code == 200, served.text
    finally:
        server.stop()
