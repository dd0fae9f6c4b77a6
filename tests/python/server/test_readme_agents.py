"""The README's "Agents" examples, run as written against a real `kvchat serve
tiny` (only the port differs): the OpenAI Agents SDK one here, the LangChain
one in ``make test-clients`` (tests/clients), which has langchain-openai."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types

import pytest
from helpers import ROOT
from kvchat.serve.process import ServerProcess

pytestmark = pytest.mark.server

README = ROOT / "README.md"
URL = "http://127.0.0.1:8000/v1"


def readme_agents_blocks() -> list[str]:
    """The python blocks of the README's "## Agents" section, in order."""
    text = README.read_text("utf-8")
    section = text.split("\n## Agents\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


class TinyServer(ServerProcess):
    """`kvchat serve tiny --api-key sk-local`, as the README starts it."""

    def __init__(self):
        super().__init__(
            lambda port: (
                [sys.executable, "-m", "kvchat.serve", "tiny", "--api-key", "sk-local"]
                + ["--port", str(port)]
            )
        )


def run_block(code: str, url: str) -> dict:
    """Runs ``code`` as a module of its own (pydantic resolves its annotations
    there); returns its namespace."""
    assert URL in code
    module = types.ModuleType("readme_example")
    sys.modules[module.__name__] = module
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            code = compile(code.replace(URL, f"{url}/v1"), "README.md", "exec")
            exec(code, module.__dict__)  # noqa: S102
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def test_the_agents_sdk_example_runs_as_written():
    blocks = readme_agents_blocks()
    assert len(blocks) == 2 and "from agents import" in blocks[0]
    server = TinyServer()
    try:
        scope = run_block(blocks[0], server.url)
    finally:
        server.stop()
    result = scope["result"]
    assert isinstance(result.final_output, scope["Verdict"])
    assert len(result.raw_responses) == 2  # the tool call, then the answer
    usage = result.raw_responses[1].usage
    assert usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens
