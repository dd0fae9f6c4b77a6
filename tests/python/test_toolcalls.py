"""Tool calls parsed out of replies, per format, on text the real chat
templates render (llama.cpp's copies, ``build/llama-cpp``): an assistant
message with ``tool_calls`` is rendered, and what the model would have written
after the generation prompt is parsed back, whole and streamed in pieces split
at every position. No model runs here."""

from __future__ import annotations

import functools
import json

import pytest
from kvchat.agents import Content, ToolCall, ToolCallParser, detect
from kvchat.agents.formats import HERMES, LLAMA3_JSON, ToolFormat
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGS = [{"city": "Paris", "days": 3}, {"city": "Rome", "days": 1}]
# template: (format, calls it renders at once, the text the model ends its turn with)
CASES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", 2, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("hermes", 2, "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", 2, "<|im_end|>"),
    "ibm-granite-granite-4.0": ("hermes", 2, "<|end_of_text|>"),
    "Qwen3.5-4B": ("qwen-xml", 2, "<|im_end|>"),
    "GLM-4.6": ("glm", 2, None),  # the template writes <|observation|> only before a tool turn
    "moonshotai-Kimi-K2": ("kimi-k2", 2, "<|im_end|>"),
    "LFM2.5-8B-A1B": ("lfm2", 2, "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", 2, "<|im_end|>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral-v11", 2, "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3-json", 1, "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3-json", 1, "<|eot_id|>"),
}


@functools.cache
def _tokenizer(template: str):
    """Only the template's text matters here: the tiny tokenizer carries it."""
    return tiny_tokenizer(chat_template=(fetch() / "templates" / f"{template}.jinja").read_text())


def _rendered_reply(template: str, content: str) -> str:
    """What the model writes after the generation prompt for a message with
    ``content`` and the case's tool calls, up to its end-of-turn text."""
    _, count, end = CASES[template]
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for i, a in zip(("abc123xyz", "def456uvw")[:count], ARGS[:count], strict=True)
    ]
    tokenizer = _tokenizer(template)
    user = [{"role": "user", "content": "The weather?"}]
    prompt = tokenizer.apply_chat_template(
        user, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    full = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": content, "tool_calls": calls}],
        tools=[WEATHER],
        tokenize=False,
    )
    assert full.startswith(prompt)
    reply = full[len(prompt) :]
    if end is None:
        return reply
    assert end in reply, reply
    return reply[: reply.index(end)]


def _parse(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[ToolCall], list]:
    parser = ToolCallParser(fmt, [WEATHER])
    out = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    content = "".join(item.text for item in out if isinstance(item, Content))
    calls = [item for item in out if isinstance(item, ToolCall)]
    assert content == parser.content and calls == parser.calls
    return content, calls, out


def _arguments(calls: list[ToolCall]) -> list[dict]:
    assert all(c.name == "get_weather" for c in calls)
    return [json.loads(c.arguments) for c in calls]


@pytest.mark.parametrize("template", sorted(CASES))
def test_the_format_is_chosen_from_the_template(template):
    fmt = detect(_tokenizer(template))
    assert fmt is not None and fmt.name == CASES[template][0]


@pytest.mark.parametrize("template", ["google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct"])
def test_a_template_with_no_tool_calls_has_no_format(template):
    assert detect(_tokenizer(template)) is None


@pytest.mark.parametrize("template", sorted(CASES))
def test_rendered_calls_parse_back_whole_and_split_at_every_position(template):
    fmt = detect(_tokenizer(template))
    count = CASES[template][1]
    reply = _rendered_reply(template, "")
    content, calls, _ = _parse(fmt, [reply])
    assert _arguments(calls) == ARGS[:count]  # "days" is an integer, as the tool says
    # What the template writes before the calls: at most an empty reasoning block.
    assert "".join(content.split()) in ("", "<think></think>", "</think>"), content
    assert len({c.id for c in calls}) == count
    for i in range(1, len(reply)):
        split = _parse(fmt, [reply[:i], reply[i:]])
        assert (split[0], _arguments(split[1])) == (content, ARGS[:count]), i
    by_char = _parse(fmt, list(reply))
    assert (by_char[0], _arguments(by_char[1])) == (content, ARGS[:count])


# Templates that drop an assistant's content beside its tool calls (and Llama's,
# whose call is the whole reply).
NO_CONTENT = {
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
}


@pytest.mark.parametrize("template", sorted(set(CASES) - NO_CONTENT))
def test_content_before_the_calls_streams_before_them(template):
    """Text before the section is given out as it comes, not held to the end."""
    fmt = detect(_tokenizer(template))
    reply = _rendered_reply(template, "Let me look that up.")
    assert "Let me look that up." in reply
    parser = ToolCallParser(fmt, [WEATHER])
    given = ""
    for char in reply:
        given += "".join(i.text for i in parser.feed(char) if isinstance(i, Content))
    assert "Let me look that up." in given
    assert not parser.calls  # announced only once the reply ends
    rest = parser.finish()
    assert _arguments([i for i in rest if isinstance(i, ToolCall)]) == ARGS[: CASES[template][1]]


@pytest.mark.parametrize("template", sorted(CASES))
def test_markup_that_does_not_parse_stays_text(template):
    """A call cut short (max_tokens ran out inside its JSON) is the reply's
    text, character for character, never an error."""
    fmt = detect(_tokenizer(template))
    reply = _rendered_reply(template, "")
    cut = reply[: reply.index("Paris") + 3]
    for pieces in ([cut], list(cut)):
        content, calls, _ = _parse(fmt, pieces)
        assert calls == [] and content == cut


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_call> tags to call a tool.",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        "plain text that ends in <tool_",
        "",
    ],
)
def test_text_without_a_valid_call_is_given_back_unchanged(text):
    for pieces in ([text], list(text)):
        content, calls, _ = _parse(HERMES, pieces)
        assert calls == [] and content == text


def test_llama_json_must_be_the_whole_reply():
    prose = 'The call would be {"name": "get_weather", "parameters": {}} here.'
    content, calls, _ = _parse(LLAMA3_JSON, list(prose))
    assert calls == [] and content == prose
    content, calls, _ = _parse(LLAMA3_JSON, ['<|python_tag|>{"name": "f", "parameters": {"a": 1}}'])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]


def test_mistral_ids_are_nine_letters_or_digits():
    """Mistral's templates refuse any other id when the call is sent back."""
    fmt = detect(_tokenizer("mistralai-Mistral-Nemo-Instruct-2407"))
    _, calls, _ = _parse(fmt, [_rendered_reply("mistralai-Mistral-Nemo-Instruct-2407", "")])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls, _ = _parse(HERMES, ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'])
    assert calls[0].id.startswith("call_")


def test_a_tokenizers_own_response_template_comes_first():
    """transformers' response parsing, with the template the tokenizer carries."""
    tokenizer = tiny_tokenizer()
    tokenizer.response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open": "<call>",
                "close": "</call>",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"content": "text"},
        },
    }
    fmt = detect(tokenizer)
    assert fmt.name == "response_template"
    content, calls, _ = _parse(fmt, list('Sure.<call>{"name": "f", "arguments": {"x": 1}}</call>'))
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"x": 1})
    ]
