"""The README's "Use" example runs as written (tiny llama, no hub), and does
what its comments say: the second turn reuses the first, the file is written."""

from __future__ import annotations

import contextlib
import io
import os

from helpers import ROOT


def _use_example() -> str:
    text = (ROOT / "README.md").read_text("utf-8")
    section = text.split("\n## Use\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```\n", 1)[0]


def test_the_use_example_runs_as_written(tmp_path):
    code = _use_example()
    assert len(code.splitlines()) <= 20  # a front page's example
    namespace: dict = {}
    here = os.getcwd()
    os.chdir(tmp_path)  # it saves alice.safetensors where it runs
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(here)
    turn = namespace["turn"]
    assert (
        turn.reused_tokens > 0 and turn.prompt_tokens == turn.reused_tokens + turn.prefilled_tokens
    )
    assert printed.getvalue() == namespace["mgr"].messages("alice")[-1]["content"]
    assert (tmp_path / "alice.safetensors").exists()
    assert (
        namespace["out"].shape[1]
        > namespace["tokenizer"]("Hi", return_tensors="pt").input_ids.shape[1]
    )
