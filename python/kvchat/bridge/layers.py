"""The cache layers kvchat builds, and reading and writing a core layer
state into transformers' layer objects.

Full-attention layers are served by ``BufferedLayer``, which appends into the
core's ``KvBuffer`` (in place, amortized) where ``DynamicLayer`` concatenates
the whole layer on every decoded token.

Recurrent, conv and linear-attention tensors are different: the model updates
them in place (``copy_``). So ``write_recurrent`` copies them into each cache
the bridge builds, and snapshots clone them (in the core), while the session
keeps the tensors of a finished turn by reference.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

from .. import _C


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a kvchat ``KvBuffer``.

    ``update`` appends in place and returns views, so decoding copies one
    token per step instead of the whole layer. An append never writes where
    another holder (an earlier turn, another session) can see: the buffer
    copies first (see ``KvArena``). One conversation only: batch 1.
    """

    def __init__(self, buffer: _C.KvBuffer | None = None, reserve: int = 0):
        super().__init__()
        self.buffer = buffer
        self._reserve = reserve
        if buffer is not None:
            keys, values = buffer.keys(), buffer.values()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.buffer is None:
            capacity = max(self._reserve, key_states.shape[-2])
            self.buffer = _C.KvBuffer.empty_like(key_states, value_states, capacity)
        self.buffer.append(key_states, value_states)
        self.keys, self.values = self.buffer.keys(), self.buffer.values()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.buffer is None:
            return
        self.buffer.crop(self.buffer.length + tokens_to_remove)
        self.keys, self.values = self.buffer.keys(), self.buffer.values()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvchat's BufferedLayer holds one conversation (batch 1)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("kvchat's BufferedLayer holds one conversation (batch 1)")


class BufferedIndexedLayer(BufferedLayer, DynamicIndexedLayer):
    """A ``DynamicIndexedLayer`` whose keys, values and indexer keys all live in
    kvchat buffers. The indexer's buffer holds ``[batch, 1, tokens, dim]`` keys
    and zero-width values, so it is an ordinary ``KvBuffer``; ``indexer_keys``
    is its ``[batch, tokens, dim]`` view, as the model expects."""

    def __init__(
        self,
        buffer: _C.KvBuffer | None = None,
        indexer: _C.KvBuffer | None = None,
        reserve: int = 0,
    ):
        super().__init__(buffer, reserve)
        self.indexer = indexer
        if indexer is not None:
            self._set_indexer_keys()

    def _set_indexer_keys(self) -> None:
        keys = self.indexer.keys().squeeze(1)
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(keys)
        self.indexer_keys = keys

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        keys = indexer_key_states.unsqueeze(1)
        if self.indexer is None:
            capacity = max(self._reserve, keys.shape[-2])
            self.indexer = _C.KvBuffer.empty_like(keys, zero_width(keys), capacity)
        self.indexer.append(keys, zero_width(keys))
        self._set_indexer_keys()
        return self.indexer_keys

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.indexer is not None:
            self.indexer.crop(self.indexer.length + tokens_to_remove)
            self._set_indexer_keys()


def zero_width(keys: torch.Tensor) -> torch.Tensor:
    """The values beside indexer keys: none, so they cost no memory."""
    return keys[..., :0]


def read_indexer(layer) -> _C.AttentionState:
    """The indexer keys of a ``DynamicIndexedLayer`` as a core attention state."""
    if isinstance(layer, BufferedIndexedLayer) and layer.indexer is not None:
        return _C.AttentionState.from_buffer(layer.indexer)
    keys = layer.indexer_keys.unsqueeze(1)
    return _C.AttentionState(keys, zero_width(keys))


def take_buffer(states: list, j: int | None, reserve: int) -> _C.KvBuffer | None:
    """A buffer continuing ``states[j]`` (None: no states, or no such layer),
    setting the entry to None (see ``CacheBridge.to_cache``)."""
    if not states or j is None:
        return None
    state, states[j] = states[j], None
    return state.buffer(reserve)


def read_attention(layer, sliding: bool):
    if isinstance(layer, BufferedLayer) and layer.buffer is not None:
        return _C.AttentionState.from_buffer(layer.buffer)
    if sliding:
        return _C.SlidingWindowState(layer.keys, layer.values, int(layer.cumulative_length))
    return _C.AttentionState(layer.keys, layer.values)


def write_attention(layer, state, sliding: bool) -> None:
    keys, values = state.tensors()
    # Two positional arguments select the attention half of a hybrid layer.
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if sliding:
        layer.cumulative_length = state.num_tokens


def recurrent_slots(layer) -> tuple[tuple[str, int], ...]:
    """The (kind, state index) of each initialised recurrent tensor, in order."""
    slots = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            slots.append(("conv", i))
        if layer.is_recurrent_states_initialized[i]:
            slots.append(("recurrent", i))
    return tuple(slots)


def write_recurrent(layer, state, slots) -> None:
    tensors = state.tensors()
    if len(tensors) != len(slots):
        raise ValueError(f"a recurrent state of {len(tensors)} tensors for slots {slots}")
    for (kind, index), tensor in zip(slots, tensors, strict=True):
        # lazy_initialization allocates the layer's own buffer; copying into it
        # keeps the session's tensor safe from the model's in-place updates.
        layer.lazy_initialization(**{f"{kind}_states": tensor, "state_idx": index})
        getattr(layer, f"{kind}_states")[index].copy_(tensor)
        layer.has_previous_state[index] = True
