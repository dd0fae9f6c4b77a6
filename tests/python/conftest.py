"""Shared fixtures: tiny float64 models (exactness needs float64: reuse changes matmul
shapes, and in float32 a near-tie can flip a greedy token; see docs/how-it-works.md,
Correctness). The models, the families and the reference path are in helpers.py,
which tests import; only the fixtures live here."""

from __future__ import annotations

import pytest
from helpers import REUSE_FAMILIES, model_for
from kvchat.tiny import tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family_model(request):
    return model_for(request.param)


@pytest.fixture
def llama():
    return model_for("llama")


@pytest.fixture(params=REUSE_FAMILIES)
def any_family(request):
    """(family name, float64 model) for every layer mix kvchat supports."""
    return request.param, model_for(request.param)
