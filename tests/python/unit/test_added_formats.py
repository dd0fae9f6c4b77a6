"""The formats added with the registry (docs/agents.md's table), beyond what
test_toolcalls.py checks for every template: GigaChat 3's call message, which
the template renders after the reply's end-of-message token; the grammars of
the ones kvchat constrains written as the template renders a call sent
back (exact/test_grammar.py walks them); MiniCPM5's CDATA values; MiniMax-M3's tags named by
their keys. Every text is parsed whole and split at every position."""

from __future__ import annotations

import functools
import json

import pytest
from grammar_walks import TOOLS, tiny_grammars
from kvchat.agents import Content, ToolCall, ToolCallParser, detect
from kvchat.agents.formats import APERTUS, GIGACHAT_3, KIMI_K3, MINICPM, MINIMAX_M3, ToolFormat
from kvchat.agents.grammar import GrammarError
from kvchat.template_tools import _written
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",  # Apertus' template reads it
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "where": {"type": "object"},
            },
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "The weather?"}]


@functools.cache
def _tokenizer(template: str):
    return tiny_tokenizer(chat_template=(fetch() / "templates" / f"{template}.jinja").read_text())


def _reply(template: str, arguments: dict, content: str = "") -> str:
    """What the template renders after its generation prompt for one call."""
    tokenizer = _tokenizer(template)
    prompt = tokenizer.apply_chat_template(
        USER, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    call = {
        "id": "a1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    full = tokenizer.apply_chat_template(
        [*USER, {"role": "assistant", "content": content, "tool_calls": [call]}],
        tools=[WEATHER],
        tokenize=False,
    )
    assert full.startswith(prompt)
    return full[len(prompt) :]


def _parse(fmt: ToolFormat, pieces: list[str], tools=(WEATHER,)) -> tuple[str, list[dict]]:
    parser = ToolCallParser(fmt, list(tools))
    out = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    content = "".join(item.text for item in out if isinstance(item, Content))
    calls = [(c.name, json.loads(c.arguments)) for c in out if isinstance(c, ToolCall)]
    return content, calls


def _every_split(fmt: ToolFormat, text: str) -> tuple[str, list]:
    """What ``text`` parses to, the same whole, split anywhere and by character."""
    whole = _parse(fmt, [text])
    for i in range(1, len(text)):
        assert _parse(fmt, [text[:i], text[i:]]) == whole, i
    assert _parse(fmt, list(text)) == whole
    return whole


@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_a_gigachat_3_call_message_parses_back(content):
    """GigaChat 3 renders a call as a "function call" message after the
    reply's end-of-message token; the model may write that token, or start
    the call message straight away. Both are one call."""
    assert detect(_tokenizer("GigaChat3-10B-A1.8B")) is GIGACHAT_3
    rendered = _reply("GigaChat3-10B-A1.8B", {"city": "Paris", "days": 3}, content)
    sep = "<|message_sep|>"
    assert rendered.startswith(content + sep) and rendered.endswith(sep + "\n\n")
    reply = rendered[: -len(sep + "\n\n")]  # the end-of-message token ends the reply
    for text in (reply, reply.replace(sep + "\n\n", "", 1)):
        assert _every_split(GIGACHAT_3, text) == (
            content,
            [("get_weather", {"city": "Paris", "days": 3})],
        )


@pytest.mark.parametrize(
    "template,fmt",
    [("GigaChat3-10B-A1.8B", GIGACHAT_3)],
    ids=["gigachat3"],
)
def test_a_constrained_call_is_written_as_the_template_renders_it(template, fmt):
    """The history a constrained call is sent back in holds what the grammar
    wrote, so the next turn reuses it."""
    arguments = {"city": "Paris", "days": 3}
    call = {"function": {"name": "get_weather", "arguments": arguments}}
    assert _written(fmt.grammar, [call]) in _reply(template, arguments)


def test_a_minicpm_call_is_written_as_the_template_renders_it():
    """Values that need no CDATA block, a boolean as Python writes it."""
    arguments = {"city": "Paris", "days": 3, "hourly": True}
    g = MINICPM.grammar
    params = "".join(
        g.xml[0] + key + g.xml[1] + str(value) + g.xml[2] for key, value in arguments.items()
    )
    written = g.call_open + "get_weather" + g.name_close + params + g.call_close
    assert written in _reply("openbmb-MiniCPM5-1B", arguments)


@pytest.mark.parametrize("value", ["line one\nline two", "5 < 6 & 7", "<b>bold</b>"])
def test_a_minicpm_value_in_a_cdata_block_is_read_as_its_text(value):
    reply = _reply("openbmb-MiniCPM5-1B", {"city": value, "days": 2}).split("<|im_end|>")[0]
    assert "<![CDATA[" + value + "]]>" in reply
    assert _every_split(MINICPM, reply) == ("", [("get_weather", {"city": value, "days": 2})])


def test_minimax_m3_reads_each_argument_from_the_tag_its_key_names():
    """Scalars, read cast by the schema, after the reasoning's end."""
    end = "]<]minimax[>[</tool_call>"
    reply = _reply("MiniMax-M3", {"city": "Rome", "days": 1})
    reply = reply[: reply.index(end) + len(end)]
    content, calls = _every_split(MINIMAX_M3, reply)
    assert calls == [("get_weather", {"city": "Rome", "days": 1})]
    assert content.strip() == "</mm:think>"


@pytest.mark.parametrize("fmt", [MINIMAX_M3, KIMI_K3, APERTUS], ids=lambda f: f.name)
def test_a_forced_call_in_markup_without_a_grammar_is_refused_by_name(fmt):
    """M3's closing tags repeat each key; K3's say each value's type; Apertus's
    calls are split at "}, {", which a list of objects in the arguments holds."""
    with pytest.raises(GrammarError, match=fmt.name) as error:
        tiny_grammars().tool_calls(fmt, TOOLS)
    assert error.value.param == "tool_choice"
