"""docs/hybrid-models.md's two tables say what kvchat does with each layer
class and each checkpoint placement; these tests hold them to the code that
decides it (the probe's class table, the accepted ``checkpoints=`` values).
No model."""

from __future__ import annotations

import re

from helpers import ROOT, doc_table_rows
from kvchat.arguments import CHECKPOINT_PLACEMENTS
from kvchat.bridge.layout import ATTENTION, RECURRENT, SLIDING
from kvchat.bridge.probe import PARTS

PAGE = "docs/hybrid-models.md"
LAYERS_HEADING = "each layer by what it can do, never by the model's name:"
# The core state each shape of parts is held in.
STATES = {
    (): "none",
    (ATTENTION,): "AttentionState",
    (SLIDING,): "SlidingWindowState",
    (RECURRENT,): "RecurrentState",
    (ATTENTION, RECURRENT): "HybridState",
    (SLIDING, RECURRENT): "HybridState",
}


def _layer_rows() -> list[tuple[list[str], str]]:
    """(the transformers classes a row names, its kvchat state cell)."""
    text = "\n" + (ROOT / PAGE).read_text()
    section = text.split(f"\n{LAYERS_HEADING}\n", 1)[1]
    lines = [line for line in section.split("\n\n", 1)[0].splitlines() if line.startswith("|")]
    rows = []
    for line in lines[2:]:
        first, state = line.split("|")[1:3]
        classes = []
        for name in re.findall(r"`([A-Za-z{},]+Layer)`", first):
            # `LinearAttentionAnd{Full,SlidingWindow}AttentionLayer` names two.
            if match := re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", name):
                head, options, tail = match.groups()
                classes += [head + option + tail for option in options.split(",")]
            else:
                classes.append(name)
        rows.append((classes, state.strip()))
    return rows


def test_every_layer_class_kvchat_carries_has_the_row_that_says_its_state():
    named = {}
    for classes, state in _layer_rows():
        for name in classes:
            assert name not in named, f"{name} has two rows"
            named[name] = state
    carried = {cls.__name__: parts for cls, parts in PARTS.items()}
    assert set(named) == set(carried), "the table and the probe's classes differ"
    for name, parts in carried.items():
        expected = STATES[parts]
        assert named[name].startswith(f"`{expected}`") or named[name].startswith(expected), (
            f"{name}: the table says {named[name]!r}, the core holds it as {expected}"
        )


def test_the_checkpoint_table_has_a_row_per_placement():
    rows = doc_table_rows(PAGE, "The placement decides the rest:")
    assert [row.split()[0].strip('`"') for row in rows] == list(CHECKPOINT_PLACEMENTS)
