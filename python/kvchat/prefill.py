"""Chunked prefill of a prompt's uncached tail, snapshotting at checkpoints.

``model.generate`` prefills in one piece, so the state of a recurrent or
sliding layer is only ever seen at the end. For models with such layers kvchat
runs the tail itself, one chunk per checkpoint position, snapshots there, and
then hands the cache to ``generate`` for the last prompt token and decoding.
"""

from __future__ import annotations

import inspect

import torch

from . import _C
from .cache_bridge import CacheBridge


class ChunkedPrefill:
    """Runs ``model`` forward over token ranges of one prompt into a cache."""

    def __init__(self, model, bridge: CacheBridge):
        self._model = model
        self._bridge = bridge
        parameters = inspect.signature(model.forward).parameters
        # Only the state matters here; skip the [tokens, vocab] logits.
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    @torch.no_grad()
    def run(
        self, input_ids: torch.Tensor, cache, start: int, positions: list[int]
    ) -> list[_C.Checkpoint]:
        """Prefills ``input_ids[:, start:positions[-1]]``; a checkpoint at each position."""
        checkpoints = []
        done = start
        for position in positions:
            if not done < position < input_ids.shape[1]:
                raise ValueError(
                    f"checkpoint positions must rise within ({start}, {input_ids.shape[1]}), "
                    f"got {positions}"
                )
            # Explicit positions: some models (Bamba) count from 0 without them,
            # where generate would pass the true ones.
            position_ids = torch.arange(done, position, device=input_ids.device).unsqueeze(0)
            self._model(
                input_ids=input_ids[:, done:position],
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                **self._extra,
            )
            done = position
            checkpoints.append(_C.Checkpoint(position, self._bridge.snapshot(cache, position)))
        return checkpoints
