"""``stop`` through a real ``kvchat serve``: a stop string that never occurs
(smolagents sends three on every step) must end the reply like any other, and
one that occurs cuts the reply before it, as OpenAI does. Every reply is
checked against plain ``generate`` on the full conversation."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import reference_turn, user_message
from serving import MAX_NEW, Server, reference_model

pytestmark = pytest.mark.server

NEVER = ["Observation:", "Calling tools:", "</code>"]  # what smolagents' CodeAgent sends


@pytest.fixture(scope="module")
def server():
    # Two slots: a request that never releases its slot shows within three requests.
    with Server("tiny:llama", "--max-pending", "2") as running:
        yield running


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def _streamed(server, body: dict) -> tuple[str, str | None, bool]:
    """(content, finish_reason, whether [DONE] came) of a streamed request."""
    content, finish, done = "", None, False
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[len("data: ") :])["choices"][0]
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return content, finish, done


def _body(turn: int, **fields) -> dict:
    messages = [user_message(turn)]
    return {"model": "tiny:llama", "messages": messages, "max_tokens": MAX_NEW, **fields}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_stop_that_never_occurs_ends_the_reply_and_frees_its_slot(server, tokenizer, stream):
    model = reference_model("llama")
    # Three requests on two slots: a slot kept by an ended reply would make the third a 429.
    for turn in range(3):
        body = _body(turn, stop=NEVER, temperature=0, prompt_cache_key=f"never-{stream}-{turn}")
        expected, _, ids = reference_turn(model, tokenizer, body["messages"])
        assert not any(s in expected for s in NEVER)
        if stream:
            content, finish, done = _streamed(server, body)
            assert done, "the stream never sent [DONE]"
        else:
            response = _post(server, body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            content, finish = choice["message"]["content"], choice["finish_reason"]
        assert content == expected
        assert finish == ("length" if len(ids) == MAX_NEW else "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_stop_that_occurs_cuts_the_reply_before_it(server, tokenizer, stream):
    model = reference_model("llama")
    body = _body(5, temperature=0, max_tokens=24)
    expected, _, _ = reference_turn(model, tokenizer, body["messages"], max_new_tokens=24)
    words = expected.split(" ")
    assert len(words) > 4, expected
    stop = " " + words[3]  # a word from the middle of the reply
    cut = expected[: expected.index(stop)]
    body.update(stop=["never-there", stop], prompt_cache_key=f"cut-{stream}")
    if stream:
        content, finish, done = _streamed(server, body)
        assert done
    else:
        response = _post(server, body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        content, finish = choice["message"]["content"], choice["finish_reason"]
    assert (content, finish) == (cut, "stop")
