"""Shared fixtures: tiny float64 models (exactness needs float64: reuse changes matmul
shapes, and in float32 a near-tie can flip a greedy token; see docs/how-it-works.md, Correctness)
and a reference that runs plain model.generate on the full conversation.

KVCHAT_TEST_DEVICE (default cpu) puts the models on another device, such as
cuda; `make test-gpu` runs the exactness, hybrid, sharing, persistence and
generate-argument tests that way."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from kvchat.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


DEVICE = torch.device(os.environ.get("KVCHAT_TEST_DEVICE", "cpu"))


@functools.cache
def _model(family: str, seed: int = 0):
    return tiny_model(family, dtype=torch.float64, seed=seed).to(DEVICE)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family_model(request):
    return _model(request.param)


@pytest.fixture
def llama():
    return _model("llama")


# One family per layer mix: attention, sliding window, conv, DeltaNet, Mamba2
# in its own layers (Bamba) and beside attention in every layer (FalconH1), and
# stateless DummyLayers: MLP-only ones (NemotronH) and KV-shared ones (Gemma 3n).
REUSE_FAMILIES = (
    "llama",
    "gemma3",
    "lfm2",
    "qwen3_5",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "gemma3n",
)
CHECKPOINT_FAMILIES = REUSE_FAMILIES[1:]


@pytest.fixture(params=REUSE_FAMILIES)
def any_family(request):
    """(family name, float64 model) for every layer mix kvchat supports."""
    return request.param, _model(request.param)
