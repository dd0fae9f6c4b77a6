"""The server harness the server, store and real-model tests share: a real
``kvchat serve`` in a subprocess (``Server``), the model it serves for plain
``generate`` (``reference_model``), and a turn through the ``openai`` client
(``ask``)."""

from __future__ import annotations

import functools
import sys
import time

import httpx
import openai
import torch
from helpers import DEVICE
from kvchat.serve.process import ServerProcess
from kvchat.tiny import tiny_model, tiny_tokenizer, words_only

MAX_NEW = 12
KEY_A, KEY_B = "key-a", "key-b"


@functools.cache
def reference_model(family: str):
    """The model `kvchat serve tiny:FAMILY --dtype float64` serves, for plain generate."""
    model = tiny_model(family, dtype=torch.float64, seed=0).to(DEVICE)
    model.generation_config.suppress_tokens = words_only(tiny_tokenizer(), model.config.vocab_size)
    return model


class Server(ServerProcess):
    """`python -m kvchat.serve MODEL ...` in a subprocess; stopped by stop()."""

    def __init__(self, model: str, *flags: str):
        self.model = model
        super().__init__(
            lambda port: (
                [sys.executable, "-m", "kvchat.serve", model, "--dtype", "float64"]
                + ["--device", str(DEVICE), "--port", str(port), *flags]
            )
        )

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def get(self, path: str, key: str = KEY_A, **kwargs) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=auth(key), timeout=60, **kwargs)

    def post(self, path: str, key: str | None = KEY_A, **kwargs) -> httpx.Response:
        headers = {**auth(key), **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=120, **kwargs)

    def session(self, session_id: str, key: str = KEY_A) -> dict:
        response = self.get(f"/v1/sessions/{session_id}", key)
        assert response.status_code == 200, response.text
        return response.json()

    def settled(self, timeout: float = 60) -> None:
        """Waits until no session settles (docs/settling.md), as /metrics says:
        at least ``--settle-delay`` (0.25 s) after the last turn, since the
        server, unlike ``wait_settled()``, does not start settles early."""
        deadline = time.monotonic() + timeout
        while "kvchat_settles_pending 0.0" not in self.get("/metrics").text:
            assert time.monotonic() < deadline, "settling never ended"
            time.sleep(0.05)


def auth(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def start_server(model: str, *flags: str):
    server = Server(model, "--api-key", KEY_A, *flags)
    try:
        yield server
    finally:
        server.stop()


def family_of(server: Server) -> str:
    return server.model.partition(":")[2]


def ask(client, messages, key, stream, **extra):
    """(reply text, usage) through the openai client, streamed or not."""
    kwargs = dict(model=client.server_model, messages=messages, max_tokens=MAX_NEW, temperature=0)
    if key is not None:
        kwargs["prompt_cache_key"] = key
    kwargs.update(extra)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        assert response.choices[0].finish_reason in ("stop", "length")
        return response.choices[0].message.content, response.usage
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert finish in ("stop", "length")
    return "".join(pieces), usage


def client_for(server: Server, key: str = KEY_A):
    client = server.client(key)
    client.server_model = server.model
    return client


def function_tool(name: str, description: str, properties: dict) -> dict:
    """A strict function tool as the OpenAI API takes it: every property required."""
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
