"""Converts between the core's layer states and transformers' DynamicCache.

Tensors move by reference both ways: the cache gets the session's views, and
the session keeps the tensors generation produced. transformers'
DynamicLayer.update concatenates into new tensors, so it never writes into a
view another session or a later turn still holds.
"""

from __future__ import annotations

import logging

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import _C

logger = logging.getLogger("kvchat")


class CacheBridge:
    """One per model: knows its layer layout and builds caches for it."""

    def __init__(self, model):
        self._config = model.config
        probe = DynamicCache(config=model.config)
        self.layer_classes = [type(layer).__name__ for layer in probe.layers]
        self.num_layers = len(probe.layers)
        # Exact type: a subclass may keep state we would not carry over.
        unsupported = sorted({n for n in self.layer_classes if n != DynamicLayer.__name__})
        self.supported = self.num_layers > 0 and not unsupported
        if not self.supported:
            logger.warning(
                "kvchat: cache layers %s are not supported yet; every turn will prefill the "
                "whole prompt (correct, but without reuse)",
                unsupported or ["<none>"],
            )

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self._config)

    def to_cache(self, states: list[_C.LayerState]) -> DynamicCache:
        """A cache holding ``states`` (views, no copies); empty when states is empty."""
        cache = self.new_cache()
        if not states:
            return cache
        if len(states) != len(cache.layers):
            raise ValueError(
                f"states has {len(states)} layers but the model's cache has {len(cache.layers)}"
            )
        for layer, state in zip(cache.layers, states, strict=True):
            keys, values = state.tensors()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        return cache

    def from_cache(self, cache: DynamicCache) -> list[_C.LayerState]:
        """The cache's tensors as core layer states (by reference)."""
        if len(cache.layers) != self.num_layers:
            raise ValueError(
                f"cache has {len(cache.layers)} layers but the model has {self.num_layers}"
            )
        return [_C.AttentionState(layer.keys, layer.values) for layer in cache.layers]
