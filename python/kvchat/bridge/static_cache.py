"""The compiled decode's cache: transformers' own ``StaticCache``, loaded with a
session's states for one turn and read back after it.

``generate`` compiles its decode step (``torch.compile``; CUDA graphs on a GPU)
only over a cache whose tensors never change shape or address: fixed-capacity
keys and values written in place at a position tensor, a mask as long as the
capacity with the unused tail masked. ``StaticCache`` is exactly that, and
transformers builds it with the right layer class for every layer kind (full
attention, sliding window, conv / SSM / DeltaNet state, hybrids, stateless
layers). So kvchat does not write its own: it keeps a few of them and copies a
session's state in at the start of a turn and out at the end.

Why a pool and not the session's own arenas: compiled code, and above all a
captured CUDA graph, is tied to the shapes and addresses of its inputs. A
capacity taken from buckets (``bucket``) and the same tensors turn after
turn, session after session, let every turn replay the graphs the first one
captured. The copies cost O(context) memory traffic per turn, far less than a
prefill of the same tokens. A pool of ``[batch, ...]`` caches is also where
decoding several sessions in one batch would start.

What each layer kind holds once loaded (``load``), and reads back (``read``):

- full attention (``StaticLayer``): positions ``[0, n)``; the tail is zero, so
  the masked positions never turn a NaN left by an earlier turn into a NaN
  output (0 x NaN is NaN);
- sliding window (``StaticSlidingWindowLayer``): not yet full, positions
  ``[0, n)``; full, the last ``window - 1`` tokens in slots ``[1, window)``:
  slot 0 is the token the next update drops, which no query can see;
- recurrent tensors: copied into the layer's own tensors (their addresses stay).
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import StaticCache
from transformers.cache_utils import (
    LinearAttentionLayer,
    StaticIndexedLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .. import _C
from .layers import write_recurrent
from .layout import ATTENTION, RECURRENT, SLIDING, ModelLayout

logger = logging.getLogger("kvchat")

SMALLEST_BUCKET = 256
STEPS_PER_DOUBLING = 16
# Idle caches kept between turns, the least recently used freed first: a
# server's clients ask for a few capacities (max_tokens differ), and a cache
# rebuilt means new addresses, which a GPU's CUDA graphs record again.
MAX_IDLE = 4
# A turn may decode in an idle cache up to this many times larger than its
# bucket rather than build one: attention over a masked tail costs less than
# a new cache and, on a GPU, recording its graphs again.
MAX_OVERSIZE = 2


def bucket(tokens: int) -> int:
    """The capacity a turn that needs ``tokens`` positions decodes in: a
    multiple of 256, and past 4096 one of sixteen steps per doubling. A static
    cache's attention covers its whole capacity (masked), so a decode attends
    over fewer than 256 or 1/16 more positions than it needs, while a
    conversation changes capacity only every few turns. After its second capacity,
    torch.compile's automatic dynamic shapes serve every capacity with one
    more graph; CUDA graphs are recorded once per capacity."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    below = 1 << max((tokens - 1).bit_length() - 1, 0)  # the power of two under tokens
    step = max(SMALLEST_BUCKET, below // STEPS_PER_DOUBLING)
    return -(-tokens // step) * step


def static_problem(layout: ModelLayout) -> str | None:
    """Why this layout cannot decode in a ``StaticCache`` (None: it can)."""
    if not layout.supported:
        return layout.problem
    if layout.indexed:
        return "sparse-attention indexer keys (DynamicIndexedLayer)"
    if not layout.knows_length:
        return "recurrent layers alone (the cache cannot count its tokens)"
    return None


class StaticCachePool:
    """Static caches for one model, by capacity; one turn holds each at a time,
    and at most ``MAX_IDLE`` wait between turns (the rest are freed)."""

    def __init__(self, config, layout: ModelLayout):
        self._config = config
        self._layout = layout
        self._free: dict[int, StaticCache] = {}  # idle, by capacity, least recent first
        self._lock = threading.Lock()
        self.built = 0  # caches built: a steady state builds none

    def take(self, states: list, capacity: int) -> StaticCache:
        """A cache of at least ``capacity`` positions holding ``states`` (empty:
        none): the smallest idle one up to ``MAX_OVERSIZE`` times as large, or
        a new one of ``capacity``."""
        with self._lock:
            fits = [c for c in self._free if capacity <= c <= capacity * MAX_OVERSIZE]
            cache = self._free.pop(min(fits)) if fits else None
        if cache is None:
            cache = self._new(capacity)
        load(cache, self._layout, states)
        return cache

    def clear(self) -> None:
        """Frees every idle cache."""
        with self._lock:
            freed, self._free = self._free, {}
        del freed

    def give_back(self, cache: StaticCache) -> None:
        """Returns ``cache`` for a later turn. Never one the caller still holds."""
        for layer in cache.layers:  # what the turn wrote, even if it failed: zeroed next time
            if isinstance(layer, StaticLayer) and layer.is_initialized:
                written = int(layer.cumulative_length)
                layer.kvchat_dirty = max(getattr(layer, "kvchat_dirty", written), written)
        freed = []  # dropped outside the lock
        with self._lock:
            # The most recently returned last; one idle cache per capacity.
            freed.append(self._free.pop(cache.layers_capacity, None))
            self._free[cache.layers_capacity] = cache
            while len(self._free) > MAX_IDLE:
                freed.append(self._free.pop(next(iter(self._free))))
        del freed

    def nbytes(self) -> int:
        with self._lock:
            caches = list(self._free.values())
        return sum(_cache_bytes(c) for c in caches)

    def _new(self, capacity: int) -> StaticCache:
        cache = StaticCache(config=self._config, max_cache_len=capacity)
        cache.layers_capacity = capacity
        for index, parts in enumerate(self._layout.parts):
            layer = cache.layers[index]
            if parts and not _fits(layer, parts):
                raise TypeError(
                    f"StaticCache layer {index} is a {type(layer).__name__}, which does not hold "
                    f"{'/'.join(p.name for p in parts)} state"
                )
        self.built += 1
        return cache


def _fits(layer, parts) -> bool:
    if isinstance(layer, StaticIndexedLayer):
        return False
    attention = {ATTENTION: StaticLayer, SLIDING: StaticSlidingWindowLayer}
    if parts[0] in attention:
        kind = attention[parts[0]]
        if not isinstance(layer, kind) or (
            parts[0] == ATTENTION and isinstance(layer, StaticSlidingWindowLayer)
        ):
            return False
    return (RECURRENT in parts) == isinstance(layer, LinearAttentionLayer)


def _cache_bytes(cache: StaticCache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
        for name in ("conv_states", "recurrent_states"):
            for tensor in (getattr(layer, name, None) or {}).values():
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


# ----------------------------------------------------------------- loading
def load(cache: StaticCache, layout: ModelLayout, states: list) -> None:
    """Puts ``states`` (the core's layers; empty: a fresh conversation) into
    ``cache``, in place, overwriting what an earlier turn left."""
    if states and len(states) != layout.num_layers:
        raise ValueError(
            f"states has {len(states)} layers but the model's cache has {layout.num_layers} "
            f"that hold state"
        )
    for j, index in enumerate(layout.stateful):
        layer, parts = cache.layers[index], layout.parts[index]
        state = states[j] if states else None
        pieces = (state.parts() or [state]) if state is not None else [None] * len(parts)
        for part, piece in zip(parts, pieces, strict=True):
            if part == RECURRENT:
                _load_recurrent(layer, piece, layout.templates[j].slots)
            elif part == SLIDING:
                _load_sliding(layer, piece)
            else:
                _load_attention(layer, piece)


def _load_attention(layer: StaticLayer, state) -> None:
    # On a shared prefix the core concatenates it with the session's own tokens.
    keys, values = state.tensors() if state is not None else (None, None)
    n = 0 if keys is None else keys.shape[-2]
    if not layer.is_initialized:
        if keys is None:
            return  # the turn's first update allocates (zeros)
        layer.lazy_initialization(keys, values)
    if n > layer.max_cache_len:
        raise ValueError(f"a state of {n} tokens does not fit a cache of {layer.max_cache_len}")
    if n:
        layer.keys[:, :, :n].copy_(keys)
        layer.values[:, :, :n].copy_(values)
    dirty = max(getattr(layer, "kvchat_dirty", layer.max_cache_len), n)
    layer.keys[:, :, n:dirty].zero_()
    layer.values[:, :, n:dirty].zero_()
    layer.kvchat_dirty = n
    layer.cumulative_length.fill_(n)


def _load_sliding(layer: StaticSlidingWindowLayer, state) -> None:
    window = layer.max_cache_len  # min(the model's window, the capacity)
    total = 0 if state is None else state.num_tokens
    keys, values = state.tensors() if state is not None else (None, None)
    held = 0 if keys is None else keys.shape[-2]
    if not layer.is_initialized:
        if keys is None:
            layer.cumulative_length_int = 0
            return
        layer.lazy_initialization(keys, values)
    layer.keys.zero_()
    layer.values.zero_()
    if total < window:
        if held != total:
            raise ValueError(f"a sliding state of {total} tokens holds {held}")
        start = 0
    else:
        # Full: the last window - 1 tokens are all any later query can see.
        if held < window - 1:
            raise ValueError(f"a full sliding state holds {held} tokens, fewer than {window - 1}")
        keys, values = keys[:, :, held - window + 1 :], values[:, :, held - window + 1 :]
        start = 1
    if keys is not None and keys.shape[-2]:
        layer.keys[:, :, start : start + keys.shape[-2]].copy_(keys)
        layer.values[:, :, start : start + values.shape[-2]].copy_(values)
    layer.cumulative_length_int = total
    layer.cumulative_length.fill_(min(total, window))


def _load_recurrent(layer: LinearAttentionLayer, state, slots) -> None:
    if state is None:
        for i in range(layer.number_of_states):
            for kind in ("conv", "recurrent"):
                if getattr(layer, f"is_{kind}_states_initialized")[i]:
                    getattr(layer, f"{kind}_states")[i].zero_()
            layer.has_previous_state[i] = False
        return
    if all(
        getattr(layer, f"is_{kind}_states_initialized")[i] for kind, i in slots
    ):  # copy into the tensors a compiled step already knows
        tensors = state.tensors()
        if len(tensors) != len(slots):
            raise ValueError(f"a recurrent state of {len(tensors)} tensors for slots {slots}")
        for (kind, i), tensor in zip(slots, tensors, strict=True):
            getattr(layer, f"{kind}_states")[i].copy_(tensor)
            layer.has_previous_state[i] = True
    else:
        write_recurrent(layer, state, slots)


# ----------------------------------------------------------------- reading
def read_static_attention(layer, sliding: bool, copy: bool):
    """A static layer's tokens as a core state: copies (``copy``), or views for
    a caller that keeps nothing of them past this turn (``snapshot``, whose
    states clone what they keep)."""
    if sliding:
        window, total = layer.max_cache_len, layer.cumulative_length_int
        keys, values = (layer.keys[:, :, :total], layer.values[:, :, :total])
        if total >= window:
            keys, values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    else:
        total = int(layer.cumulative_length)
        layer.kvchat_dirty = max(getattr(layer, "kvchat_dirty", 0), total)
        keys, values = layer.keys[:, :, :total], layer.values[:, :, :total]
    if copy:
        keys, values = keys.clone(), values.clone()
    if sliding:
        return _C.SlidingWindowState(keys, values, total)
    return _C.AttentionState(keys, values)
