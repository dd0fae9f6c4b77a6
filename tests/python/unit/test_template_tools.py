"""Tools and the calls sent back, where a chat template reads them otherwise
(``kvchat.template_tools``): SmolLM3's template lists tools from
``xml_tools`` and renders an assistant's content only, never its
``tool_calls``. Rendered with the template in SmolLM3's shape
(``llama_cpp_models.smollm3_template``); no model runs here."""

from __future__ import annotations

import json

import pytest
from kvchat.agents import ToolCall, ToolCallParser, detect
from kvchat.prompting import render_text
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch, smollm3_template, template_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, in degrees.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
USER = {"role": "user", "content": "The weather in Paris and Zürich?"}


def _call(call_id: str, arguments) -> dict:
    function = {"name": "get_weather", "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def _smollm3():
    return tiny_tokenizer(chat_template=smollm3_template())


def _reply(tokenizer, message: dict) -> str:
    """What the history holds for ``message``, between the generation prompt
    before it and the turn's end."""
    prompt = render_text(tokenizer, [USER], tools=[WEATHER])
    later = [USER, message, {"role": "user", "content": "Thanks."}]
    full = render_text(tokenizer, later, tools=[WEATHER])
    assert full.startswith(prompt)
    return full[len(prompt) :].split("<|im_end|>")[0]


def test_smollm3s_template_is_shown_the_tools_as_xml_tools():
    tokenizer = _smollm3()
    assert detect(tokenizer).name == "hermes"
    prompt = render_text(tokenizer, [USER], tools=[WEATHER])
    # Passed as OpenAI ``tools``, the template would show none of this.
    assert "get_weather" in prompt and "degrees" in prompt and "<tool_call>" in prompt
    plain = tokenizer.apply_chat_template([USER], tools=[WEATHER], tokenize=False)
    assert "get_weather" not in plain


def get_weather(city: str, days: int = 1) -> str:
    """The weather in a city, in degrees.

    Args:
        city: The city's name.
        days: How many days ahead.
    """
    return "sunny"


def test_a_python_function_as_a_tool_is_shown_as_its_schema():
    """transformers turns a function given in ``tools`` into its JSON schema;
    one given to SmolLM3's template goes as that schema too."""
    prompt = render_text(_smollm3(), [USER], tools=[get_weather])
    assert "'name': 'get_weather'" in prompt and "How many days ahead." in prompt


def test_a_callers_own_xml_tools_are_passed_as_given():
    tokenizer = _smollm3()
    own = [{"name": "look_up", "description": "Mine."}]
    prompt = render_text(tokenizer, [USER], tools=[WEATHER], template_kwargs={"xml_tools": own})
    assert "look_up" in prompt and "get_weather" not in prompt


@pytest.mark.parametrize(
    "content, calls",
    [
        ("", [_call("a", '{"city": "Paris", "days": 3}')]),
        ("Checking both.\n", [_call("a", '{"city": "Paris"}'), _call("b", '{"city": "Zürich"}')]),
        ("", [_call("a", {"city": "Zürich", "days": 1})]),  # an object, not JSON text
    ],
    ids=["one", "content-and-two", "object-arguments"],
)
def test_calls_sent_back_are_in_smollm3s_history_and_read_back_as_sent(content, calls):
    """The template renders content only; kvchat writes the calls after it in
    the markup the model writes (Hermes JSON), so the history the model reads
    holds its calls, and reading that history back gives the calls sent."""
    tokenizer = _smollm3()
    reply = _reply(tokenizer, {"role": "assistant", "content": content, "tool_calls": calls})
    parser = ToolCallParser(detect(tokenizer), [WEATHER])
    parser.feed(reply)
    parser.finish()
    assert parser.content.strip() == content.strip()
    read = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    sent = [
        (c["function"]["name"], json.loads(a) if isinstance(a, str) else a)
        for c in calls
        for a in [c["function"]["arguments"]]
    ]
    assert read == sent
    assert all(isinstance(c, ToolCall) for c in parser.calls)


def test_arguments_sent_back_as_text_are_written_as_that_text():
    """The text the reply gave the client is the model's own: written as it is
    (its spacing and escapes), so the history's tokens are the ones the model
    wrote and the session's cache stays reusable."""
    tokenizer = _smollm3()
    text = '{"city":"Z\\u00fcrich" ,"days":2}'
    message = {"role": "assistant", "content": "", "tool_calls": [_call("a", text)]}
    reply = _reply(tokenizer, message)
    assert reply == '<tool_call>\n{"name": "get_weather", "arguments": ' + text + "}\n</tool_call>"


@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct", "Qwen3.5-4B", "GLM-4.6"])
def test_templates_that_read_tools_and_render_calls_get_them_as_sent(template):
    tokenizer = tiny_tokenizer(chat_template=template_text(template))
    messages = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [_call("a", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    expected = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert render_text(tokenizer, messages, tools=[WEATHER]) == expected


def test_a_template_that_renders_neither_tools_nor_calls_in_known_markup_is_left_as_it_is():
    """llama.cpp's copy of SmolLM3's template has no tools section and so no
    tool-call markup kvchat knows: nothing is added, nothing fails."""
    tokenizer = tiny_tokenizer(
        chat_template=(fetch() / "templates" / "HuggingFaceTB-SmolLM3-3B.jinja").read_text()
    )
    assert detect(tokenizer) is None
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [_call("a", "{}")]}]
    expected = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert render_text(tokenizer, messages, tools=[WEATHER]) == expected


def _templates() -> list[str]:
    return sorted(path.stem for path in (fetch() / "templates").glob("*.jinja"))


@pytest.mark.parametrize("content", ["", None], ids=["empty", "none"])
def test_every_other_template_renders_tools_and_calls_as_transformers_does(content):
    """Of llama.cpp's templates none shows tools only from ``xml_tools``, and
    none that renders no call has a tool-call format kvchat can write (its
    SmolLM3 copy, LFM2.5-Instruct and LFM2-8B-A1B have no format at all):
    kvchat renders them all as apply_chat_template does (arguments as the
    template wants them aside). DeepSeek R1's Llama distill renders calls
    only beside content None, so it is no template that leaves calls out."""
    from kvchat.call_arguments import as_the_template_wants

    messages = [
        USER,
        {"role": "assistant", "content": content, "tool_calls": [_call("a", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    checked = 0
    for template in _templates():
        tokenizer = tiny_tokenizer(chat_template=template_text(template))
        try:
            expected = tokenizer.apply_chat_template(
                as_the_template_wants(tokenizer, messages),
                tools=[WEATHER],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception:  # the template refuses this conversation
            with pytest.raises(ValueError, match="messages"):
                render_text(tokenizer, messages, tools=[WEATHER])
            continue
        assert render_text(tokenizer, messages, tools=[WEATHER]) == expected, template
        checked += 1
    assert checked >= 50  # of about 70; some refuse a call beside content None
