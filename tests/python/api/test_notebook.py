"""The benchmark notebook runs top to bottom (as `make bench-notebook` does)."""

from __future__ import annotations

import shutil

import nbformat
import pytest
from helpers import ROOT
from nbclient import NotebookClient

pytestmark = pytest.mark.slow


def test_notebook_executes_cleanly(tmp_path):
    # Run a copy inside a scratch tree, so the committed notebook and plot stay as they are.
    bench = tmp_path / "benchmarks"
    shutil.copytree(ROOT / "benchmarks", bench, ignore=shutil.ignore_patterns("out", "*.png"))
    notebook = nbformat.read(bench / "multiturn_latency.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert (bench / "ttft_per_turn.png").stat().st_size > 0
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
