"""Agent loops through kvchat serve with the ``openai`` SDK: a random tiny
model calls a tool because ``tool_choice`` makes it (a grammar), the client
sends the call and the tool's result back, and the model answers.

Every reply is compared token for token with plain ``model.generate`` on the
full conversation with the same grammar (float64), and every turn from the
second must reuse at least 90% of its prompt."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import common_prefix, history_ids, reference_turn
from kvchat.agents import detect
from kvchat.agents.grammar import Grammars
from kvchat.prompting import end_ids, render_prompt, render_text
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import SMOLLM3, template_text
from serving import KEY_A, family_of, function_tool, reference_model, start_server

pytestmark = pytest.mark.server

# Parameters of enums and booleans: a random model fills a free string
# forever, but any choice here closes in a few tokens.
WEATHER = function_tool(
    "get_weather",
    "The weather where the user is.",
    {"unit": {"enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
)
CLOCK = function_tool("get_time", "The time now.", {"zone": {"enum": ["utc", "local"]}})
TOOLS = [WEATHER, CLOCK]
SYSTEM = {
    "role": "system",
    "content": "You are a helpful assistant with tools. Call a tool when it helps, "
    "then answer in one sentence. " * 4,
}
CALL_TOKENS = 160  # room for a call's markup in the tiny byte-level vocabulary
ANSWER_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def server(request):
    yield from start_server(f"tiny:{request.param}")


# Real templates served from a folder: (the template, the tiny model's family).
LFM2_TEMPLATE = ("LFM2.5-8B-A1B", "lfm2")  # Python calls, on the hybrid
GPT_OSS_TEMPLATE = ("openai-gpt-oss-120b", "llama")  # harmony channels
QWEN_XML_TEMPLATE = ("Qwen3.5-4B", "llama")  # XML parameters
SMOLLM3_TEMPLATE = (SMOLLM3, "llama")  # tools as xml_tools; calls sent back not rendered


@pytest.fixture(
    scope="module",
    params=[LFM2_TEMPLATE, GPT_OSS_TEMPLATE, QWEN_XML_TEMPLATE, SMOLLM3_TEMPLATE],
    ids=lambda p: p[0],
)
def template_server(request, tmp_path_factory):
    """``kvchat serve`` on a folder: a tiny model with a real chat template
    whose tool-call markup is not the tiny ChatML's."""
    template, family = request.param
    folder = tmp_path_factory.mktemp(template)
    reference_model(family).save_pretrained(folder)
    _template_tokenizer(template).save_pretrained(folder)
    for server in start_server(str(folder)):
        server.template, server.family = template, family
        yield server


def _template_tokenizer(template: str):
    return tiny_tokenizer(template_text(template))


def _grammars(family: str, tokenizer=None) -> Grammars:
    """What the server builds its grammars with, for the reference."""
    tokenizer, model = tokenizer or tiny_tokenizer(), reference_model(family)
    return Grammars(tokenizer, model.config.vocab_size, end_ids(tokenizer, model.generation_config))


def _grammar_processor(family: str, tools, parallel: bool, tokenizer=None):
    grammars = _grammars(family, tokenizer)
    grammar = grammars.tool_calls(detect(tokenizer or tiny_tokenizer()), tools, parallel)
    return grammars.processor(grammar, "tool_choice")


def _last_output(server, session: str) -> tuple:
    return tuple(server.session(session)["last_turn"]["output_ids"])


def _reference_ids(family, messages, max_new, tokenizer=None, **kwargs) -> tuple:
    model, tokenizer = reference_model(family), tokenizer or tiny_tokenizer()
    return reference_turn(model, tokenizer, messages, max_new, tools=TOOLS, **kwargs)[2]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_tool_loop_is_exact_and_reuses_its_prompt(server, stream):
    _tool_loop(server, family_of(server), tiny_tokenizer(), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_forced_tool_loop_on_a_real_templates_markup(template_server, stream):
    """The same loop on LFM2.5's template (the hybrid; forced calls written as
    Python, read back into JSON arguments, rendered back as Python), on
    gpt-oss's (calls in a harmony channel, answers read from the reply), on
    Qwen3.5's (XML parameters, streamed one by one as JSON) and on SmolLM3's
    (tools given as ``xml_tools``; the calls sent back, which it does not
    render, written into the history as the model wrote them)."""
    server = template_server
    _tool_loop(server, server.family, _template_tokenizer(server.template), stream, rounds=2)


def _only_the_new_message_prefilled(usage: dict, tokenizer, messages: list, tools=TOOLS) -> None:
    """Settled between turns: the turn reused every token its history renders
    to, so it prefilled only its last message and the generation prompt."""
    prompt = render_prompt(tokenizer, messages, tools=tools)
    held = common_prefix(history_ids(tokenizer, messages[:-1], tools), prompt)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= min(held, prompt.numel() - 1), (cached, held, prompt.numel())
    assert cached >= 0.9 * usage["prompt_tokens"], usage


def _tool_loop(server, family: str, tokenizer, stream: bool, rounds: int = 3) -> None:
    client = server.client()
    key = f"loop-{stream}"
    messages = [SYSTEM, {"role": "user", "content": "What should I wear today?"}]
    for turn in range(rounds):
        # The first turn of each round must call a tool; the next answers
        # (tool_choice back to auto, as the Agents SDK does after a tool ran).
        kwargs = dict(
            model=server.model,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=CALL_TOKENS,
            temperature=0,
            prompt_cache_key=key,
        )
        message, finish, usage = _complete(client, stream, **kwargs)
        assert finish == "tool_calls" and message["content"] is None
        (call,) = message["tool_calls"]
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        tool = next(t for t in TOOLS if t["function"]["name"] == name)
        assert set(arguments) == set(tool["function"]["parameters"]["required"])
        processor = _grammar_processor(family, TOOLS, parallel=False, tokenizer=tokenizer)
        expected = _reference_ids(
            family,
            messages,
            CALL_TOKENS,
            tokenizer,
            logits_processor=[processor],
            suppress_tokens=None,
        )
        assert _last_output(server, key) == expected
        if turn:
            _only_the_new_message_prefilled(usage, tokenizer, messages)
        result = {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'}
        _shows_the_tools_and_the_call(tokenizer, messages, [message, result], name)
        messages += [message, result]
        server.settled()  # the tool's time: the session settles meanwhile

        message, finish, usage = _complete(
            client, stream, **{**kwargs, "tool_choice": "auto", "max_tokens": ANSWER_TOKENS}
        )
        assert _last_output(server, key) == _reference_ids(
            family, messages, ANSWER_TOKENS, tokenizer
        )
        _only_the_new_message_prefilled(usage, tokenizer, messages)
        messages += [message, {"role": "user", "content": f"And in {turn + 2} hours?"}]
        server.settled()  # the user's time to read and type


def _shows_the_tools_and_the_call(tokenizer, messages, sent_back, name: str) -> None:
    """What the model reads (the render the replies above were checked
    against) lists every tool, and once the call is sent back, holds it:
    so for SmolLM3's template, which reads tools from xml_tools and renders
    no call (kvchat writes it into the content)."""
    before = render_text(tokenizer, messages, tools=TOOLS)
    assert all(tool["function"]["name"] in before for tool in TOOLS), before
    after = render_text(tokenizer, [*messages, *sent_back], tools=TOOLS)
    assert after.count(name) > before.count(name), after


ONE_CALL = dict(tools=TOOLS, parallel_tool_calls=False)


def _named(name: str) -> dict:
    """tool_choice naming one function."""
    return {"type": "function", "function": {"name": name}}


def _create(server, key: str, messages: list, max_tokens: int, **extra):
    """One greedy request on session ``key``, through the openai SDK."""
    return server.client().chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        prompt_cache_key=key,
        **extra,
    )


def _complete(client, stream: bool, **kwargs) -> tuple[dict, str, dict]:
    """(the assistant message as a client sends it back, finish_reason, usage)."""
    if not stream:
        response = client.chat.completions.create(**kwargs)
        choice = response.choices[0]
        message = choice.message.model_dump(exclude_none=True, exclude={"refusal"})
        message.setdefault("content", None)
        return message, choice.finish_reason, response.usage.model_dump()
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"arguments": ""})
                if delta.id:
                    call.update(id=delta.id, name=delta.function.name)
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ]
    return message, finish, usage


def test_a_named_function_is_the_one_called(server):
    family = family_of(server)
    messages = [SYSTEM, {"role": "user", "content": "Time?"}]
    for name in ("get_time", "get_weather"):
        key = f"named-{name}"
        # One call: a random model may chain calls until max_tokens cuts one short.
        response = _create(server, key, messages, CALL_TOKENS, **ONE_CALL, tool_choice=_named(name))
        calls = response.choices[0].message.tool_calls
        assert calls and {c.function.name for c in calls} == {name}
        assert response.choices[0].finish_reason == "tool_calls"
        named = [t for t in TOOLS if t["function"]["name"] == name]
        processor = _grammar_processor(family, named, parallel=False)
        expected = _reference_ids(
            family, messages, CALL_TOKENS, logits_processor=[processor], suppress_tokens=None
        )
        assert _last_output(server, key) == expected


def test_tools_beside_a_json_format_let_the_model_call_or_answer(server):
    """tool_choice auto, tools and a response_format (what the Agents SDK sends
    with an output_type): the grammar allows a call or the JSON, and the reply
    is read as whichever the model wrote, exactly as plain generate writes it."""
    family = family_of(server)
    tokenizer = tiny_tokenizer()
    grammars = _grammars(family)
    for i, question in enumerate(["Rain?", "Sun?", "Wind today?"]):
        key = f"call-or-json-{i}"
        messages = [SYSTEM, {"role": "user", "content": question}]
        schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
        response = _create(server, key, messages, CALL_TOKENS, **ONE_CALL, response_format=schema)
        choice = response.choices[0]
        if choice.message.tool_calls:  # which of the two is the model's own affair
            assert choice.finish_reason == "tool_calls"
        else:
            assert set(json.loads(choice.message.content)) == {"answer", "sure"}
        grammar = grammars.tool_calls(detect(tokenizer), TOOLS, parallel=False, or_json=SCHEMA)
        processor = grammars.processor(grammar, "response_format")
        expected = _reference_ids(
            family, messages, CALL_TOKENS, logits_processor=[processor], suppress_tokens=None
        )
        assert _last_output(server, key) == expected


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "response_format",
    [
        {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
        },
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
def test_structured_output_matches_its_schema_and_plain_generate(server, response_format):
    family = family_of(server)
    messages = [SYSTEM, {"role": "user", "content": "Is it raining?"}]
    key = f"json-{response_format['type']}"
    response = _create(server, key, messages, CALL_TOKENS, response_format=response_format)
    content = response.choices[0].message.content
    tokenizer, model, grammars = tiny_tokenizer(), reference_model(family), _grammars(family)
    if response_format["type"] == "json_schema":
        value = json.loads(content)
        assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["sure"], bool)
        assert set(value) == {"answer", "sure"}
        schema = SCHEMA
    else:
        # A free object: a random model may not close it within max_tokens,
        # but whatever it wrote is the grammar's, so it starts as an object.
        assert content.startswith("{")
        schema = {"type": "object"}
    processor = grammars.processor(grammars.json_schema(schema), "response_format")
    expected = reference_turn(
        model, tokenizer, messages, CALL_TOKENS, logits_processor=[processor], suppress_tokens=None
    )[2]
    assert _last_output(server, key) == expected


def test_tool_choice_none_and_auto_leave_a_random_model_writing_text(server):
    """Without a grammar the tiny model writes words: no tool call appears,
    and the reply is plain generate's."""
    family = family_of(server)
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    for choice in ("none", "auto"):
        key = f"free-{choice}"
        response = _create(server, key, messages, ANSWER_TOKENS, tools=TOOLS, tool_choice=choice)
        assert response.choices[0].message.tool_calls is None
        assert response.choices[0].finish_reason in ("stop", "length")
        assert _last_output(server, key) == _reference_ids(family, messages, ANSWER_TOKENS)


def test_the_settle_predicts_the_tool_calls_sent_back(server):
    """After a tool-call turn the session is settled on the message the client
    gets back (structured tool_calls, content None), so the next turn
    prefills only the tool's result and the generation prompt."""
    key = "settled-call"
    messages = [SYSTEM, {"role": "user", "content": "Weather?"}]
    named = _named("get_weather")
    response = _create(server, key, messages, CALL_TOKENS, **ONE_CALL, tool_choice=named)
    message = response.choices[0].message.model_dump(exclude_none=True, exclude={"refusal"})
    message["content"] = None
    call = message["tool_calls"][0]
    server.settled()
    result = {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"}
    after = [*messages, message, result]
    tokenizer = tiny_tokenizer()
    history = tokenizer.apply_chat_template([*messages, message], tools=TOOLS, tokenize=False)
    full = tokenizer.apply_chat_template(
        after, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert full.startswith(history)
    _create(server, key, after, 2, tools=TOOLS)
    last = server.session(key)["last_turn"]
    new = len(tokenizer(full[len(history) :], add_special_tokens=False)["input_ids"])
    assert last["prefilled_tokens"] <= new + 2, last


def test_bad_tools_are_refused_through_the_sdk_and_touch_no_session(server):
    """What the openai SDK sends for tools kvchat cannot call or constrain
    (test_serve.py's table covers the rest of the row, by raw request)."""
    client = server.client()
    base = dict(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    not_object = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    bad_name = [{"type": "function", "function": {"name": "a b\nc"}}]
    cases = [
        (dict(tools=not_object, tool_choice="required"), "tools[0].parameters"),
        (dict(tools=bad_name), "tools[0].name"),
        (dict(tools=[{"type": "web", "function": {"name": "f"}}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", extra_body={"min_tokens": 5}), "min_tokens"),
    ]
    server.settled()  # an earlier test's settle could still change its session
    before = server.get("/v1/sessions").json()["data"]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**base, **extra, prompt_cache_key="bad")
        assert error.value.body["param"] == param, (extra, error.value.body)
        assert error.value.body["code"] == "invalid_value"
    assert server.get("/v1/sessions").json()["data"] == before


@pytest.mark.parametrize("template_server", [GPT_OSS_TEMPLATE], ids=["gpt-oss"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_gpt_oss_without_tools_chats_and_answers_in_json(template_server, stream):
    """With no tools the server now reads gpt-oss's reply for its channels
    (tests/python/unit/test_reply.py shows what that reads; a random model
    writes no channel markup here): a chat stays exact, and settled, over two
    turns, and a JSON response_format gets the schema's grammar, not a
    tool-call grammar, which a request without tools has nothing for (a 500
    when it was tried)."""
    server = template_server
    tokenizer, model = _template_tokenizer(server.template), reference_model(server.family)
    client = server.client()
    key = f"gpt-oss-no-tools-{stream}"
    common = dict(model=server.model, temperature=0, prompt_cache_key=key)
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    for turn in range(2):
        message, finish, usage = _complete(
            client, stream, messages=messages, max_tokens=ANSWER_TOKENS, **common
        )
        assert finish in ("stop", "length") and "tool_calls" not in message
        expected = reference_turn(model, tokenizer, messages, ANSWER_TOKENS)[2]
        assert _last_output(server, key) == expected
        if turn:
            _only_the_new_message_prefilled(usage, tokenizer, messages, tools=None)
        messages += [message, {"role": "user", "content": "And then?"}]
        server.settled()

    schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
    message, finish, _ = _complete(
        client, stream, messages=messages, max_tokens=CALL_TOKENS, response_format=schema, **common
    )
    value = json.loads(message["content"])
    assert set(value) == {"answer", "sure"} and finish == "stop"
    grammars = _grammars(server.family, tokenizer)
    processor = grammars.processor(grammars.json_schema(SCHEMA), "response_format")
    expected = reference_turn(
        model, tokenizer, messages, CALL_TOKENS, logits_processor=[processor], suppress_tokens=None
    )[2]
    assert _last_output(server, key) == expected


@pytest.mark.parametrize("template_server", [LFM2_TEMPLATE], ids=["lfm2"], indirect=True)
def test_a_name_lfm2s_python_calls_cannot_hold_is_refused_by_name(template_server):
    """A tool or parameter name that is no Python name cannot be written in
    LFM2's calls: forcing a call of it is a 400 naming it, with no session."""
    server = template_server
    server.settled()
    before = server.get("/v1/sessions").json()["data"]
    digit_first = function_tool("2fast", "Fast.", {"x": {"type": "integer"}})
    spaced = function_tool("slow", "Slow.", {"a b": {"type": "integer"}})
    for tools, name in ((digit_first, "'2fast'"), (spaced, "'a b'")):
        with pytest.raises(openai.BadRequestError) as error:
            _create(server, "bad-name", [SYSTEM], 8, tools=[tools], tool_choice="required")
        assert error.value.body["param"] == "tool_choice" and name in error.value.body["message"]
    assert server.get("/v1/sessions").json()["data"] == before


def _forced_weather(server, **more) -> dict:
    """A greedy request that must call get_weather, once."""
    return dict(
        model=server.model,
        messages=[SYSTEM, {"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=_named("get_weather"),
        parallel_tool_calls=False,
        temperature=0,
        **more,
    )


@pytest.mark.parametrize("template_server", [QWEN_XML_TEMPLATE], ids=["qwen-xml"], indirect=True)
def test_a_forced_xml_calls_parameters_stream_one_by_one(template_server):
    """In an XML format a forced call's arguments are JSON only once read:
    each parameter goes out when its closing tag is written, then the brace,
    and the pieces join into the arguments the same request answered whole
    has (the typed values: "hourly" a boolean, not the text True)."""
    server = template_server
    kwargs = _forced_weather(server, max_tokens=CALL_TOKENS)
    deltas = []
    for chunk in server.client().chat.completions.create(**kwargs, stream=True, user="xml"):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
    first, pieces = deltas[0], [d.function.arguments for d in deltas[1:]]
    assert first.id and first.function.name == "get_weather" and first.function.arguments == ""
    whole = server.client().chat.completions.create(**kwargs, user="xml-whole")
    (call,) = whole.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert "".join(pieces) == call.function.arguments
    assert len(pieces) == len(arguments) + 1 and pieces[-1] == "}", pieces
    assert isinstance(arguments["hourly"], bool), arguments


def _streamed_response_call(server, **request):
    """One greedy streamed POST /v1/responses whose reply is one call: (its
    function_call_arguments.delta pieces, its .done event, its output item)."""
    events = list(
        server.client().responses.create(
            model=server.model,
            parallel_tool_calls=False,
            max_output_tokens=CALL_TOKENS,
            temperature=0,
            store=False,
            stream=True,
            **request,
        )
    )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = events[-1].response.output
    return pieces, done, call


@pytest.mark.parametrize("template_server", [QWEN_XML_TEMPLATE], ids=["qwen-xml"], indirect=True)
def test_a_forced_xml_call_streams_its_parameters_through_the_responses_api(template_server):
    """The same through POST /v1/responses: one
    response.function_call_arguments.delta per parameter, then the brace,
    joined into the .done event's arguments and the item's."""
    pieces, done, call = _streamed_response_call(
        template_server,
        input="Weather?",
        tools=[{"type": "function", **WEATHER["function"]}],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    arguments = json.loads(done.arguments)
    assert "".join(pieces) == done.arguments == call.arguments
    assert len(pieces) == len(arguments) + 1 and pieces[-1] == "}", pieces
    assert isinstance(arguments["hourly"], bool), arguments


def test_a_forced_call_cut_short_is_already_out_when_streamed_and_text_when_whole(server):
    """Where a streamed call and a whole one differ (docs/agents.md):
    max_tokens cuts the call after its name. Streamed, its start and the
    arguments written so far are out, then the reply's text follows with
    finish_reason length; answered whole, it is that text."""
    tokenizer = tiny_tokenizer()
    kwargs = _forced_weather(server)
    server.client().chat.completions.create(
        **kwargs, max_tokens=CALL_TOKENS, prompt_cache_key="uncut"
    )
    ids = _last_output(server, "uncut")
    cut = next(k for k in range(len(ids)) if '"arguments": {' in tokenizer.decode(ids[:k])) + 2
    content, deltas, finish = "", [], None
    stream = server.client().chat.completions.create(
        **kwargs, max_tokens=cut, stream=True, prompt_cache_key="cut-stream"
    )
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "length"
    assert deltas and deltas[0].function.name == "get_weather"
    written = "".join(d.function.arguments or "" for d in deltas)
    assert written.startswith("{") and written in content and "<tool_call>" in content
    whole = server.client().chat.completions.create(
        **kwargs, max_tokens=cut, prompt_cache_key="cut-whole"
    )
    choice = whole.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    assert choice.message.content == content


def test_a_forced_calls_arguments_stream_as_they_are_written(server):
    """Under a tool-call grammar the call is certain from its name on: the
    stream gives its index, id and name first, then its arguments in pieces
    as the model writes them, which join into the arguments the same request
    answered whole has (both are plain generate's tokens)."""
    kwargs = _forced_weather(server, max_tokens=CALL_TOKENS)
    deltas = []
    for chunk in server.client().chat.completions.create(**kwargs, stream=True, user="pieces"):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
    first, pieces = deltas[0], [d.function.arguments for d in deltas[1:]]
    assert first.id and first.function.name == "get_weather" and first.function.arguments == ""
    assert {d.index for d in deltas} == {0} and not any(d.id for d in deltas[1:])
    assert len(pieces) > 2, pieces
    whole = server.client().chat.completions.create(**kwargs, user="whole")
    (call,) = whole.choices[0].message.tool_calls
    assert "".join(pieces) == call.function.arguments
    assert set(json.loads(call.function.arguments)) == {"unit", "hourly"}


def _auto_call_or_json(server, key: str, question: str):
    """One request, whole and streamed, where tool_choice auto beside a
    response_format lets the model call or answer: (the whole message, the
    streamed tool-call deltas, the streamed content)."""
    schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
    messages = [SYSTEM, {"role": "user", "content": question}]
    extra = dict(**ONE_CALL, response_format=schema)
    whole = _create(server, f"{key}-whole", messages, CALL_TOKENS, **extra)
    deltas, content = [], ""
    for chunk in _create(server, f"{key}-stream", messages, CALL_TOKENS, **extra, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
    return whole.choices[0].message, deltas, content


def _unforced_calls_stream(server, questions, min_pieces: int) -> None:
    called = 0
    for i, question in enumerate(questions):
        message, deltas, content = _auto_call_or_json(server, f"auto-{i}", question)
        if not message.tool_calls:
            assert not deltas and content == message.content
            continue
        called += 1
        (call,) = message.tool_calls
        first, pieces = deltas[0], [d.function.arguments for d in deltas[1:]]
        assert (first.function.name, first.function.arguments) == (call.function.name, "")
        assert "".join(pieces) == call.function.arguments
        assert len(pieces) >= min_pieces, pieces
    assert called, "the model never called: the test saw no unforced call"


# The tiny llama calls on these (the tiny LFM2 answers in JSON on all of
# them, so it would show nothing); an unforced call is what is tested.
@pytest.mark.parametrize("server", ["llama"], indirect=True)
def test_an_unforced_call_streams_its_arguments_in_pieces_joined_as_answered_whole(server):
    """tool_choice auto beside a response_format: the grammar lets the model
    call or answer, so a call it writes is unforced, read for sure only at
    the reply's end. Streamed, the call still starts with its name, its
    arguments come in pieces as written, and the pieces join into the
    arguments the same request answered whole has."""
    _unforced_calls_stream(server, ["Rain?", "Sun?", "Wind today?"], min_pieces=3)


@pytest.mark.parametrize("template_server", [QWEN_XML_TEMPLATE], ids=["qwen-xml"], indirect=True)
def test_an_unforced_xml_call_streams_one_parameter_at_a_time(template_server):
    """The same in Qwen3.5's XML markup: a piece per parameter, then the brace."""
    _unforced_calls_stream(template_server, ["Rain?", "Sun?", "Wind today?"], min_pieces=2)


@pytest.mark.parametrize("server", ["llama"], indirect=True)
def test_an_unforced_call_streams_its_arguments_through_the_responses_api(server):
    """The same through POST /v1/responses: the .delta events of an unforced
    call join into its .done event's arguments and the item's."""
    pieces, done, call = _streamed_response_call(
        server,
        input=[SYSTEM, {"role": "user", "content": "Rain?"}],
        tools=[{"type": "function", **t["function"]} for t in TOOLS],
        text={"format": {"type": "json_schema", "name": "v", "schema": SCHEMA}},
    )
    assert "".join(pieces) == done.arguments == call.arguments and call.status == "completed"
    assert len(pieces) > 2 and isinstance(json.loads(done.arguments), dict), pieces


def _arguments_written(text: str) -> bool:
    """Whether ``text`` holds a call's whole arguments object."""
    header = text.find('"arguments": ')
    if header < 0:
        return False
    try:
        json.JSONDecoder().raw_decode(text, header + len('"arguments": '))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("server", ["llama"], indirect=True)
def test_an_unforced_call_cut_after_its_arguments_leaves_no_json_with_the_client(server):
    """max_tokens ends the reply after the call's arguments, before its
    closing markup: the reply is text (answered whole, it is only text), and
    streamed, the arguments already out are not JSON a client could run."""
    tokenizer = tiny_tokenizer()
    messages = [SYSTEM, {"role": "user", "content": "Rain?"}]
    message, _, _ = _auto_call_or_json(server, "auto-uncut", "Rain?")
    assert message.tool_calls, "the model answered: the test saw no call to cut"
    ids = _last_output(server, "auto-uncut-whole")
    cut = next(k for k in range(len(ids)) if _arguments_written(tokenizer.decode(ids[:k])))
    schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
    extra = dict(**ONE_CALL, response_format=schema)
    deltas, content, finish = [], "", None
    for chunk in _create(server, "auto-cut", messages, cut, **extra, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "length" and "<tool_call>" in content
    written = "".join(d.function.arguments or "" for d in deltas)
    assert deltas and written.startswith("{") and written in content
    with pytest.raises(ValueError):
        json.loads(written)
    whole = _create(server, "auto-cut-whole", messages, cut, **extra).choices[0]
    assert (whole.finish_reason, whole.message.tool_calls) == ("length", None)
    assert whole.message.content == content


# Schemas llguidance 1.9.1 builds but refuses on the first token every reply
# under them writes ("{"): a row of more than 2,000 alternatives, and an object
# that must hold itself. kvchat finds that before the turn (Grammars.processor).
REFUSED_SCHEMAS = {
    "anyOf-2001": {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            for i in range(2001)
        ]
    },
    "self-ref": {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"next": {"$ref": "#/$defs/n"}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/n",
    },
}
# One llguidance refuses only once the reply has begun: after `{"a": ` and the
# boolean the model chooses, at the object that must hold itself.
LATE_REFUSED_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "n": {"$ref": "#/$defs/n"}},
    "required": ["a", "n"],
    "$defs": REFUSED_SCHEMAS["self-ref"]["$defs"],
}


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _refused(response, param: str = "response_format") -> str:
    """The OpenAI-shaped 400 naming ``param``, short; its message."""
    assert response.status_code == 400, response.text[:500]
    assert len(response.content) < 2000, response.text[:500]
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_value",
        param,
        "invalid_request_error",
    )
    return error["message"]


def _cached(server, key: str, messages: list) -> int:
    usage = _create(server, key, messages, ANSWER_TOKENS).usage
    return usage.prompt_tokens_details.cached_tokens


def _no_grammar_logged(server, since: int) -> None:
    """What the server logged since ``since`` quotes none of the schemas."""
    log = server.output()[since:]
    for text in ('"anyOf"', '"$defs"', "k2000", "value99999", "%json", "x-guidance"):
        assert text not in log, log[-2000:]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("schema", list(REFUSED_SCHEMAS))
def test_a_grammar_llguidance_refuses_is_a_400_and_the_session_keeps_its_cache(
    server, schema, stream
):
    """The 2,001-branch anyOf and the required self-reference were a 500 that
    dropped the session's cache (the next turn reused 0 tokens): now a short
    400 naming response_format, before the turn, streamed or not; the session
    is as it was, and its next plain turn reuses all the cache it held."""
    key = f"refused-{schema}-{stream}"
    following = _second_turn(server, key)
    before, logged = server.session(key), len(server.output())
    body = {
        "model": server.model,
        "messages": following,
        "max_tokens": CALL_TOKENS,
        "prompt_cache_key": key,
        "response_format": _json_format(REFUSED_SCHEMAS[schema]),
        "stream": stream,
    }
    message = _refused(server.post("/v1/chat/completions", json=body))
    assert message.startswith("response_format: llguidance refuses its grammar"), message
    assert server.session(key) == before
    assert before["cached_tokens"] > 0
    assert _cached(server, key, following) == before["cached_tokens"]
    _no_grammar_logged(server, logged)


def _second_turn(server, key: str) -> list:
    """A first plain turn on session ``key`` (its conversation its own: no
    other session's cache can serve it), settled; the messages of a second."""
    messages = [SYSTEM, {"role": "user", "content": f"Hello, {key}"}]
    reply = _create(server, key, messages, ANSWER_TOKENS).choices[0].message.content
    server.settled()
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]


def test_a_grammar_too_large_to_compile_is_a_short_400(server):
    """A 100,000-value enum (1.4 MB of grammar) is refused by its size before
    llguidance compiles it, in a few hundred bytes; so is one under
    tool_choice, naming tool_choice. No 400 quotes the schema."""
    logged = len(server.output())
    values = [f"value{i}" for i in range(100_000)]
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": _json_format({"enum": values}),
    }
    message = _refused(server.post("/v1/chat/completions", json=body))
    assert "bytes" in message and "262144" in message, message
    tool = function_tool("pick", "Pick one.", {"value": {"enum": values}})
    body = {**body, "response_format": None, "tools": [tool], "tool_choice": "required"}
    _refused(server.post("/v1/chat/completions", json=body), "tool_choice")
    # Within the bound, a schema llguidance cannot compile: its error goes on
    # to quote the grammar's line, the whole schema; the 400 keeps the first.
    nonsense = {"type": "nonsense", "enum": values[:10_000]}
    body = {**body, "tools": None, "tool_choice": None, "response_format": _json_format(nonsense)}
    message = _refused(server.post("/v1/chat/completions", json=body))
    assert "Invalid type: nonsense" in message and "value9999" not in message, message
    _no_grammar_logged(server, logged)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_grammar_refused_while_decoding_ends_the_reply_as_a_400(server, stream):
    """llguidance refuses this grammar a few tokens into the reply. That
    raised inside generate (a 500, the session's cache dropped); now the
    processor ends the reply and the client gets a 400 naming response_format,
    or, streamed, an error event after what was sent. The session's next
    plain turn reuses at least the cache it held before."""
    key = f"late-{stream}"
    following = _second_turn(server, key)
    before, logged = server.session(key), len(server.output())
    request = dict(
        model=server.model,
        messages=following,
        max_tokens=CALL_TOKENS,
        prompt_cache_key=key,
        response_format=_json_format(LATE_REFUSED_SCHEMA),
    )
    if stream:
        sent = ""
        with pytest.raises(openai.APIError) as error:
            for chunk in server.client().chat.completions.create(**request, stream=True):
                sent += "".join(c.delta.content or "" for c in chunk.choices)
        assert sent.startswith('{"a": ')  # what was written before the refusal
        body = error.value.body
        assert (body["code"], body["param"]) == ("invalid_value", "response_format"), body
        message = body["message"]
    else:
        message = _refused(server.post("/v1/chat/completions", json=request))
    assert message.startswith("response_format: llguidance refused its grammar while decoding")
    assert len(message) < 400, message
    server.settled()
    assert before["cached_tokens"] > 0
    assert _cached(server, key, following) >= before["cached_tokens"]
    assert 'kvchat_requests_total{status="400"}' in server.get("/metrics").text
    _no_grammar_logged(server, logged)


def test_a_grammar_compiles_inside_its_max_pending_slot(monkeypatch):
    """Compiling a grammar holds one of --max-pending's slots: with one slot,
    a request sent while another's grammar compiles gets 429 (the compile
    sends it, so no clock is involved), and a grammar refused frees its slot."""
    from fastapi.testclient import TestClient
    from kvchat import SessionManager
    from kvchat.serve import ServeConfig, create_app
    from kvchat.serve.turns import ServerTurns

    manager = SessionManager(reference_model("llama"), tiny_tokenizer())
    app = create_app(manager, ServeConfig(model_name="tiny", max_pending=1))
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    constrained = {**plain, "response_format": {"type": "json_object"}}
    meanwhile = []
    compile_grammar = ServerTurns._constrain

    def constrain(self, chat, fmt):
        meanwhile.append(client.post("/v1/chat/completions", json=plain).status_code)
        return compile_grammar(self, chat, fmt)

    monkeypatch.setattr(ServerTurns, "_constrain", constrain)
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=constrained).status_code == 200
        assert meanwhile == [429]
        refused = {**plain, "response_format": _json_format({"type": "nonsense"})}
        assert client.post("/v1/chat/completions", json=refused).status_code == 400
        assert meanwhile == [429, 429]
        monkeypatch.setattr(ServerTurns, "_constrain", compile_grammar)
        assert client.post("/v1/chat/completions", json=plain).status_code == 200


def test_a_refused_reply_is_not_the_conversation_a_keyless_client_continues(server):
    """A keyless chat client's session is found by its conversation. A reply
    its grammar refused while decoding never reached the client, so the
    router keeps the session under the conversation it held: the same
    request sent plain continues that session and reuses its cache."""
    messages = [SYSTEM, {"role": "user", "content": "Hello, keyless refusal"}]
    body = {"model": server.model, "messages": messages, "max_tokens": ANSWER_TOKENS}
    first = server.post("/v1/chat/completions", json=body)
    session = first.headers["X-Session-ID"]
    reply = first.json()["choices"][0]["message"]["content"]
    server.settled()
    held = server.session(session)["cached_tokens"]
    following = [*messages, {"role": "assistant", "content": reply}]
    following.append({"role": "user", "content": "Why?"})
    refused = {**body, "messages": following, "max_tokens": CALL_TOKENS}
    refused["response_format"] = _json_format(LATE_REFUSED_SCHEMA)
    _refused(server.post("/v1/chat/completions", json=refused))
    server.settled()
    again = server.post("/v1/chat/completions", json={**body, "messages": following})
    assert again.headers["X-Session-ID"] == session
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= held > 0


def test_a_streamed_response_whose_grammar_is_refused_ends_with_an_error_event(server):
    """/v1/responses, streamed: the refusal is OpenAI's `error` event, the
    stream's last, and the response is not stored. Whole, it is a 400; both
    name the field as sent, text.format."""
    text_format = {"type": "json_schema", "name": "x", "schema": LATE_REFUSED_SCHEMA}
    body = {
        "model": server.model,
        "input": "Hello",
        "max_output_tokens": CALL_TOKENS,
        "text": {"format": text_format},
    }
    _refused(server.post("/v1/responses", json=body), "text.format")
    body["stream"] = True
    events = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] == "error", last
    assert (last["code"], last["param"]) == ("invalid_value", "text.format"), last
    assert not any(e["type"] == "response.completed" for e in events)
    rid = events[0]["response"]["id"]
    assert server.get(f"/v1/responses/{rid}").status_code == 404


# ------------------------------------------------- forced calls that end (issue 47)
# Parameters as LangChain's convert_to_openai_tool (a Python function) and
# smolagents write them: no additionalProperties, descriptions, and a key with
# a default not required. Before, the tiny llama wrote an extra key after
# "unit" whose name never closed, until max_tokens.
LOOSE = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather where the user is.",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"description": "Which unit.", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"description": "Hour by hour.", "type": "boolean"},
            },
            "required": ["unit"],
        },
    },
}
# A pydantic model nested in another: its parameters refer to their $defs.
PLACE = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "The forecast for a place.",
        "parameters": {
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"enum": [1, 3]}},
            "required": ["place", "days"],
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {
                        "zone": {"enum": ["north", "south"]},
                        "coast": {"type": "boolean"},
                    },
                    "required": ["zone", "coast"],
                }
            },
        },
    },
}


def _exact(server, key, messages, tools, max_tokens, parallel, or_json=None):
    """The session's last reply is plain generate's under the grammar the
    request gets (the named tools, parallel or one call, or the JSON)."""
    family, tokenizer = family_of(server), tiny_tokenizer()
    grammars = _grammars(family)
    grammar = grammars.tool_calls(detect(tokenizer), tools, parallel, or_json=or_json)
    processor = grammars.processor(grammar, "tool_choice")
    expected = reference_turn(
        reference_model(family),
        tokenizer,
        messages,
        max_tokens,
        tools=tools,
        logits_processor=[processor],
        suppress_tokens=None,
    )[2]
    assert _last_output(server, key) == expected


def _arguments_allowed(tool: dict, arguments: dict) -> None:
    """The arguments have the tool's keys only, each of an allowed value."""
    parameters = tool["function"]["parameters"]
    assert set(parameters["required"]) <= set(arguments) <= set(parameters["properties"])
    if tool is PLACE:
        assert set(arguments["place"]) == {"zone", "coast"}, arguments
        assert arguments["place"]["zone"] in ("north", "south") and arguments["days"] in (1, 3)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_named_call_is_one_call_that_ends_on_the_hybrid_too(server, stream):
    """A named tool_choice with parallel_tool_calls left at its default: one
    call, which ends (on the LFM2 hybrid it repeated itself until max_tokens
    and came back as text), plain generate's under a one-call grammar."""
    key = f"named-one-{stream}"
    messages = [SYSTEM, {"role": "user", "content": "Weather?"}]
    kwargs = dict(
        model=server.model,
        messages=messages,
        tools=TOOLS,
        tool_choice=_named("get_weather"),
        max_tokens=CALL_TOKENS,
        temperature=0,
        prompt_cache_key=key,
    )
    message, finish, _ = _complete(server.client(), stream, **kwargs)
    assert finish == "tool_calls" and message["content"] is None, message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    _exact(server, key, messages, [WEATHER], CALL_TOKENS, parallel=False)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_parameters_without_additional_properties_give_a_call_that_ends(server, choice):
    """Parameters that leave additionalProperties unsaid (LangChain's
    bind_tools on a Python function, smolagents): no other key may be
    written, so the call ends and is read as a call with the tool's keys."""
    key = f"loose-{choice}"
    messages = [SYSTEM, {"role": "user", "content": "Weather?"}]
    tool_choice = "required" if choice == "required" else _named("get_weather")
    response = _create(
        server, key, messages, CALL_TOKENS, tools=[LOOSE], tool_choice=tool_choice,
        parallel_tool_calls=False,
    )  # fmt: skip
    choice_ = response.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    (call,) = choice_.message.tool_calls
    _arguments_allowed(LOOSE, json.loads(call.function.arguments))
    _exact(server, key, messages, [LOOSE], CALL_TOKENS, parallel=False)


@pytest.mark.parametrize("how", ["required", "named", "auto-json_object"])
def test_a_tool_whose_parameters_refer_to_their_defs_is_constrained(server, how):
    """pydantic's nested model ({"$ref": "#/$defs/Place"}): under "required",
    a named function and "auto" beside json_object (the Agents SDK with an
    output_type) the grammar resolves it (it was a 400, "Pointer
    '/$defs/Place' does not exist"), and a call has the nested keys."""
    key = f"defs-{how}"
    messages = [SYSTEM, {"role": "user", "content": "Forecast?"}]
    extra: dict = dict(tools=[PLACE], parallel_tool_calls=False)
    or_json = None
    if how == "required":
        extra["tool_choice"] = "required"
    elif how == "named":
        extra["tool_choice"] = _named("forecast")
    else:
        extra["response_format"] = {"type": "json_object"}
        or_json = {"type": "object"}
    response = _create(server, key, messages, CALL_TOKENS, **extra)
    choice = response.choices[0]
    if how != "auto-json_object" or choice.message.tool_calls:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls"
        _arguments_allowed(PLACE, json.loads(call.function.arguments))
    else:
        assert choice.message.content.startswith("{")
    _exact(server, key, messages, [PLACE], CALL_TOKENS, parallel=False, or_json=or_json)


def test_markup_in_an_enum_and_a_key_stays_inside_the_call(server):
    """An enum value and a property name holding the template's closing
    marker: the forced call is read as JSON, not cut at the marker inside a
    string, and comes back as a call with those texts."""
    marked = function_tool(
        "mark",
        "Markup inside.",
        {"x</tool_call>y": {"enum": ["a</tool_call>b", "<tool_call>"]}, "on": {"type": "boolean"}},
    )
    key = "markup-enum"
    messages = [SYSTEM, {"role": "user", "content": "Mark it."}]
    response = _create(server, key, messages, CALL_TOKENS, tools=[marked], tool_choice="required",
                       parallel_tool_calls=False)  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"x</tool_call>y", "on"}, arguments
    assert arguments["x</tool_call>y"] in ("a</tool_call>b", "<tool_call>")
    _exact(server, key, messages, [marked], CALL_TOKENS, parallel=False)


def test_a_special_token_in_an_enum_or_key_is_refused_by_name(server):
    """A text holding a special token (the end token <|im_end|>), which
    llguidance writes as that token so the reply would end mid-string: a 400
    naming the tool and where, and no session touched."""
    server.settled()
    before = server.get("/v1/sessions").json()["data"]
    in_enum = function_tool("ends", "Ends.", {"s": {"enum": ["a<|im_end|>"]}})
    in_key = function_tool("ends", "Ends.", {"k<|im_end|>": {"type": "boolean"}})
    for tool, where in ((in_enum, "enum"), (in_key, "properties")):
        for tool_choice in ("required", _named("ends")):
            with pytest.raises(openai.BadRequestError) as error:
                _create(server, "special", [SYSTEM], 8, tools=[tool], tool_choice=tool_choice)
            body = error.value.body
            assert body["param"] == "tool_choice" and body["code"] == "invalid_value", body
            assert "'ends'" in body["message"] and where in body["message"], body
            assert "<|im_end|>" in body["message"], body
    assert server.get("/v1/sessions").json()["data"] == before


def _parallel_cut(server, key: str) -> tuple[list, int]:
    """A forced reply with parallel calls, cut by max_tokens inside its
    second call: (the messages, the cut)."""
    tokenizer = tiny_tokenizer()
    messages = [SYSTEM, {"role": "user", "content": "Weather and time?"}]
    _create(server, f"{key}-uncut", messages, 3 * CALL_TOKENS, tools=TOOLS,
            tool_choice="required")  # fmt: skip
    ids = _last_output(server, f"{key}-uncut")
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    first = next((k for k, t in enumerate(texts) if t.count("</tool_call>") == 1), None)
    second = next((k for k, t in enumerate(texts) if t.count("<tool_call>") == 2), None)
    assert first is not None and second is not None, texts[-1]  # the model wrote two calls
    return messages, second + 3


# The tiny LFM2 adds calls until max_tokens; the tiny llama writes one.
@pytest.mark.parametrize("server", ["lfm2"], indirect=True)
def test_a_cut_parallel_call_keeps_its_complete_calls(server):
    """max_tokens cuts the second of parallel forced calls: the first,
    complete, comes back in tool_calls (answered whole and streamed), never
    as content, finish_reason length; the cut one is dropped (streamed, its
    start is out already and its arguments are no JSON)."""
    messages, cut = _parallel_cut(server, "cut-parallel")
    extra = dict(tools=TOOLS, tool_choice="required")
    whole = _create(server, "cut-parallel-whole", messages, cut, **extra).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    json.loads(call.function.arguments)
    kwargs = dict(model=server.model, messages=messages, max_tokens=cut, temperature=0,
                  prompt_cache_key="cut-parallel-stream", **extra)  # fmt: skip
    message, finish, _ = _complete(server.client(), True, **kwargs)
    assert finish == "length" and message["content"] is None, message
    first, *rest = message["tool_calls"]
    assert first["function"] == call.function.model_dump()
    assert len(rest) <= 1  # the cut call's start, when it was out
    for cut_call in rest:
        with pytest.raises(ValueError):
            json.loads(cut_call["function"]["arguments"])


# The tiny LFM2 adds calls until max_tokens; the tiny llama writes one.
@pytest.mark.parametrize("server", ["lfm2"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_cut_parallel_call_keeps_its_complete_items_through_the_responses_api(server, stream):
    """The same through POST /v1/responses: the complete call is a completed
    function_call item, the cut one (streamed, given out as it was written)
    incomplete, and the response incomplete (max_output_tokens)."""
    messages, cut = _parallel_cut(server, f"cut-responses-{stream}")
    request = dict(
        model=server.model,
        input=messages,
        tools=[{"type": "function", **t["function"]} for t in TOOLS],
        tool_choice="required",
        max_output_tokens=cut,
        temperature=0,
        store=False,
    )
    if stream:
        events = list(server.client().responses.create(**request, stream=True))
        response = events[-1].response
    else:
        response = server.client().responses.create(**request)
    assert response.status == "incomplete", response
    kinds = [(item.type, item.status) for item in response.output]
    assert kinds[0] == ("function_call", "completed"), kinds
    assert all(kind == ("function_call", "incomplete") for kind in kinds[1:]), kinds
    json.loads(response.output[0].arguments)


@pytest.mark.parametrize("template_server", [QWEN_XML_TEMPLATE], ids=["qwen-xml"], indirect=True)
def test_a_closing_tag_in_an_xml_enum_is_refused_by_name(template_server):
    """Qwen3.5's XML parameters are split at the first "</": an enum value
    holding one cannot come back as written, so forcing a call of it is a 400
    naming the tool and the value, and no session is touched."""
    server = template_server
    server.settled()
    before = server.get("/v1/sessions").json()["data"]
    tagged = function_tool("tag", "Tags.", {"s": {"enum": ["a</b>", "c"]}})
    with pytest.raises(openai.BadRequestError) as error:
        _create(server, "xml-tag", [SYSTEM], 8, tools=[tagged], tool_choice="required")
    body = error.value.body
    assert body["param"] == "tool_choice" and body["code"] == "invalid_value", body
    assert "'tag'" in body["message"] and "'a</b>'" in body["message"], body
    assert server.get("/v1/sessions").json()["data"] == before


@pytest.mark.parametrize("template_server", [QWEN_XML_TEMPLATE], ids=["qwen-xml"], indirect=True)
def test_a_closing_tag_cannot_end_a_forced_xml_call_inside_its_json(template_server):
    """Qwen3.5 writes an object parameter as compact JSON inside its XML tags,
    and the parser splits a call at the first "</": a string in that JSON
    that could be "</tool_call>" (a pattern offers it, so the random model
    takes it where allowed) is kept from it, and the forced call comes back
    as a call (it came back as text), plain generate's under the grammar."""
    server = template_server
    tagged = {"type": "string", "pattern": "^(</tool_call>|ok)$"}
    keys = "abc"
    note = function_tool(
        "note",
        "Notes.",
        {"o": {"type": "object", "properties": dict.fromkeys(keys, tagged), "required": [*keys]}},
    )
    key = "xml-json-tag"
    messages = [SYSTEM, {"role": "user", "content": "Note it."}]
    response = _create(server, key, messages, CALL_TOKENS, tools=[note], tool_choice="required",
                       parallel_tool_calls=False)  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"o": dict.fromkeys(keys, "ok")}
    tokenizer = _template_tokenizer(server.template)
    grammars = _grammars(server.family, tokenizer)
    grammar = grammars.tool_calls(detect(tokenizer), [note], parallel=False)
    expected = reference_turn(
        reference_model(server.family),
        tokenizer,
        messages,
        CALL_TOKENS,
        tools=[note],
        logits_processor=[grammars.processor(grammar, "tool_choice")],
        suppress_tokens=None,
    )[2]
    assert _last_output(server, key) == expected
