"""The Responses API through kvchat serve, with the ``openai`` SDK and the
OpenAI Agents SDK's default Runner: a tool loop continued by
``previous_response_id`` (and replayed as whole item lists), on an attention
model and a hybrid. Every reply is plain ``generate``'s on the full
conversation with the same grammar (float64), and every turn from the second
reuses at least 90% of its prompt."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import time

import agents
import httpx
import openai
import pytest
from helpers import reference_turn
from kvchat.agents import ToolCall, ToolCallParser, detect
from kvchat.agents.grammar import Grammars
from kvchat.prompting import end_ids
from kvchat.serve.responses_request import chat_tools
from kvchat.tiny import tiny_tokenizer
from serving import KEY_A, KEY_B, auth, family_of, reference_model, start_server

pytestmark = pytest.mark.server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather where the user is.",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
        "required": ["unit", "hourly"],
        "additionalProperties": False,
    },
}
VERDICT = {
    "type": "json_schema",
    "name": "verdict",
    "schema": {
        "type": "object",
        "properties": {"coat": {"type": "boolean"}, "mood": {"enum": ["sunny", "grey"]}},
        "required": ["coat", "mood"],
        "additionalProperties": False,
    },
    "strict": True,
}
INSTRUCTIONS = "You are a helpful assistant. Call a tool when it helps, then answer. " * 4
CALL_TOKENS = 160


@pytest.fixture(scope="module", params=["llama", "lfm2"])
def server(request):
    yield from start_server(f"tiny:{request.param}", "--api-key", KEY_B)


def _reference_reply(server, messages, tools, max_new, grammar=None) -> tuple:
    """Plain generate's output ids for ``messages``, under ``grammar`` if given
    ("tool" for a required call of ``tools``, else a JSON schema)."""
    family = family_of(server)
    tokenizer, model = tiny_tokenizer(), reference_model(family)
    function_tools = chat_tools(tools) if tools else None
    kwargs = {}
    if grammar is not None:
        grammars = Grammars(
            tokenizer, model.config.vocab_size, end_ids(tokenizer, model.generation_config)
        )
        if grammar == "tool":
            text = grammars.tool_calls(detect(tokenizer), function_tools, parallel=False)
        else:
            text = grammars.json_schema(grammar)
        kwargs = dict(logits_processor=[grammars.processor(text, "x")], suppress_tokens=None)
    return reference_turn(model, tokenizer, messages, max_new, tools=function_tools, **kwargs)[2]


def _output_ids(server, key: str) -> tuple:
    return tuple(server.session(key)["last_turn"]["output_ids"])


LAST_EVENTS: list = []  # the last streamed response's events


def _stream(client, **kwargs):
    with client.responses.stream(**kwargs) as events:
        seen = list(events)
        final = events.get_final_response()
    _check_order(seen, final)
    LAST_EVENTS[:] = seen
    return final


def _check_order(events, final) -> None:
    """The events in OpenAI's order: created, in_progress, then each output
    item opened, written and closed in turn, then completed; every event
    numbered, and the deltas adding up to the final items."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    expected = []
    for index, item in enumerate(final.output):
        expected.append(("response.output_item.added", index))
        if item.type == "message":
            expected += [
                ("response.content_part.added", index),
                *[("response.output_text.delta", index)]
                * sum(
                    e.type == "response.output_text.delta" and e.output_index == index
                    for e in events
                ),
                ("response.output_text.done", index),
                ("response.content_part.done", index),
            ]
            deltas = "".join(
                e.delta
                for e in events
                if e.type == "response.output_text.delta" and e.output_index == index
            )
            assert deltas == item.content[0].text
        else:
            pieces = [
                e.delta
                for e in events
                if e.type == "response.function_call_arguments.delta" and e.output_index == index
            ]
            assert pieces and "".join(pieces) == item.arguments
            expected += [("response.function_call_arguments.delta", index)] * len(pieces)
            if item.status != "incomplete":  # a call cut short has no done arguments
                expected.append(("response.function_call_arguments.done", index))
        expected.append(("response.output_item.done", index))
    middle = [(e.type, e.output_index) for e in events[2:-1]]
    assert middle == expected


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_tool_loop_by_previous_response_id_is_exact_and_reuses(server, stream):
    client, key = server.client(), f"responses-{stream}"
    create = (lambda **kw: _stream(client, **kw)) if stream else client.responses.create
    system = {"role": "system", "content": INSTRUCTIONS}
    messages = [system, {"role": "user", "content": "Do I need a coat?"}]
    previous, new_input = None, "Do I need a coat?"
    for turn in range(2):
        common = dict(
            model=server.model,
            instructions=INSTRUCTIONS,
            tools=[WEATHER],
            parallel_tool_calls=False,
            temperature=0,
            prompt_cache_key=key,
        )
        first = create(
            **common,
            input=new_input,
            previous_response_id=previous,
            tool_choice="required",
            max_output_tokens=CALL_TOKENS,
        )
        assert first.status == "completed"
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        if stream:  # a forced call's arguments go out as they are written
            kinds = [e.type for e in LAST_EVENTS]
            assert kinds.count("response.function_call_arguments.delta") > 1, kinds
        assert set(json.loads(call.arguments)) == {"unit", "hourly"}
        expected = _reference_reply(server, messages, [WEATHER], CALL_TOKENS, grammar="tool")
        assert _output_ids(server, key) == expected
        if turn:
            details = first.usage.input_tokens_details
            assert details.cached_tokens >= 0.9 * first.usage.input_tokens
        chat_call = {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        result = '{"celsius": 4, "rain": true}'
        server.settled()  # the tool's time: the session settles meanwhile
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ]
        answer = create(
            **common,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
            previous_response_id=first.id,
            tool_choice="none",  # the answer: JSON only (auto would allow another call)
            text={"format": VERDICT},
            max_output_tokens=CALL_TOKENS,
        )
        assert answer.status == "completed" and answer.previous_response_id == first.id
        verdict = json.loads(answer.output_text)
        assert isinstance(verdict["coat"], bool) and verdict["mood"] in ("sunny", "grey")
        expected = _reference_reply(server, messages, [WEATHER], CALL_TOKENS, VERDICT["schema"])
        assert _output_ids(server, key) == expected
        details = answer.usage.input_tokens_details
        assert details.cached_tokens >= 0.9 * answer.usage.input_tokens
        messages += [
            {"role": "assistant", "content": answer.output_text},
            {"role": "user", "content": "And tomorrow?"},
        ]
        server.settled()  # the user's time to read and type
        previous, new_input = answer.id, "And tomorrow?"


def test_a_forced_call_cut_short_is_closed_incomplete_in_the_stream(server):
    """A forced call goes out as it is written; when max_output_tokens cuts
    it short, the stream closes its item as incomplete with the arguments
    written, and the rest of the reply is a message of its own (a new index).
    Answered whole, the same reply is that text alone, as chat's is."""
    client, tokenizer = server.client(), tiny_tokenizer()
    common = dict(
        model=server.model,
        instructions=INSTRUCTIONS,
        input="Do I need a coat?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        store=False,
    )
    client.responses.create(**common, max_output_tokens=CALL_TOKENS, prompt_cache_key="uncut")
    ids = _output_ids(server, "uncut")
    # Cut two tokens after the arguments begin.
    cut = next(k for k in range(len(ids)) if '"arguments": {' in tokenizer.decode(ids[:k])) + 2
    events = list(
        client.responses.create(
            **common, max_output_tokens=cut, prompt_cache_key="cut-stream", stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    _check_order(events, streamed)  # each item added, written and done in turn
    assert streamed.status == "incomplete"
    call, message = streamed.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert call.name == "get_weather" and call.arguments.startswith("{")
    assert message.type == "message" and "<tool_call>" in message.content[0].text
    whole = client.responses.create(**common, max_output_tokens=cut, prompt_cache_key="cut")
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output[0].content[0].text == message.content[0].text


def test_the_whole_item_list_replayed_reuses_as_well(server):
    """Without previous_response_id (the Agents SDK's default) the client
    sends every item back; the session is found by its conversation."""
    client = server.client()
    items: list = [{"role": "user", "content": "Weather?"}]
    first = client.responses.create(
        model=server.model,
        input=items,
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    call = first.output[0]
    server.settled()
    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "cold"},
    ]
    answer = client.responses.create(
        model=server.model,
        input=items,
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        text={"format": VERDICT},
        max_output_tokens=CALL_TOKENS,
        temperature=0,
    )
    details = answer.usage.input_tokens_details
    assert details.cached_tokens >= 0.9 * answer.usage.input_tokens


def test_previous_response_id_alone_continues_the_session(server):
    """No prompt_cache_key: the response's conversation finds its session,
    and one that ran under a key continues under that key."""
    client = server.client()
    common = dict(model=server.model, instructions=INSTRUCTIONS, temperature=0)
    before = {s["id"] for s in server.get("/v1/sessions").json()["data"]}
    first = client.responses.create(**common, input="Hello there.", max_output_tokens=6)
    previous = first.id
    for turn in range(2):
        server.settled()
        response = client.responses.create(
            **common, input=f"And {turn}?", previous_response_id=previous, max_output_tokens=6
        )
        details = response.usage.input_tokens_details
        assert details.cached_tokens >= 0.9 * response.usage.input_tokens
        previous = response.id
    after = {s["id"] for s in server.get("/v1/sessions").json()["data"]}
    (session,) = after - before  # the three turns ran on one session
    assert len(server.session(session)["history"]) == 7  # system, 3 x (user, assistant)

    keyed = client.responses.create(
        **common, input="Hi.", max_output_tokens=4, prompt_cache_key="keyed-chain"
    )
    client.responses.create(
        **common, input="More.", max_output_tokens=4, previous_response_id=keyed.id
    )
    assert len(server.session("keyed-chain")["history"]) == 5


def test_stored_responses_are_each_keys_own(server):
    mine, other = server.client(KEY_A), server.client(KEY_B)
    response = mine.responses.create(
        model=server.model, input="hi", max_output_tokens=4, temperature=0
    )
    # Cut at max_output_tokens, unless the model ended its turn first.
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 4
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert mine.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as error:  # another key's, to continue
        other.responses.create(
            model=server.model, input="more", previous_response_id=response.id, max_output_tokens=2
        )
    assert error.value.body["param"] == "previous_response_id"
    mine.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)
    unstored = mine.responses.create(
        model=server.model, input="hi", max_output_tokens=2, temperature=0, store=False
    )
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)


BAD = [
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "v"}}}, 400, "text.format"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "store": "yes"}, 400, "store"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, 400, "tools[0].name"),
    (
        {"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools[0].name",
    ),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"enum": [5]}}]},
        400,
        "tools[0].parameters",
    ),
    ({"input": "x", "tool_choice": {"type": "function"}}, 400, "tool_choice.name"),
    ({"input": "x", "metadata": {"blob": "x" * 600}}, 400, "metadata"),
    ({"input": "x", "metadata": [1, 2]}, 400, "metadata"),
    ({"input": "x", "text": {"format": {"type": "text"}, "colour": 1}}, 400, "text"),
    ({"input": "x", "include": 5}, 400, "include"),
]


@pytest.mark.parametrize(("extra", "status", "param"), BAD, ids=[b[2] for b in BAD])
def test_bad_responses_requests_get_openai_errors_and_touch_nothing(server, extra, status, param):
    server.settled()  # an earlier test's settle could still change its session
    before = server.get("/v1/sessions").json()["data"]
    response = server.post("/v1/responses", json={"model": server.model, **extra})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert server.get("/v1/sessions").json()["data"] == before


def test_metadata_that_is_not_valid_unicode_is_a_400(server):
    """A lone surrogate (sent as JSON's escape) in metadata cannot be stored
    as UTF-8: it was a 500, and a streamed request broke mid-stream."""
    for metadata in ({"k": "\ud800"}, {"\ud800": "v"}):
        for stream in (False, True):
            body = {"model": server.model, "input": "x", "metadata": metadata, "stream": stream}
            headers = {"Content-Type": "application/json"}
            response = server.post("/v1/responses", content=json.dumps(body), headers=headers)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "metadata"


def test_a_max_output_tokens_over_the_context_is_named_as_sent(server):
    response = server.post(
        "/v1/responses", json={"model": server.model, "input": "x", "max_output_tokens": 10**6}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert "plus max_output_tokens=1000000 exceeds" in error["message"], error
    assert "max_new_tokens" not in error["message"] and "max_tokens=" not in error["message"]


def test_the_agents_sdk_runner_completes_a_tool_loop(server):
    """The OpenAI Agents SDK's default Runner (the Responses API): the model
    must call the tool first (tool_choice "required"), the SDK runs it and
    sends its result, and the structured final output ends the run (a hook
    sets tool_choice "none" once the tool ran: under "auto", tools beside the
    output type, a random model may call the tool for ever). The second turn
    reuses >= 90%."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        coat: bool
        mood: Literal["sunny", "grey"]  # a free string might never close

    ran = []

    @agents.function_tool
    def get_weather(hourly: bool) -> str:
        """The weather where the user is."""
        ran.append(hourly)
        # A tool takes time, and the server settles the session meanwhile:
        # here, until it has (an instant tool would leave it none).
        server.settled()
        return "4 degrees and rain"

    class OneToolRound(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    key = "agents-key"
    server_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)
    model = agents.OpenAIResponsesModel(model=server.model, openai_client=server_client)
    agent = agents.Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=model,
        output_type=Verdict,
        model_settings=agents.ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=CALL_TOKENS,
            extra_args={"prompt_cache_key": key},
        ),
        reset_tool_choice=False,
    )
    result = agents.Runner.run_sync(
        agent,
        "Do I need a coat?",
        hooks=OneToolRound(),
        run_config=agents.RunConfig(tracing_disabled=True),
    )
    assert len(ran) == 1 and isinstance(result.final_output, Verdict)
    assert len(result.raw_responses) == 2
    second = result.raw_responses[1].usage
    assert second.input_tokens_details.cached_tokens >= 0.9 * second.input_tokens
    history = server.session(key)["history"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(history[-1]["content"]) == result.final_output.model_dump()

    # Each turn as plain generate writes it, with what the SDK sent (the
    # stored responses echo its tools and format).
    first, last = (server.client().responses.retrieve(r.response_id) for r in result.raw_responses)
    tools = [t.model_dump(exclude_none=True) for t in first.tools]
    ids = _reference_reply(server, history[:2], tools, CALL_TOKENS, grammar="tool")
    parser = ToolCallParser(detect(tiny_tokenizer()), chat_tools(tools))
    parser.feed(tiny_tokenizer().decode(ids[:-1]))
    (call,) = [c for c in parser.finish() if isinstance(c, ToolCall)]
    sent = history[2]["tool_calls"][0]["function"]
    assert (call.name, call.arguments) == (sent["name"], sent["arguments"])
    schema = last.text.format.schema_
    expected = _reference_reply(server, history[:4], tools, CALL_TOKENS, grammar=schema)
    assert _output_ids(server, key) == expected


# ------------------------------------------------------------ stored responses' bounds
KEY_C, KEY_D = "key-c", "key-d"
PER_KEY, BYTES_PER_KEY = 5, 12_000
PADDING = {f"pad{i}": "x" * 512 for i in range(16)}  # ~9 KB of metadata, echoed in the record


@pytest.fixture(scope="module")
def bounded():
    """A server whose keys each keep at most 5 stored responses and 12,000 bytes
    of them (a small record is about 1 KB, one padded with PADDING about 9.4 KB)."""
    flags = ("--api-key", KEY_B, "--api-key", KEY_C, "--api-key", KEY_D)
    bounds = ("--responses-per-key", str(PER_KEY), "--response-bytes-per-key", str(BYTES_PER_KEY))
    yield from start_server("tiny:llama", *flags, *bounds)


def _small(client, model, **extra):
    return client.responses.create(
        model=model, input="hi", max_output_tokens=4, temperature=0, **extra
    )


def _kept(client, rid) -> bool:
    try:
        client.responses.retrieve(rid)
    except openai.NotFoundError:
        return False
    return True


def _metric(server, name) -> float:
    """A sample of /metrics (no labels)."""
    match = re.search(rf"^{name} (\S+)$", server.get("/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


def test_one_key_filling_its_stored_responses_never_evicts_anothers(bounded):
    """Key B stores more responses than its bound: its own oldest go (404),
    its newest 5 stay, and key A's response is still read and continued."""
    mine, other = bounded.client(KEY_A), bounded.client(KEY_B)
    first = _small(mine, bounded.model, prompt_cache_key="a-chain", instructions=INSTRUCTIONS)
    filled = [_small(other, bounded.model, store=True).id for _ in range(PER_KEY + 2)]
    assert mine.responses.retrieve(first.id).id == first.id
    assert [_kept(other, rid) for rid in filled] == [False] * 2 + [True] * PER_KEY
    with pytest.raises(openai.NotFoundError) as error:  # continuing an evicted one: 404
        other.responses.create(
            model=bounded.model, input="more", previous_response_id=filled[0], max_output_tokens=2
        )
    assert error.value.body["code"] == "response_not_found"
    bounded.settled()
    more = mine.responses.create(
        model=bounded.model,
        instructions=INSTRUCTIONS,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert more.previous_response_id == first.id
    details = more.usage.input_tokens_details
    assert details.cached_tokens >= 0.9 * more.usage.input_tokens
    assert len(bounded.session("a-chain")["history"]) == 5  # system, 2 x (user, assistant)


def test_a_keys_stored_responses_are_bounded_in_bytes(bounded):
    """Two padded records (~9.4 KB each) exceed the key's 12,000 bytes: the
    newer evicts the older, though the count bound is far. A record larger
    than the whole bound alone is not stored: its body says ``store: false``
    (as its GET's 404 does), and it evicts nothing."""
    client = bounded.client(KEY_C)
    older = _small(client, bounded.model, metadata=PADDING)
    newer = _small(client, bounded.model, metadata=PADDING)
    assert older.store and newer.store
    assert not _kept(client, older.id) and _kept(client, newer.id)
    huge = client.responses.create(
        model=bounded.model,
        input="the " * 1000,  # ~4 KB, ~1,000 tokens: with the padding, over 12,000 bytes
        metadata=PADDING,
        max_output_tokens=2,
        temperature=0,
    )
    assert huge.status in ("completed", "incomplete") and huge.store is False
    assert not _kept(client, huge.id)
    assert _kept(client, newer.id)  # the refused record evicted nothing
    assert "over the 12000 bytes each API key may store" in bounded.output()


def test_stored_responses_and_their_bytes_show_in_metrics(bounded):
    """kvchat_stored_responses and kvchat_stored_response_bytes count every
    key's records: one stored adds one and its bytes, its DELETE takes them
    back exactly; a key past its bound counts the evicted and holds its 5."""
    client = bounded.client(KEY_D)
    records = _metric(bounded, "kvchat_stored_responses")
    nbytes = _metric(bounded, "kvchat_stored_response_bytes")
    evicted = _metric(bounded, "kvchat_stored_responses_evicted_total")
    response = _small(client, bounded.model, metadata={"note": "metrics"})
    assert _metric(bounded, "kvchat_stored_responses") == records + 1
    added = _metric(bounded, "kvchat_stored_response_bytes") - nbytes
    assert 500 < added < 3000, added  # the record: its body and its conversation
    client.responses.delete(response.id)
    assert _metric(bounded, "kvchat_stored_responses") == records
    assert _metric(bounded, "kvchat_stored_response_bytes") == nbytes
    for _ in range(PER_KEY + 1):
        _small(client, bounded.model)
    assert _metric(bounded, "kvchat_stored_responses_evicted_total") == evicted + 1
    assert _metric(bounded, "kvchat_stored_responses") == records + PER_KEY


def test_a_stream_whose_client_left_is_stored_incomplete_and_continues(bounded):
    """A streamed response whose client reads ``response.created`` and a few
    deltas, then closes the connection: its id is stored as ``incomplete``
    (``incomplete_details.reason`` "client_disconnected"), with the text
    written so far, and ``previous_response_id`` continues it on its session."""
    body = {
        "model": bounded.model,
        "instructions": INSTRUCTIONS,
        "input": "Tell me a long story.",
        "max_output_tokens": 2000,
        "min_tokens": 2000,  # it cannot end before the client leaves
        "temperature": 0,
        "stream": True,
        "prompt_cache_key": "left",
    }
    deltas, rid = [], None
    with httpx.Client(timeout=60) as http:
        url = f"{bounded.url}/v1/responses"
        with http.stream("POST", url, json=body, headers=auth(KEY_A)) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                if event["type"] == "response.created":
                    rid = event["response"]["id"]
                elif event["type"] == "response.output_text.delta":
                    deltas.append(event["delta"])
                    if len(deltas) == 3:
                        break  # leaving closes the connection mid-stream
    assert rid is not None
    client = bounded.client(KEY_A)
    deadline = time.monotonic() + 60
    while not _kept(client, rid):  # stored once the turn its client left is finished
        assert time.monotonic() < deadline, "the response was never stored"
        time.sleep(0.1)
    stored = client.responses.retrieve(rid)
    assert stored.status == "incomplete"
    assert stored.incomplete_details.reason == "client_disconnected"
    (message,) = stored.output
    assert message.type == "message" and message.status == "incomplete"  # cut, as OpenAI marks it
    text = message.content[0].text
    assert text.startswith("".join(deltas))  # what the client got, and what followed
    assert 3 <= stored.usage.output_tokens < 2000
    bounded.settled()
    more = client.responses.create(
        model=bounded.model,
        instructions=INSTRUCTIONS,
        input="And then?",
        previous_response_id=rid,
        max_output_tokens=4,
        temperature=0,
    )
    assert more.status in ("completed", "incomplete")
    history = bounded.session("left")["history"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[2]["content"] == text
    details = more.usage.input_tokens_details
    assert details.cached_tokens >= 0.9 * more.usage.input_tokens, details


def _requests_answered(server) -> float:
    match = re.search(
        r'^kvchat_requests_total\{status="200"\} (\S+)$', server.get("/metrics").text, re.M
    )
    return float(match.group(1)) if match else 0.0


def test_a_stream_whose_client_left_before_its_id_is_not_stored(bounded):
    """A client that leaves while its turn prefills never gets the id of
    ``response.created``, so nothing is stored: such records were stored as
    incomplete, each evicting one of the key's own (found by an attack)."""
    records = _metric(bounded, "kvchat_stored_responses")
    answered = _requests_answered(bounded)
    body = json.dumps(
        {
            "model": bounded.model,
            "input": "the " * 1500,  # a prefill long enough to leave during
            "max_output_tokens": 4,
            "stream": True,
            "prompt_cache_key": "never-announced",
        }
    ).encode()
    host, port = bounded.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/responses HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY_B}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 60
    while _requests_answered(bounded) == answered:  # its turn is finished
        assert time.monotonic() < deadline, "the turn never finished"
        time.sleep(0.05)
    time.sleep(1)  # the abandoned turn's response would be stored just after
    assert _metric(bounded, "kvchat_stored_responses") == records


def test_a_shared_tier_that_keeps_no_responses_is_refused():
    """A SharedTier with no ``responses`` nor ``routes`` would leave stored
    responses and routes on one replica while its sessions are shared:
    create_app refuses it, naming it."""
    from helpers import model_for
    from kvchat import SessionManager, SharedTier
    from kvchat.serve import ServeConfig, create_app

    class Elsewhere(SharedTier):
        pass

    manager = SessionManager(model_for("llama"), tiny_tokenizer(), tier=Elsewhere())
    with pytest.raises(ValueError, match="shared tier Elsewhere keeps no stored responses"):
        create_app(manager, ServeConfig(model_name="tiny"))


def test_an_unknown_id_gets_a_short_404(server):
    """A 404 names the id it did not find, shortened: a 20 kB id was echoed whole."""
    for path in ("/v1/responses/", "/v1/sessions/"):
        response = server.get(path + "r" * 20_000)
        assert response.status_code == 404, response.text
        assert len(response.content) < 1000
