"""A request's reply as the server reads it (``serve/reply.py``): which
requests are read for tool calls and channels, and what the client gets of
a gpt-oss reply streamed in token-sized pieces. No model runs here."""

from __future__ import annotations

import re
import types

import pytest
from kvchat.agents import Content, ToolCall
from kvchat.agents.formats import HARMONY, HERMES
from kvchat.agents.streamed_calls import CallArguments, CallStart
from kvchat.serve.chat_request import parse_chat_request
from kvchat.serve.reply import DONE, Reply, tool_format

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "The weather?"}]
REASONED_ANSWER = (
    "<|channel|>analysis<|message|>The user asks about the weather.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris today."
)


def _chat(**body):
    return parse_chat_request({"model": "m", "messages": USER, **body})


@pytest.mark.parametrize(
    "body, hermes, harmony",
    [
        ({}, False, True),
        ({"tools": [TOOL]}, True, True),
        ({"tools": [TOOL], "tool_choice": "none"}, False, True),
        ({"response_format": {"type": "json_object"}}, False, False),  # the reply is the JSON
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, True, True),
    ],
    ids=["no tools", "tools", "tool_choice none", "json", "tools or json"],
)
def test_a_reply_in_channels_is_always_read_and_tool_markup_only_when_calls_are_allowed(
    body, hermes, harmony
):
    chat = _chat(**body)
    assert (tool_format(chat, HERMES) is HERMES) is hermes
    assert (tool_format(chat, HARMONY) is HARMONY) is harmony
    assert tool_format(chat, None) is None


def _items(chat, pieces: list[str]) -> list[list]:
    reply = Reply(iter(pieces[1:]), pieces[0], chat, 100, "s", "ns", tool_format(chat, HARMONY))
    steps = []
    while (items := reply.next_items()) is not DONE:
        steps.append(items)
    return steps, reply


@pytest.mark.parametrize("body", [{}, {"tools": [TOOL]}], ids=["no tools", "tools"])
def test_gpt_oss_s_answer_streams_without_its_reasoning(body):
    """As the model writes it (each marker one token): the final channel's
    words go out while the reply runs, the analysis channel never."""
    pieces = [p for p in re.split(r"(<\|[a-z]+\|>| )", REASONED_ANSWER) if p]
    steps, reply = _items(_chat(**body), pieces)
    texts = [i.text for step in steps for i in step if isinstance(i, Content)]
    assert "".join(texts) == reply.content == "It is sunny in Paris today."
    assert len(texts) > 3  # word by word, not the whole answer at the end
    assert reply.calls == [] and "<|" not in reply.content
    assert reply.text == REASONED_ANSWER  # what was sent is kept whole


@pytest.mark.parametrize("body", [{}, {"tools": [TOOL], "tool_choice": "none"}])
def test_a_call_the_request_allows_none_of_stays_text_without_the_reasoning(body):
    call = (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}'
    )
    text = "<|channel|>analysis<|message|>Private reasoning.<|end|>" + call
    for pieces in ([text], [p for p in re.split(r"(<\|[a-z]+\|>| )", text) if p]):
        steps, reply = _items(_chat(**body), pieces)
        assert not [i for step in steps for i in step if isinstance(i, ToolCall)]
        assert reply.content == call and reply.calls == []


@pytest.mark.parametrize(
    "cut",
    [
        "<|channel|>",
        "<|channel|>final",
        "<|start|>assistant<|channel|>final",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
    ],
)
def test_a_reply_cut_inside_a_message_header_gives_no_markup(cut):
    """max_tokens (or a stop string) ending the reply inside a header: the
    header is markup, not the answer."""
    text = "<|channel|>analysis<|message|>Thinking.<|end|>" + cut
    if cut == "<|channel|>":
        text = cut
    for pieces in ([text], list(text)):
        _, reply = _items(_chat(), pieces)
        assert reply.content == "", pieces


def test_an_answer_s_trailing_whitespace_is_the_same_however_it_arrives():
    text = "<|channel|>final<|message|>Answer.\n<|end|>"
    whole = _items(_chat(), [text])[1].content
    for pieces in ([p for p in re.split(r"(<\|[a-z]+\|>)", text) if p], list(text)):
        assert _items(_chat(), pieces)[1].content == whole == "Answer.\n", pieces


@pytest.mark.parametrize(
    "stop, content",
    [
        (["never written"], "It is sunny in Paris today."),  # held back, then given whole
        (["Paris"], "It is sunny in "),
    ],
    ids=["never matches", "matches"],
)
def test_a_stop_string_over_a_streamed_gpt_oss_answer(stop, content):
    pieces = [p for p in re.split(r"(<\|[a-z]+\|>| )", REASONED_ANSWER) if p]
    for split in (pieces, list(REASONED_ANSWER)):
        steps, reply = _items(_chat(stop=stop), split)
        texts = [i.text for step in steps for i in step if isinstance(i, Content)]
        assert "".join(texts) == reply.content == content, split
        assert len(texts) > 1 and reply.calls == []


def test_content_written_before_a_call_in_the_same_piece_goes_out_first():
    """One piece may hold the end of the content, the marker and a call's
    start: the content is out before the call starts, never after it."""
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    chat = _chat(tools=[TOOL])
    for pieces in ([text], [text[:40], text[40:]], list(text)):
        reply = Reply(iter(pieces[1:]), pieces[0], chat, 100, "s", "ns", HERMES)
        items = reply.collect_items()
        kinds = [type(i).__name__ for i in items if not (isinstance(i, Content) and not i.text)]
        first_call = kinds.index("CallStart")
        assert set(kinds[:first_call]) == {"Content"} and "Content" not in kinds[first_call:]
        assert "".join(i.text for i in items if isinstance(i, Content)) == "Let me look.\n"
        (call,) = [i for i in items if isinstance(i, ToolCall)]
        assert "".join(i.text for i in items if isinstance(i, CallArguments)) == call.arguments
        assert [i.id for i in items if isinstance(i, CallStart)] == [call.id]


class _Reported:
    """A turn's stream that has ended, with its report."""

    def __init__(self, report):
        self.report = report

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration


def test_a_reply_max_tokens_ends_after_complete_calls_finishes_for_length():
    """Complete calls the model did not end its reply after (max_tokens came
    first: it might have written more) finish for "length", as a cut inside a
    call does; the same calls ended by the model finish for "tool_calls"."""
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>\n'
    text = call.format("Paris") + call.format("Rome")
    for last, reason in ((3, "length"), (7, "tool_calls")):
        report = types.SimpleNamespace(generated_tokens=30, output_ids=[1, 2, last])
        reply = Reply(_Reported(report), text, _chat(tools=[TOOL]), 30, "s", "ns", HERMES)
        reply.collect_items()
        assert [c.arguments for c in reply.calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
        assert reply.finish_reason({7}) == reason
