"""Client-library tests (``make test-clients``): run in build/clients-venv,
which sees the system's torch and kvchat and adds langchain-openai, LiteLLM,
pydantic-ai, smolagents and the llm CLI. They reuse the server helpers of
tests/python."""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "python"
sys.path[:0] = [str(TESTS), str(TESTS / "server")]  # helpers, serving; test_readme_agents
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
