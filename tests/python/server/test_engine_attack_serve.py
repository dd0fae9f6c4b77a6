"""The engine through a real ``kvchat serve``: two streamed chat completions
decode in one batch while one client disconnects mid-stream; both
conversations stay exact (plain ``generate`` on the served model), and
/metrics shows the batch."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers import LONG_SYSTEM, reference_turn, user_message
from kvchat.tiny import tiny_tokenizer
from serving import KEY_A, MAX_NEW, ask, auth, client_for, reference_model, start_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server():
    yield from start_server("tiny:llama")


def _stream(server, messages, key, max_tokens, min_tokens=0):
    body = {
        "model": "tiny:llama",
        "messages": messages,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": 0,
        "stream": True,
        "prompt_cache_key": key,
    }
    return httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=auth(KEY_A), timeout=120
    )


def _pieces(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if choices:
                yield choices[0]["delta"].get("content") or ""


def test_two_streams_decode_together_and_one_client_leaves(server):
    tokenizer = tiny_tokenizer()
    model = reference_model("llama")
    stayer = [LONG_SYSTEM, user_message(2)]
    leaver = [LONG_SYSTEM, user_message(0)]
    started, text = threading.Event(), []

    def stay():
        with _stream(server, stayer, "stayer", 20) as response:
            assert response.status_code == 200
            for piece in _pieces(response):
                started.set()
                text.append(piece)
        started.set()

    with _stream(server, leaver, "leaver", 400, 400) as response:
        assert response.status_code == 200
        pieces = _pieces(response)
        next(pieces)
        thread = threading.Thread(target=stay)
        thread.start()
        started.wait(120)
        next(pieces)  # both decoding: the stayer streams, the leaver's row still runs
    # The leaver's connection closed mid-stream.
    thread.join()
    want = reference_turn(model, tokenizer, stayer, 20)[0]
    assert "".join(text) == want
    deadline = time.monotonic() + 60
    while server.session("leaver")["requests"] < 1:
        assert time.monotonic() < deadline, "the cancelled turn was never committed"
        time.sleep(0.1)
    assert server.session("leaver")["last_turn"]["generated_tokens"] < 400
    follow = [*server.session("leaver")["history"], user_message(1)]
    reply, usage = ask(client_for(server), follow, "leaver", stream=True)
    assert reply == reference_turn(model, tokenizer, follow, MAX_NEW)[0]
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_report_batch_occupancy_and_queue_wait(server):
    ask(client_for(server), [LONG_SYSTEM, user_message(4)], "metrics", stream=False)
    text = server.get("/metrics").text
    names = {line.split()[0].split("{")[0] for line in text.splitlines() if line[:1].isalpha()}
    assert any("batch_rows" in name for name in names), sorted(names)
    assert any("queue_wait" in name for name in names), sorted(names)
