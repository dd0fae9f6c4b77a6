"""benchmarks/concurrent_decode.py --compile: what a row says about the
measured turns counts those turns alone, not the warm-up's. The tiny model,
compiled with a backend that runs dynamo's graphs eagerly (seconds, not
inductor's minutes)."""

from __future__ import annotations

import json
import sys

import torch
from helpers import load_benchmark
from transformers import CompileConfig


def _load():
    return load_benchmark("concurrent_decode")


def test_a_compiled_row_counts_only_the_measured_turns(tmp_path, monkeypatch):
    """One conversation, two measured turns, after warm_up and the warm turn:
    the row's compiled_turns is 2 (it was 3, the warm turn counted), and
    nothing compiled while measured."""
    bench = _load()
    manager_class = bench.SessionManager

    def eager_backend(graph_module, example_inputs):
        return graph_module.forward

    def manager(model, tokenizer, compile=False, **options):
        config = CompileConfig(backend=eager_backend, mode=None) if compile else False
        return manager_class(model, tokenizer, compile=config, **options)

    monkeypatch.setattr(bench, "SessionManager", manager)
    argv = ["concurrent_decode.py", "--model", "tiny", "--conversations", "1", "--compile"]
    argv += ["--turns", "2", "--reply-tokens", "4", "--system-tokens", "20"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    torch._dynamo.reset()
    bench.main()
    (path,) = tmp_path.glob("concurrent-decode-tiny-*-compiled.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["compiled_turns"] == 2, row
    assert row["compiles_measured"] == 0, row
