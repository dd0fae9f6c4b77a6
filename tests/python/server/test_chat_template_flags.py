"""``kvchat serve --chat-template`` and ``--chat-template-kwargs`` (vLLM's
names and meaning), in process: a bad value is refused naming its flag before
the model loads; the template given is the one every turn renders with and
the one tool calls are read in; the server's template variables sit under
each request's own."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from fastapi.testclient import TestClient
from kvchat.agents import detect
from kvchat.prompting import render_prompt
from kvchat.serve import cli
from kvchat.serve.chat_template import shipped_templates
from kvchat.tiny import (
    CHATML_TEMPLATE,
    THINK_DROPPING_TEMPLATE,
    tiny_model,
    tiny_tokenizer,
    words_only,
)
from transformers import PreTrainedTokenizerFast

SHIPPED = cli.Path(cli.__file__).parents[1] / "templates" / "chatml-tools.jinja"
USER = {"role": "user", "content": "Hello there."}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


def _parse(*flags: str) -> argparse.Namespace:
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(["tiny", *flags])


def _refused(capsys, monkeypatch, *flags: str, tokenizer=None) -> str:
    """kvchat serve's error for ``flags`` (it exits 2, as argparse does); the
    model is loaded only when ``tokenizer`` is given (a check that needs it)."""

    def load(*_):
        if tokenizer is None:
            raise AssertionError("the model was loaded before the flags were checked")
        return tiny_model("llama", seed=0), tokenizer

    monkeypatch.setattr(cli, "load_model", load)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tiny", *flags])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_missing_template_file_is_refused_naming_the_flag_and_path(capsys, monkeypatch, tmp_path):
    missing = str(tmp_path / "nowhere" / "tools.jinja")
    err = _refused(capsys, monkeypatch, "--chat-template", missing)
    assert "--chat-template" in err and missing in err
    # A folder is no template file either.
    err = _refused(capsys, monkeypatch, "--chat-template", str(tmp_path))
    assert "--chat-template" in err and str(tmp_path) in err


def test_a_template_jinja_cannot_compile_or_an_empty_one_is_refused(capsys, monkeypatch, tmp_path):
    err = _refused(capsys, monkeypatch, "--chat-template", "{% for m in messages %}{{ m }}")
    assert "--chat-template" in err and "Jinja" in err
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    err = _refused(capsys, monkeypatch, "--chat-template", str(empty))
    assert "--chat-template" in err and "empty" in err


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"enable_thinking": fals}', "not valid JSON"),
        ('["enable_thinking"]', "must be a JSON object"),
        ("true", "must be a JSON object"),
        ('{"tokenize": true}', "argument of apply_chat_template"),
        ('{"eos_token": "x"}', "special token"),
        ('{"depth": NaN}', "finite"),
    ],
)
def test_bad_template_kwargs_are_refused_naming_the_flag(capsys, monkeypatch, value, says):
    err = _refused(capsys, monkeypatch, "--chat-template-kwargs", value)
    assert "--chat-template-kwargs" in err and says in err


def test_template_kwargs_naming_a_special_token_of_the_models_are_refused(capsys, monkeypatch):
    # Read off the model's tokenizer, once it is loaded: still before serving.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer().backend_tokenizer,
        eos_token="<|im_end|>",
        extra_special_tokens={"image_token": "<|endoftext|>"},
        chat_template=CHATML_TEMPLATE,
    )
    assert "image_token" in tokenizer.special_tokens_map
    flags = ("--chat-template-kwargs", '{"image_token": "x"}')
    err = _refused(capsys, monkeypatch, *flags, tokenizer=tokenizer)
    assert "--chat-template-kwargs" in err and "image_token" in err and "special token" in err


def test_the_template_is_read_from_a_file_its_text_or_a_shipped_name(tmp_path):
    text = SHIPPED.read_text("utf-8")
    copy = tmp_path / "mine.jinja"
    copy.write_text(text)
    assert _parse("--chat-template", str(copy)).chat_template == text
    assert _parse("--chat-template", text).chat_template == text  # inline, as vLLM takes it
    assert _parse("--chat-template", "chatml-tools").chat_template == text
    assert shipped_templates() == {"chatml-tools": text}
    assert detect(tiny_tokenizer(text)).name == "hermes"  # its calls are read and forced
    assert _parse().chat_template is None and _parse().chat_template_kwargs is None


def _app(monkeypatch, *flags: str):
    """kvchat serve's app in process, on the tiny llama whose template
    renders no tools (THINK_DROPPING_TEMPLATE), and its manager."""
    built = {}

    def load(*_):
        model = tiny_model("llama", dtype=torch.float64, seed=0)
        tokenizer = tiny_tokenizer(THINK_DROPPING_TEMPLATE)
        model.generation_config.suppress_tokens = words_only(tokenizer, model.config.vocab_size)
        return model, tokenizer

    real = cli.SessionManager

    def manager(*args, **kwargs):
        built["manager"] = real(*args, **kwargs)
        return built["manager"]

    monkeypatch.setattr(cli, "load_model", load)
    monkeypatch.setattr(cli, "SessionManager", manager)
    app = cli.build_app(_parse("--served-model-name", "tiny", *flags))
    return TestClient(app, raise_server_exceptions=False), built["manager"]


def _forced_call(client: TestClient):
    body = {
        "model": "tiny",
        "messages": [USER],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 160,
    }
    return client.post("/v1/chat/completions", json=body)


def test_tools_are_called_in_the_markup_of_the_template_given(monkeypatch):
    # The model's own template has no tool-call markup: a forced call is refused.
    client, _ = _app(monkeypatch)
    refused = _forced_call(client)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    # Served with the shipped template, its Hermes markup is written and read.
    client, manager = _app(monkeypatch, "--chat-template", "chatml-tools")
    assert manager.tokenizer.chat_template == SHIPPED.read_text("utf-8")
    response = _forced_call(client)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in ("celsius", "fahrenheit")


VARIABLES_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if mood is defined %} ({{ mood }}){% endif %}{% if place is defined %} at {{ place }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


@pytest.mark.parametrize(
    ("own", "rendered"),
    [
        (None, {"mood": "calm", "place": "home"}),
        ({"place": "the deep blue sea"}, {"mood": "calm", "place": "the deep blue sea"}),
        ({"mood": "very cheerful indeed"}, {"mood": "very cheerful indeed", "place": "home"}),
    ],
)
def test_the_servers_template_kwargs_sit_under_the_requests_own(monkeypatch, own, rendered):
    flags = ("--chat-template", VARIABLES_TEMPLATE)
    flags += ("--chat-template-kwargs", '{"mood": "calm", "place": "home"}')
    client, manager = _app(monkeypatch, *flags)
    body = {"model": "tiny", "messages": [USER], "max_tokens": 3, "user": "u"}
    if own is not None:
        body["chat_template_kwargs"] = own
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    expected = render_prompt(manager.tokenizer, [USER], template_kwargs=rendered).tolist()
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    (session,) = manager.sessions()
    assert manager.cached_ids(session)[: len(expected)] == expected
