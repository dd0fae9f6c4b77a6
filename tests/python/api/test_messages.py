"""Messages as OpenAI clients send them, through SessionManager.chat: text
parts, assistant tool calls with no content, tool results, tools and template
arguments. The history keeps every field, and reuse works as for plain chat."""

from __future__ import annotations

import json

import pytest
from helpers import LONG_SYSTEM, MAX_NEW, reference_ids, reference_turn
from kvchat import SessionManager
from kvchat.tiny import tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def test_text_parts_are_joined_and_match_the_string_form(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]
    got = mgr.chat("s", [LONG_SYSTEM, {"role": "user", "content": parts}], max_new_tokens=MAX_NEW)
    want = reference_turn(
        llama, tokenizer, [LONG_SYSTEM, {"role": "user", "content": "Tell me a story."}]
    )[0]
    assert got == want
    assert mgr.messages("s")[1]["content"] == "Tell me a story."


def test_a_tool_calling_exchange_is_exact_keeps_its_fields_and_reuses(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [LONG_SYSTEM, {"role": "user", "content": "Look it up."}]
    previous = 0  # the last turn's prompt, all of which the next turn reuses
    for turn in range(3):
        stream = mgr.stream_chat("agent", messages, max_new_tokens=MAX_NEW, tools=TOOLS)
        got = "".join(stream)
        want, prompt, _ = reference_turn(llama, tokenizer, messages, tools=TOOLS)
        prompt_tokens = prompt.numel()
        assert got == want
        report = stream.report  # the turn's own report, without racing last_turn()
        assert report.prompt_tokens == prompt_tokens
        assert report.reused_tokens >= previous, report
        previous = prompt_tokens
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"turn": turn})},
        ]
    history = mgr.messages("agent")
    assert history[2] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert history[3]["tool_call_id"] == "c1"


def test_chat_template_kwargs_reach_the_template(llama):
    tokenizer = tiny_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if shout %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    mgr = SessionManager(llama, tokenizer)
    messages = [{"role": "user", "content": "tell me a story"}]
    got = mgr.chat("s", messages, max_new_tokens=MAX_NEW, chat_template_kwargs={"shout": True})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, shout=True
    )
    assert "TELL ME A STORY" in text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert got == tokenizer.decode(reference_ids(llama, ids[0], MAX_NEW), skip_special_tokens=True)
    assert mgr.last_turn("s").prompt_tokens == ids.shape[1]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            r"\[0\] is a 'image_url' part",
        ),
        ({"role": "user", "content": None}, "must be a string"),
        (
            {"role": "assistant", "content": None, "tool_calls": "x"},
            "tool_calls'\\] must be a list",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": 3}]},
            r"\['text'\] must be a string",
        ),
        (
            {"role": "user", "content": "hi", "name": object()},
            r"messages\[0\]\['name'\] is not JSON data",
        ),
    ],
)
def test_malformed_client_messages_name_the_field(llama, tokenizer, message, match):
    mgr = SessionManager(llama, tokenizer)
    with pytest.raises(ValueError, match=match):
        mgr.chat("s", [message])
    assert mgr.sessions() == []


def test_tools_and_template_kwargs_of_the_wrong_type_name_the_argument(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match="tools must be a list"):
        mgr.chat("s", messages, tools={"name": "x"})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        mgr.stream_chat("s", messages, chat_template_kwargs=["enable_thinking"])
    assert mgr.sessions() == []


NESTED = [[[[0]]]]
for _ in range(70):
    NESTED = [NESTED]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        # A client's own Jinja, or an argument that changes what is rendered.
        ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 10**9 }}"}}, ValueError, "argument"),
        ({"chat_template_kwargs": {"tokenize": True}}, ValueError, "'tokenize'"),
        ({"chat_template_kwargs": {"return_dict": True}}, ValueError, "'return_dict'"),
        ({"chat_template_kwargs": {"deep": NESTED}}, ValueError, "nested more than 64"),
        # A special token the template writes after every message: once per message.
        ({"chat_template_kwargs": {"eos_token": "x" * 10**6}}, ValueError, "special token"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, ValueError, "'bos_token'.*special"),
        ({"chat_template_kwargs": {"self": 1}}, ValueError, "'self'"),
        ({"tools": [{"type": "function", "function": {"name": "\ud800"}}]}, ValueError, "tools"),
        ({"tools": [1]}, TypeError, r"tools\[0\] must be a dict"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
            ValueError,
            r"messages\[0\]\['tool_calls'\]\[0\] must be a tool call",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "name": NESTED}]},
            ValueError,
            "nested more than 64",
        ),
    ],
)
def test_what_the_template_must_not_run_is_refused_naming_the_argument(
    llama, tokenizer, kwargs, error, match
):
    mgr = SessionManager(llama, tokenizer)
    messages = kwargs.pop("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(error, match=match):
        mgr.chat("s", messages, max_new_tokens=2, **kwargs)
    assert mgr.sessions() == []


def test_a_template_that_raises_is_a_value_error_naming_messages(llama):
    refusing = tiny_tokenizer("{{ raise_exception('system message required') }}")
    mgr = SessionManager(llama, refusing)
    with pytest.raises(ValueError, match="messages: the chat template refused them"):
        mgr.chat("s", [{"role": "user", "content": "hi"}], max_new_tokens=2)
    assert mgr.sessions() == []


def test_rewritten_tail_is_read_off_the_template():
    from kvchat.prompting import rewritten_tail
    from kvchat.tiny import CHATML_TEMPLATE, THINK_DROPPING_TEMPLATE, THINK_OPENING_TEMPLATE

    # History that keeps the generation prompt: nothing to stop for.
    assert rewritten_tail(tiny_tokenizer(CHATML_TEMPLATE)) == 0
    assert rewritten_tail(tiny_tokenizer(THINK_DROPPING_TEMPLATE)) == 0
    opening = tiny_tokenizer(THINK_OPENING_TEMPLATE)
    think = opening("<think>\n", add_special_tokens=False)["input_ids"]
    assert rewritten_tail(opening) == len(think) > 0
    # A template that refuses the probe is taken as one that rewrites nothing.
    refusing = tiny_tokenizer("{{ raise_exception('system message required') }}")
    assert rewritten_tail(refusing) == 0


def test_a_template_that_needs_tools_still_builds_a_manager(llama, caplog):
    """Some public templates (Hermes 3's tool-use one) fail without tools; the
    manager's template probe must not turn that into a crash at construction."""
    needs_tools = tiny_tokenizer(
        "{% for tool in tools %}{{ tool['function']['name'] }}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with caplog.at_level("WARNING", logger="kvchat"):
        mgr = SessionManager(llama, needs_tools)
    assert "refused a one-message probe" in caplog.text
    reply = mgr.chat("s", [{"role": "user", "content": "hi"}], max_new_tokens=3, tools=TOOLS)
    assert isinstance(reply, str) and mgr.last_turn("s").generated_tokens == 3
