"""Converts between the core's layer states and transformers' DynamicCache.

Attention KV moves by reference both ways: the cache gets the session's views,
and the session keeps the tensors generation produced. DynamicLayer.update
concatenates into new tensors, so it never writes into a view another session
or a later turn still holds. Recurrent tensors are copied in (the model
updates them in place; see ``layers``).

A ``DummyLayer`` (an MLP- or MoE-only layer, or one that reads another layer's
keys and values: NemotronH, Gemma 3n) holds no state. The core never sees it:
its layers are the cache's stateful ones, in order, and each cache the bridge
builds keeps its dummy layers where the model put them.

A ``DynamicIndexedLayer`` (DeepSeek-V3.2-style sparse attention: GLM-MoE-DSA,
DeepSeek-V3.2) holds, beside its keys and values, the indexer's keys
``[batch, tokens, dim]``: one more per-token tensor that crops like KV. The
core holds them as one more attention layer, ``[batch, 1, tokens, dim]`` keys
with zero-width values, after the model's own layers; so cropping, sharing,
budgets and session files treat them as they treat any KV.

A cache of recurrent layers alone (Mamba, Mamba2, FalconMamba) cannot say how
many tokens it has seen (``get_seq_length`` refuses), so ``generate`` would run
the whole prompt over it again; kvchat counts the tokens itself and cuts
generate's first forward to those the cache lacks (``ModelLayout.knows_length``,
``prefill.FeedOnlyTail``). These models took the cache as ``cache_params``,
every model as ``cache`` from transformers 5.24 (``CacheBridge.cache_argument``:
the name the forward declares).
"""

from __future__ import annotations

import logging

from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicIndexedLayer

from .. import _C
from .forward import ForwardArguments
from .layers import (
    BufferedIndexedLayer,
    BufferedLayer,
    read_attention,
    read_indexer,
    recurrent_slots,
    take_buffer,
    write_attention,
    write_recurrent,
)
from .layout import ATTENTION, RECURRENT, SLIDING, ModelLayout
from .probe import probe_layout
from .static_cache import (
    StaticCachePool,
    read_static_attention,
    static_problem,
)
from .windows import WindowCheckpoints

logger = logging.getLogger("kvchat")


class CacheBridge:
    """One per model: its ``layout``, and the caches built for it."""

    def __init__(self, model):
        self._config = model.config
        self.forward_arguments = ForwardArguments(model)
        self.cache_argument = self.forward_arguments.cache_name
        self.layout: ModelLayout = probe_layout(model, self.forward_arguments)
        layers = self.new_cache().layers
        self._indexed_layers = {
            i for i, layer in enumerate(layers) if type(layer) is DynamicIndexedLayer
        }
        # Why decoding cannot compile over this model's layers (None: it can).
        self.static_problem = static_problem(self.layout)
        self._static_pool = StaticCachePool(model.config, self.layout)
        # Why checkpoints inside a forward are no longer read off conv windows
        # (None: they are, where the layout allows; see ``windows``).
        self.windows_problem: str | None = None
        if not self.layout.supported:
            logger.warning(
                "kvchat: %s: not supported; every turn will prefill the whole prompt "
                "(correct, but without reuse)",
                self.layout.problem,
            )

    # What the turn asks of the model's layout, named as the turn uses it.
    @property
    def supported(self) -> bool:
        return self.layout.supported

    @property
    def knows_length(self) -> bool:
        return self.layout.knows_length

    @property
    def needs_checkpoints(self) -> bool:
        return self.layout.needs_checkpoints

    @property
    def checkpoints_from_windows(self) -> bool:
        """Whether a turn's inner checkpoints come off the one forward over its
        tail (``WindowCheckpoints``) rather than forwards that stop at each:
        the model's layout allows it, and no turn found otherwise."""
        return self.layout.conv_windows_only and self.windows_problem is None

    def window_checkpoints(self, cache, begin: int, end: int, positions) -> WindowCheckpoints:
        return WindowCheckpoints(self.layout, cache, begin, end, positions)

    def windows_failed(self, problem: str) -> None:
        """A forward did not hand its conv layers their inputs as expected: from
        now on this model's checkpoints stop the forward, as for any layer."""
        if self.windows_problem is None:
            logger.warning("kvchat: checkpoints will stop the prefill from now on: %s", problem)
        self.windows_problem = problem

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def layer_classes(self) -> list[str]:
        return list(self.layout.layer_classes)

    def detach_recurrent(self, cache: DynamicCache) -> None:
        """Gives ``cache`` its own copies of its recurrent tensors, which the model
        updates in place: a cache handed back to the caller after the session
        stored those tensors by reference must not write into the session."""
        # The templates past the stateful layers are indexer keys: no recurrent part.
        stateful = self.layout.stateful
        for index, template in zip(stateful, self.layout.templates[: len(stateful)], strict=True):
            layer = cache.layers[index]
            for kind, i in template.slots:
                states = getattr(layer, f"{kind}_states")
                states[i] = states[i].clone()

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self._config)

    def cached_tokens(self, cache: DynamicCache, sequence_length: int) -> int:
        """How many tokens ``cache`` holds once generate returned a sequence of
        ``sequence_length``: the cache's own count where it keeps one, otherwise
        all but the last token, which generate samples and never feeds."""
        return int(cache.get_seq_length()) if self.knows_length else sequence_length - 1

    def to_cache(self, states: list[_C.LayerState], reserve: int = 0) -> DynamicCache:
        """A cache holding ``states`` (empty: none), with room for ``reserve`` tokens
        in its full-attention layers, which append in place.

        Consumes ``states``: each full-attention entry is set to None once its
        buffer exists, so when the buffer moves to a larger arena the old one
        is freed layer by layer rather than held until the list goes away."""
        layout = self.layout
        cache = self.new_cache()
        if states and len(states) != layout.num_layers:
            raise ValueError(
                f"states has {len(states)} layers but the model's cache has "
                f"{layout.num_layers} that hold state"
            )
        for j, index in enumerate(layout.stateful):
            parts = layout.parts[index]
            if parts == (ATTENTION,):
                buffer = take_buffer(states, j, reserve)
                if index in self._indexed_layers:
                    indexer = take_buffer(states, layout.indexer_of.get(index), reserve)
                    cache.layers[index] = BufferedIndexedLayer(buffer, indexer, reserve)
                else:
                    cache.layers[index] = BufferedLayer(buffer, reserve)
            elif states:
                # The layer's parts (this model's layout) say what each of the
                # state's parts is: a hybrid gives (attention, recurrent).
                layer = cache.layers[index]
                for part, part_state in zip(parts, states[j].parts() or [states[j]], strict=True):
                    if part == RECURRENT:
                        write_recurrent(layer, part_state, layout.templates[j].slots)
                    else:
                        write_attention(layer, part_state, sliding=part == SLIDING)
        return cache

    def to_static_cache(self, states: list[_C.LayerState], capacity: int) -> StaticCache:
        """A ``StaticCache`` of ``capacity`` positions holding ``states`` (copies),
        which ``generate`` can compile; ``give_back`` it once read back."""
        if self.static_problem is not None:
            raise ValueError(f"this model cannot decode in a StaticCache: {self.static_problem}")
        return self._static_pool.take(states, capacity)

    def give_back(self, cache: StaticCache) -> None:
        self._static_pool.give_back(cache)

    @property
    def static_pool(self) -> StaticCachePool:
        return self._static_pool

    def from_cache(self, cache: Cache, tokens: int, copy: bool = True) -> list[_C.LayerState]:
        """The cache's tensors as core layer states, after ``tokens`` tokens: by
        reference from a DynamicCache, copied from a pooled StaticCache (whose
        tensors the next turn overwrites) unless ``copy=False``, which only
        ``snapshot`` passes: its states clone what they keep."""
        layout = self.layout
        if len(cache.layers) != len(layout.parts):
            raise ValueError(
                f"cache has {len(cache.layers)} layers but the model has {len(layout.parts)}"
            )
        pooled = isinstance(cache, StaticCache)
        states = [
            self._read(j, cache.layers[i], tokens, pooled, copy)
            for j, i in enumerate(layout.stateful)
        ]
        return states + [read_indexer(cache.layers[i]) for i in layout.indexer_of]

    def snapshot(self, cache: Cache, tokens: int) -> list[_C.LayerState | None]:
        """Owned copies of what cannot be cropped back to ``tokens`` later."""
        # Snapshots clone the parts they keep (an attention part keeps nothing:
        # it crops by views), so a static cache's tensors are not copied twice.
        return [state.snapshot() for state in self.from_cache(cache, tokens, copy=False)]

    def _read(self, j: int, layer, tokens: int, pooled: bool, copy: bool) -> _C.LayerState:
        """Core layer ``j``'s state, from its cache ``layer`` (``pooled``: of a
        StaticCache, whose tensors are copied out)."""
        index = self.layout.stateful[j]
        parts = self.layout.parts[index]
        attention = None
        if parts[0] != RECURRENT:
            sliding = parts[0] == SLIDING
            if pooled:
                attention = read_static_attention(layer, sliding, copy)
            else:
                attention = read_attention(layer, sliding=sliding)
            if RECURRENT not in parts:
                return attention
        slots = recurrent_slots(layer)
        expected = self.layout.templates[j].slots
        if slots != expected:
            raise RuntimeError(
                f"layer {index} ({self.layout.layer_classes[index]}) filled recurrent tensors "
                f"{slots}, not {expected} as when kvchat probed it"
            )
        tensors = [getattr(layer, f"{kind}_states")[i] for kind, i in slots]
        if pooled and copy:  # the pool writes these tensors in place on the next turn
            tensors = [tensor.clone() for tensor in tensors]
        recurrent = _C.RecurrentState(tensors, tokens)
        return recurrent if attention is None else _C.HybridState(attention, recurrent)
