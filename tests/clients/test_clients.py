"""Agent loops through ``kvchat serve tiny`` with the client libraries people
use, each as its documentation shows: the README's LangChain example as
written, LiteLLM's ``completion`` with a forced tool, and a pydantic-ai agent
whose structured output is an output tool. A random tiny model calls tools
because the grammar makes it; LiteLLM's answer turn reuses >= 90%."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel
from test_readme_agents import TinyServer, readme_agents_blocks, run_block

pytestmark = pytest.mark.server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather where the user is.",
        "parameters": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}},
            "required": ["hourly"],
            "additionalProperties": False,
        },
    },
}


class Verdict(BaseModel):
    coat: bool
    sky: Literal["sunny", "grey"]


@pytest.fixture(scope="module")
def server():
    server = TinyServer()
    try:
        yield server
    finally:
        server.stop()


def _session(server, key: str) -> dict:
    import httpx

    response = httpx.get(
        f"{server.url}/v1/sessions/{key}", headers={"Authorization": "Bearer sk-local"}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_the_readme_langchain_example_runs_as_written(server):
    scope = run_block(readme_agents_blocks()[1], server.url)
    call = scope["call"]
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    assert isinstance(call.tool_calls[0]["args"]["hourly"], bool)
    assert call.response_metadata["finish_reason"] == "tool_calls"
    assert isinstance(scope["answer"], scope["Verdict"])


def test_litellm_forced_tool_then_answer_reuses(server):
    import litellm

    common = dict(
        model="openai/tiny",
        api_base=f"{server.url}/v1",
        api_key="sk-local",
        temperature=0,
        user="litellm-loop",  # names the session; LiteLLM passes it through
    )
    messages = [{"role": "user", "content": "Do I need a coat?"}]
    first = litellm.completion(
        **common,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and "hourly" in json.loads(call.function.arguments)
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4 degrees and rain"},
    ]
    answer = litellm.completion(
        **common,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",  # the answer now (auto would let the model call again)
        response_format=Verdict,
        max_tokens=200,
    )
    Verdict.model_validate_json(answer.choices[0].message.content)
    usage = answer.usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens


def test_pydantic_ai_structured_output_through_its_output_tool(server):
    """pydantic-ai sends its output type as a tool, final_result, with
    tool_choice "required": the grammar makes the model call it."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        "tiny", provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="sk-local")
    )
    # The output tool alone: a random model offered a function tool too picks
    # it every time (tool_choice "required" allows either), and never ends.
    agent = Agent(model, output_type=Verdict, model_settings={"temperature": 0, "max_tokens": 200})
    result = agent.run_sync("Do I need a coat?")
    assert isinstance(result.output, Verdict)
    (request,) = [m for m in result.all_messages() if m.kind == "response"]
    assert request.parts[0].tool_name == "final_result"  # pydantic-ai's output tool
