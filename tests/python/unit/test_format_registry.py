"""``detect`` picks, for every chat template llama.cpp ships
(``build/llama-cpp/templates``), the format it picked before the formats were
split into one module per markup family (``detected_formats.json``, recorded
from the single ``formats.py``), but for the templates whose markup was
added since."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvchat.agents.formats import RULES, detect
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch

BEFORE = json.loads((Path(__file__).parent / "detected_formats.json").read_text())
# Templates that had no format before the split and have one now.
ADDED = {
    "Apertus-8B-Instruct.jinja": "apertus",
    "GigaChat3-10B-A1.8B.jinja": "gigachat3",
    "Kimi-K3.jinja": "kimi-k3",
    "MiniMax-M3.jinja": "minimax-m3",
    "openbmb-MiniCPM5-1B.jinja": "minicpm",
}


def _detected(template: str) -> str | None:
    text = (fetch() / "templates" / template).read_text()
    fmt = detect(tiny_tokenizer(chat_template=text))
    return fmt.name if fmt else None


def test_the_fixture_covers_every_template():
    assert sorted(BEFORE) == sorted(p.name for p in (fetch() / "templates").glob("*.jinja"))


@pytest.mark.parametrize("template", sorted(BEFORE))
def test_each_template_keeps_its_format(template):
    assert _detected(template) == ADDED.get(template, BEFORE[template])


@pytest.mark.parametrize("template", sorted(ADDED))
def test_the_added_formats_are_new(template):
    assert BEFORE[template] is None


def test_every_rule_can_win():
    """No rule is shadowed by an earlier one with fewer conditions."""
    for i, rule in enumerate(RULES):
        text = " ".join(rule.all)
        first = next(r for r in RULES if r.matches(text))
        assert first is rule, (i, rule.format.name, first.format.name)
