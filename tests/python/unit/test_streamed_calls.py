"""A call followed as it is written (``CallStream``): on what each tool-call
grammar lets a model write (a seeded random walk, no model), fed whole, one
character and three at a time, every call starts with its name before its
arguments, and the pieces join into the arguments the parser reads back;
text that is not the grammar's is not followed. Unforced, the same shape
after content is followed; and a reply cut anywhere never leaves a client
with arguments that parse but are not a call's."""

from __future__ import annotations

import json

import pytest
from grammar_walks import TOOLS, tiny_grammars, walk
from kvchat.agents import ToolCall, ToolCallParser
from kvchat.agents.formats import (
    APERTUS,
    APRIEL,
    COHERE,
    DEEPSEEK_R1,
    DEEPSEEK_V31,
    DEEPSEEK_V32,
    GEMMA4,
    GIGACHAT,
    GIGACHAT_3,
    GLM,
    HARMONY,
    HERMES,
    HY3,
    KIMI,
    KIMI_K3,
    LFM2,
    LLAMA3_JSON,
    MINICPM,
    MINIMAX,
    MINIMAX_M1,
    MINIMAX_M3,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON_V2,
    QWEN_XML,
    SEED_OSS,
    SOLAR,
)
from kvchat.agents.streamed_calls import CallArguments, CallStart, CallStream, streamable

FOLLOWED = [
    HERMES,
    APRIEL,
    MISTRAL_V3,
    MISTRAL_V11,
    KIMI,
    LLAMA3_JSON,
    HARMONY,
    DEEPSEEK_V31,
    DEEPSEEK_R1,
    NEMOTRON_V2,
    COHERE,
    GIGACHAT,
    MINIMAX_M1,
    QWEN_XML,
    GLM,
    MINIMAX,
    SEED_OSS,
    HY3,
    DEEPSEEK_V32,
    MINICPM,
    GIGACHAT_3,
]


def _follow(
    fmt, text: str, step: int, tools=TOOLS, each=None, **kwargs
) -> tuple[list, list[ToolCall]]:
    """(every item given out, the calls), as ``Reply`` gives them: what the
    stream follows of the parser's section, then at the end each parsed
    call's last piece and the call. ``each(items)`` runs after every piece."""
    stream, parser, items, fed = CallStream(fmt, tools, **kwargs), ToolCallParser(fmt, tools), [], 0
    for i in range(0, len(text), step):
        parser.feed(text[i : i + step])
        items += stream.feed(parser.section_text[fed:])
        fed = max(fed, len(parser.section_text))
        if each is not None:
            each(items)
    parser.finish()
    items += stream.settle(parser.calls)
    return items, [i for i in items if isinstance(i, ToolCall)]


@pytest.mark.parametrize("fmt", FOLLOWED, ids=lambda f: f.name)
def test_each_call_starts_with_its_name_and_its_pieces_join_into_its_arguments(fmt):
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=True)
    pieces_seen = 0
    for seed in range(6):
        text = walk(grammars, grammar, seed, limit=4000)  # Hy3's long tags
        for step in (1, 3, len(text)):
            items, calls = _follow(fmt, text, step)
            starts = [i for i in items if isinstance(i, CallStart)]
            assert [(s.index, s.name) for s in starts] == [(i, c.name) for i, c in enumerate(calls)]
            assert [s.id for s in starts] == [c.id for c in calls]
            for index, call in enumerate(calls):
                pieces = [i for i in items if isinstance(i, CallArguments) and i.index == index]
                # Each piece after its call's start, and together its arguments.
                assert items.index(pieces[0]) > items.index(starts[index])
                assert "".join(p.text for p in pieces) == call.arguments, text
                arguments = json.loads(call.arguments)
                assert isinstance(arguments, dict)
                if fmt.grammar.xml is not None:  # one piece a value, then the brace
                    assert len(pieces) == len(arguments) + 1, (pieces, text)
                pieces_seen = max(pieces_seen, len(pieces))
    assert pieces_seen > (2 if fmt.grammar.xml else 10)  # the arguments came in pieces


@pytest.mark.parametrize("fmt", [HERMES, KIMI, HARMONY, QWEN_XML], ids=lambda f: f.name)
def test_text_that_is_not_the_grammars_is_not_followed(fmt):
    for text in ("Sure, here you go.", "<tool_call>\nnot json", " to=functions.f<|chan"):
        items, _ = _follow(fmt, text, 1)
        assert not [i for i in items if isinstance(i, CallArguments)], (fmt.name, text)


def test_only_python_calls_and_formats_without_a_grammar_are_given_whole():
    assert all(streamable(f) for f in FOLLOWED)
    assert not any(streamable(f) for f in (LFM2, GEMMA4, SOLAR, MINIMAX_M3, KIMI_K3, APERTUS, None))


def _arguments_given(items) -> dict[int, str]:
    """Each started call's arguments as a client joins them."""
    out: dict[int, str] = {}
    for item in items:
        if isinstance(item, CallStart):
            out[item.index] = ""
        elif isinstance(item, CallArguments):
            out[item.index] += item.text
    return out


def _json_object(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@pytest.mark.parametrize("fmt", FOLLOWED, ids=lambda f: f.name)
def test_a_reply_cut_anywhere_leaves_no_call_whose_arguments_parse_but_were_not_read(fmt):
    # max_tokens or a stop string can end a reply at any character: a call
    # given out in pieces and then not read back must not look whole.
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=True)
    cut_calls = 0
    for seed in range(3):
        text = walk(grammars, grammar, seed, limit=4000)
        for end in range(1, len(text) + 1, max(1, len(text) // 150)):
            items, calls = _follow(fmt, text[:end], 2)
            for index, given in _arguments_given(items).items():
                if index < len(calls):  # read back: what the client joined is the call's
                    assert given == calls[index].arguments, (text[:end], index)
                else:  # not read back: the client's arguments are not JSON
                    assert _json_object(given) is None, (text[:end], given)
                    cut_calls += 1
    assert cut_calls > 10  # the cut case did happen


CONTENT_THEN_CALLS = [
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    (
        QWEN_XML,
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    (MISTRAL_V11, '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'),
]


@pytest.mark.parametrize("fmt,calls", CONTENT_THEN_CALLS, ids=lambda x: getattr(x, "name", ""))
def test_an_unforced_call_after_content_is_followed_from_the_parsers_marker(fmt, calls):
    text = "Let me look that up.\n" + calls
    for step in (1, 3, len(text)):
        items, parsed = _follow(fmt, text, step)
        starts = [i for i in items if isinstance(i, CallStart)]
        assert [(s.name, s.id) for s in starts] == [("get_time", parsed[0].id)]
        given = _arguments_given(items)[0]
        assert json.loads(given) == {"zone": "UTC"} and given == parsed[0].arguments
        # The last brace comes only with the call read back at the end.
        last_piece = max(k for k, i in enumerate(items) if isinstance(i, CallArguments))
        assert items[last_piece + 1] is parsed[0] and items[last_piece].text.endswith("}")


@pytest.mark.parametrize(
    "arguments,bad",
    [('{"zone": UTC}', "U"), ('{"zone": "utc",}', "}"), ('{"zone": NaN}', "N"), ('["utc"]', "[")],
)
def test_arguments_that_are_not_a_json_object_are_given_out_only_as_far_as_they_are_one(
    arguments, bad
):
    text = f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'
    valid = arguments[: arguments.rindex(bad)]  # the longest start that is an object's
    for step in (1, 4, len(text)):
        items, calls = _follow(HERMES, text, step)
        assert not calls
        for given in _arguments_given(items).values():
            assert valid.startswith(given) and _json_object(given) is None, given


def test_a_call_of_a_tool_the_request_does_not_have_is_not_started():
    text = '<tool_call>\n{"name": "get_stock", "arguments": {"zone": "UTC"}}\n</tool_call>'
    items, _ = _follow(HERMES, text, 1)
    assert not [i for i in items if isinstance(i, (CallStart, CallArguments))]


def test_without_parallel_calls_a_second_call_is_not_started():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    items, calls = _follow(HERMES, call + "\n" + call, 1, max_calls=1)
    assert [i.index for i in items if isinstance(i, CallStart)] == [0]
    assert {i.index for i in items if isinstance(i, CallArguments)} == {0}
    assert len(calls) == 2  # the parser reads both; Reply keeps the first


TYPED = [
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
            },
        },
    }
]


def _hermes(arguments: str) -> str:
    return f'Sure.\n<tool_call>\n{{"name": "plan", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize(
    "arguments, read",
    [
        # The parser casts a string with the schema: "3" is 3, "null" None.
        ('{"city": "Paris", "days": "3"}', {"city": "Paris", "days": 3}),
        ('{"days": "3", "city": "Paris"}', {"days": 3, "city": "Paris"}),
        ('{"city": "Paris", "note": "null"}', {"city": "Paris", "note": None}),
        ('{"city": "Paris", "note": "bring a coat"}', {"city": "Paris", "note": "bring a coat"}),
        # And the strings in a list given for a parameter that is not an array.
        ('{"city": "Paris", "days": ["3", "4"]}', {"city": "Paris", "days": [3, 4]}),
        # Spacing, numbers and escapes json.dumps writes otherwise.
        ('{"city":"Paris","days":3}', {"city": "Paris", "days": 3}),
        ('{"city": "Paris", "days": 3e0}', {"city": "Paris", "days": 3.0}),
        ('{"city": "Par\\u00eds", "days": 3}', {"city": "París", "days": 3}),
        # The parser keeps a duplicate key's last value, and writes 1.5e1 as
        # 15.0: what is out by then differs, so the call keeps the text as
        # written (which reads as the same object).
        ('{"city": "Paris", "city": "Rome"}', {"city": "Rome"}),
        ('{"city": "Paris", "days": 1.5e1}', {"city": "Paris", "days": 15.0}),
        ('{ "city" : "Paris" }', {"city": "Paris"}),
    ],
)
def test_pieces_always_begin_the_arguments_read_back(arguments, read):
    # Pieces are only appended to: whatever the model writes, each must begin
    # the arguments the call ends with, split anywhere.
    def never_whole(items):  # before it is read back
        assert all(_json_object(given) is None for given in _arguments_given(items).values())

    text = _hermes(arguments)
    for step in range(1, len(text) + 1):
        items, (call,) = _follow(HERMES, text, step, tools=TYPED, each=never_whole)
        # The parser's text where the pieces begin it, as a reply read whole has.
        canonical = json.dumps(read, ensure_ascii=False)
        as_written = "Rome" in arguments or "e1" in arguments
        assert call.arguments == canonical or (as_written and call.arguments == arguments)
        assert _arguments_given(items)[0] == call.arguments, step


def test_a_call_cut_between_its_arguments_and_its_closing_markup_is_not_whole():
    # The arguments are all written; only the reply's end tells they are a call.
    text = _hermes('{"city": "Paris", "days": 3}')
    cut = text[: text.rindex("}")]  # the header object's brace and the markup left out
    items, calls = _follow(HERMES, cut, 1, tools=TYPED)
    assert not calls
    (given,) = _arguments_given(items).values()
    assert given == '{"city": "Paris", "days": 3' and _json_object(given) is None


@pytest.mark.parametrize(
    "arguments",
    ['{"days": 1e400}', '{"days": -1e400}', '{"days": ' + "[" * 3000 + "]" * 3000 + "}"]
    + ['{"city": "\\ud800"}'],
    ids=["1e400", "-1e400", "deep", "lone surrogate"],
)
def test_arguments_no_response_can_carry_are_text_and_never_an_error(arguments):
    # inf is not JSON, nesting past Python's recursion limit cannot be read,
    # and a lone surrogate cannot be encoded: the markup stays text, and
    # what was given out does not parse.
    text = _hermes(arguments)
    for step in (1, 5, len(text)):
        items, calls = _follow(HERMES, text, step, tools=TYPED)
        assert not calls
        assert all(_json_object(given) is None for given in _arguments_given(items).values())
    parser = ToolCallParser(HERMES, TYPED)
    content = [i.text for i in parser.feed(text) + parser.finish()]
    assert "".join(content) == text
