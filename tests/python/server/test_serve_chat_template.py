"""``kvchat serve --chat-template``: the real SmolLM2-135M-Instruct, whose own
template has no tools, served with the ChatML-with-tools template kvchat
ships, runs the OpenAI Agents SDK's default Runner as an agent: the tool
called under ``tool_choice`` "required", its result sent back, and an answer
in words that the model ends by itself, every turn from the second reusing
at least 90% of its prompt."""

from __future__ import annotations

import httpx
import pytest
from helpers import ROOT
from kvchat.pretrained import smollm2_path
from serving import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

TEMPLATE = ROOT / "python" / "kvchat" / "templates" / "chatml-tools.jinja"
INSTRUCTIONS = (  # an agent's instructions, as long as a real one's
    "You are a weather assistant for travellers. When the user asks about the weather in "
    "a place, look it up with the get_weather tool, passing the name of the city. Then "
    "tell the user what the tool said, in one short and friendly sentence. Never make up "
    "a forecast: only repeat what the tool said. If the user asks about anything other "
    "than the weather, say that you only know about the weather."
)
QUESTIONS = ("What is the weather in Paris?", "And what about Rome?")
FORECASTS = {"Paris": "12 degrees and rain", "Rome": "24 degrees and sun"}
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def smollm2_server():
    server = Server(
        str(smollm2_path()),
        *("--dtype", "float32", "--served-model-name", "smollm2"),
        *("--chat-template", str(TEMPLATE)),
    )
    server.model = "smollm2"
    try:
        yield server
    finally:
        server.stop()


def test_the_agents_sdk_runner_calls_a_tool_and_smollm2_ends_its_answer(smollm2_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    bodies = []  # every response as the server sent it

    async def keep(response: httpx.Response) -> None:
        await response.aread()
        bodies.append(response.json())

    http = httpx.AsyncClient(event_hooks={"response": [keep]}, timeout=600)
    client = AsyncOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", http_client=http)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return f"{FORECASTS.get(city, '15 degrees and cloud')} in {city}."

    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIResponsesModel("smollm2", openai_client=client),
        # The SDK's default reset_tool_choice: "auto" again once the tool ran.
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=MAX_TOKENS,
        ),
    )
    config = RunConfig(tracing_disabled=True)
    im_end = _smollm2_tokenizer().convert_tokens_to_ids("<|im_end|>")
    conversation, answers, last_ids = [], [], []
    for question in QUESTIONS:  # a second question continues the conversation
        conversation.append({"role": "user", "content": question})
        result = Runner.run_sync(agent, conversation, run_config=config, max_turns=3)
        answers.append(result.final_output)
        conversation = result.to_input_list()
        (session,) = smollm2_server.get("/v1/sessions").json()["data"]  # one conversation
        last_ids.append(smollm2_server.session(session["id"])["last_turn"]["output_ids"][-1])
    assert calls == ["Paris", "Rome"]
    assert len(bodies) == 4  # per question: the call, then the answer
    calls_made = [[i["type"] for i in body["output"]] for body in bodies]
    assert calls_made == [["function_call"], ["message"]] * 2, calls_made
    for answer in answers:  # words, no markup
        assert isinstance(answer, str) and answer.strip(), answers
        assert "<tool_" not in answer and "</" not in answer, answers
    # Each answer ends by itself, on an end token: completed, not cut at max tokens.
    for body in bodies[1::2]:
        assert body["status"] == "completed" and body["incomplete_details"] is None, body
        assert body["usage"]["output_tokens"] < MAX_TOKENS, body["usage"]
    assert last_ids == [im_end, im_end]  # the template's end of turn
    # Every turn from the second reuses all of the prompt the turn before sent.
    # What it prefills is the rest: the reply as the template renders it back
    # (a call re-rendered from JSON departs from the ids generated), the tool's
    # result and the next generation prompt. The SDK sends the next turn at
    # once, before settle_delay: no settle prefilled the re-rendered call first.
    for turn, (before, body) in enumerate(zip(bodies[:-1], bodies[1:], strict=True), start=2):
        usage = body["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert cached >= before["usage"]["input_tokens"], (turn, usage, before["usage"])


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
