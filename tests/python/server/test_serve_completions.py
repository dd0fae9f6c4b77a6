"""``POST /v1/completions`` through kvchat serve with the ``openai`` SDK: a
text prompt continued as it is (no chat template), token for token what plain
``model.generate`` writes (float64), streamed or not; a prompt that continues
an earlier prompt and its completion reuses that session."""

from __future__ import annotations

import json

import pytest
from helpers import reference_ids
from kvchat.tiny import tiny_tokenizer
from serving import reference_model, start_server

pytestmark = pytest.mark.server

PROMPT = "The harbour at dawn: gulls over the water, boats going out, and a story to tell. " * 4
MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def server(request):
    yield from start_server(f"tiny:{request.param}", "--max-context-length", "4096")


def _plain(server, prompt: str, max_new: int = MAX_NEW, **kwargs) -> tuple[str, tuple]:
    """Plain generate on the prompt's ids: (text, generated ids)."""
    tokenizer = tiny_tokenizer()
    model = reference_model(server.model.partition(":")[2])
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    out = reference_ids(model, ids[0], max_new, **kwargs)
    return tokenizer.decode(out, skip_special_tokens=True), out


def _streamed(client, **kwargs) -> tuple[str, str, dict]:
    text, finish, usage = "", None, None
    for chunk in client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_completion_is_plain_generates_and_its_continuation_reuses(server, stream):
    """Keyless, so each continuation finds its session by its text."""
    client = server.client()
    prompt = PROMPT + ("Streamed. " if stream else "")
    for turn in range(3):
        kwargs = dict(model=server.model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        if stream:
            text, finish, usage = _streamed(client, **kwargs)
        else:
            response = client.completions.create(**kwargs)
            choice = response.choices[0]
            text, finish, usage = choice.text, choice.finish_reason, response.usage.model_dump()
        expected, ids = _plain(server, prompt)
        assert text == expected
        assert finish == ("length" if len(ids) == MAX_NEW else "stop")
        assert usage["completion_tokens"] == len(ids)
        if turn:  # the prompt is the last one, its completion, and more
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
        prompt = f"{prompt}{text} Then, on day {turn + 2},"


def test_a_named_completion_session_writes_plain_generates_tokens(server):
    client = server.client()
    prompt = PROMPT
    for _ in range(2):
        client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_body={"prompt_cache_key": "text-session"},
        )
        text, ids = _plain(server, prompt)
        assert tuple(server.session("text-session")["last_turn"]["output_ids"]) == ids
        prompt = f"{prompt}{text} Next,"


FEW_SHOT = "".join(
    f"Q: What do the {thing} do at dawn?\nA: They {act}.\n\n"
    for thing, act in [("gulls", "circle the boats"), ("boats", "go out"), ("nets", "dry")] * 3
)


def test_text_prompts_with_a_common_header_share_it(server):
    """Keyless text prompts that share a few-shot header and differ in their
    last question: each is a session of its own, and on an attention model a
    later one starts from the header, cut at a multiple of the minimum (32
    tokens; a text has no message boundary to cut at), exactly as plain
    generate writes. A hybrid shares no text prefix: its recurrent state
    exists only at checkpoints, and none lies at such a cut."""
    client, tokenizer = server.client(), tiny_tokenizer()
    family = server.model.partition(":")[2]
    first = f"{FEW_SHOT}Q: What does the lighthouse do at dawn?\nA:"
    client.completions.create(model=server.model, prompt=first, max_tokens=4, temperature=0)
    for question in ("the harbour master", "the old ferry"):
        prompt = f"{FEW_SHOT}Q: What does {question} do at dawn?\nA:"
        kwargs = dict(model=server.model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        response = client.completions.create(**kwargs)
        assert response.choices[0].text == _plain(server, prompt)[0]
        ids, held = tokenizer(prompt)["input_ids"], tokenizer(first)["input_ids"]
        common = next(i for i, (a, b) in enumerate(zip(ids, held, strict=False)) if a != b)
        cached = response.usage.prompt_tokens_details.cached_tokens
        if family == "llama":
            assert cached >= common - common % 32 > 64, (cached, common)
        else:
            assert cached == 0


def test_a_completion_on_a_chat_session_is_refused_and_changes_nothing(server):
    client = server.client()
    messages = [{"role": "user", "content": "Hello"}]
    client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0, user="chatty"
    )
    server.settled()
    before = server.session("chatty")
    response = server.post(
        "/v1/completions",
        json={"model": server.model, "prompt": "free text", "max_tokens": 4, "user": "chatty"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"
    assert server.session("chatty") == before


def test_a_stop_string_cuts_the_completion_and_one_that_never_occurs_does_not(server):
    client = server.client()
    expected, _ = _plain(server, PROMPT)
    word = expected.split()[2]
    cut = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stop=[word]
    )
    assert cut.choices[0].text == expected[: expected.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    never = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stop=["\u2603\u2603"]
    )
    assert never.choices[0].text == expected and never.choices[0].finish_reason == "length"


def test_a_max_tokens_over_the_context_is_named_as_sent(server):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 10**6}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "max_tokens (1000000) exceed max_context_length (4096)" in message, message
    assert "max_new_tokens" not in message and message.endswith("or a smaller max_tokens")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 2}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"n": 2}, "n"),
        ({"max_tokens": 10**6}, "prompt"),
        ({"prompt": "\ud800x"}, "prompt"),  # a lone surrogate: not text
    ],
)
def test_bad_completions_get_openai_errors_and_touch_nothing(server, extra, param):
    server.settled()  # an earlier test's settle could still change its session
    before = server.get("/v1/sessions").json()["data"]
    body = {"model": server.model, "prompt": "hello", "max_tokens": 4, **extra}
    # Encoded here: httpx would refuse a lone surrogate, which JSON escapes.
    response = server.post(
        "/v1/completions",
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert server.get("/v1/sessions").json()["data"] == before
