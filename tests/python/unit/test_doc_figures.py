"""A table of figures in the docs is what the command it names wrote:
docs/agents.md's llguidance / xgrammar table is
benchmarks/results/grammar-*.json (``python benchmarks/grammar.py --vocab
llama-bpe``, then ``qwen2`` in parentheses), rounded as printed. No model."""

from __future__ import annotations

import json
import re

from helpers import ROOT

PAGE = ROOT / "docs" / "agents.md"
HEADING = "## Why llguidance, not xgrammar"
# Each row's figures, per library, in the order a cell prints them (llama-bpe's,
# then qwen2's in parentheses): (result key, scale to the printed unit).
ROWS = {
    "wrap the tokenizer": [("wrap_tokenizer_s", 1)],
    "compile the schema": [("compile_ms", 1)],
    "mask per token, median": [("mask_us_median", 1)],
    "mask per token, mean / max": [("mask_us_mean", 1), ("mask_us_max", 1e-3)],
}


def _results(vocab: str) -> dict[str, dict]:
    data = json.loads((ROOT / "benchmarks" / "results" / f"grammar-{vocab}.json").read_text())
    return {r["library"]: r for r in data["results"]}


def _table() -> dict[str, list[str]]:
    section = PAGE.read_text().split(f"\n{HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return {cells[0]: cells[1:3] for row in rows for cells in [row.strip("|").split("|")]}


def _close(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to as many decimals as it shows."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= 0.5 * 10**-decimals + 1e-9


def test_the_grammar_table_is_what_the_benchmark_wrote():
    table = {name.split(" (")[0].strip(): cells for name, cells in _table().items()}
    results = {vocab: _results(vocab) for vocab in ("llama-bpe", "qwen2")}
    for row, figures in ROWS.items():
        for column, library in enumerate(("llguidance", "xgrammar")):
            printed = re.findall(r"\d+(?:\.\d+)?", table[row][column])
            expected = [
                results[vocab][library][key] * scale
                for vocab in ("llama-bpe", "qwen2")
                for key, scale in figures
            ]
            assert len(printed) == len(expected), (row, library, printed)
            for text, value in zip(printed, expected, strict=True):
                assert _close(text, value), f"{row}, {library}: {text} is not {value}"
