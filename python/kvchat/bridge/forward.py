"""How a model's forward takes a cache and positions."""

from __future__ import annotations

import inspect

import torch


class ForwardArguments:
    """How this model's forward takes a cache and positions, for kvchat's own
    forwards over a token range (checkpoint prefills, the probe)."""

    def __init__(self, model):
        parameters = inspect.signature(model.forward).parameters
        # The name the forward declares: transformers 5.24 renamed every
        # model's cache argument to ``cache`` (the old names still pass, with
        # a FutureWarning); before, Mamba-family models took cache_params and
        # refused past_key_values.
        if "cache" in parameters:
            self.cache_name = "cache"
        elif "cache_params" in parameters and "past_key_values" not in parameters:
            self.cache_name = "cache_params"
        else:
            self.cache_name = "past_key_values"
        # True positions where the model takes them: some (Bamba) count from 0
        # without them, where generate would pass the true ones. Mamba takes
        # none (its **kwargs would pass them on to its kernels).
        self._positions = "position_ids" in parameters

    def __call__(self, cache, begin: int, end: int, device) -> dict:
        """Keyword arguments for a forward over tokens [begin, end) into ``cache``."""
        kwargs = {self.cache_name: cache}
        if self._positions:
            kwargs["position_ids"] = torch.arange(begin, end, device=device)[None]
        return kwargs
