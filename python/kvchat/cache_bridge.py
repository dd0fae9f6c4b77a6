"""Converts between the core's layer states and transformers' DynamicCache.

Attention KV moves by reference both ways: the cache gets the session's views,
and the session keeps the tensors generation produced. DynamicLayer.update
concatenates into new tensors, so it never writes into a view another session
or a later turn still holds.

Full-attention layers are served by ``BufferedLayer``, which appends into the
core's ``KvBuffer`` (in place, amortized) where ``DynamicLayer`` concatenates
the whole layer on every decoded token.

Recurrent, conv and linear-attention tensors are different: the model updates
them in place (``copy_``). So the bridge copies them into each cache it
builds, and snapshots clone them (in the core), while the session keeps the
tensors of a finished turn by reference.

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
generate's first forward to those the cache lacks (``CacheBridge.knows_length``,
``prefill.FeedOnlyTail``). These models take the cache as ``cache_params``
(``CacheBridge.cache_argument``).

That, and every recurrent layer's reuse, is exact only where a forward over
several tokens starts from the state the cache holds: Mamba2's chunked scan
does; the Mamba (v1) selective scan of Mamba, FalconMamba and Jamba starts
from zeros. A probe decides (``_continues_state``).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from . import _C

logger = logging.getLogger("kvchat")

# Which parts each supported layer class has. Exact classes only: a subclass
# may keep state kvchat would not carry over, so it gets no reuse instead.
_PARTS = {
    DummyLayer: (),  # stateless: nothing to carry, always reusable
    DynamicLayer: ("attention",),
    DynamicIndexedLayer: ("attention",),  # plus indexer keys: CacheBridge._indexer_of
    DynamicSlidingWindowLayer: ("sliding",),
    LinearAttentionLayer: ("recurrent",),
    LinearAttentionAndFullAttentionLayer: ("attention", "recurrent"),
    LinearAttentionAndSlidingWindowAttentionLayer: ("sliding", "recurrent"),
}


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
            self.indexer = _C.KvBuffer.empty_like(keys, _zero_width(keys), capacity)
        self.indexer.append(keys, _zero_width(keys))
        self._set_indexer_keys()
        return self.indexer_keys

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.indexer is not None:
            self.indexer.crop(self.indexer.length + tokens_to_remove)
            self._set_indexer_keys()


def _zero_width(keys: torch.Tensor) -> torch.Tensor:
    """The values beside indexer keys: none, so they cost no memory."""
    return keys[..., :0]


def _read_indexer(layer) -> _C.AttentionState:
    """The indexer keys of a ``DynamicIndexedLayer`` as a core attention state."""
    if isinstance(layer, BufferedIndexedLayer) and layer.indexer is not None:
        return _C.AttentionState.from_buffer(layer.indexer)
    keys = layer.indexer_keys.unsqueeze(1)
    return _C.AttentionState(keys, _zero_width(keys))


def _take_buffer(states: list, j: int | None, reserve: int) -> _C.KvBuffer | None:
    """A buffer continuing ``states[j]`` (None: no states, or no such layer),
    setting the entry to None (see ``CacheBridge.to_cache``)."""
    if not states or j is None:
        return None
    state, states[j] = states[j], None
    return state.buffer(reserve)


def _read_attention(layer, sliding: bool):
    if isinstance(layer, BufferedLayer) and layer.buffer is not None:
        return _C.AttentionState.from_buffer(layer.buffer)
    if sliding:
        return _C.SlidingWindowState(layer.keys, layer.values, int(layer.cumulative_length))
    return _C.AttentionState(layer.keys, layer.values)


def _write_attention(layer, state, sliding: bool) -> None:
    keys, values = state.tensors()
    # Two positional arguments select the attention half of a hybrid layer.
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if sliding:
        layer.cumulative_length = state.num_tokens


def _recurrent_slots(layer) -> tuple[tuple[str, int], ...]:
    """The (kind, state index) of each initialised recurrent tensor, in order."""
    slots = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            slots.append(("conv", i))
        if layer.is_recurrent_states_initialized[i]:
            slots.append(("recurrent", i))
    return tuple(slots)


def _write_recurrent(layer, state, slots) -> None:
    tensors = state.tensors()
    if len(tensors) != len(slots):
        raise ValueError(f"a recurrent state of {len(tensors)} tensors for slots {slots}")
    for (kind, index), tensor in zip(slots, tensors, strict=True):
        # lazy_initialization allocates the layer's own buffer; copying into it
        # keeps the session's tensor safe from the model's in-place updates.
        layer.lazy_initialization(**{f"{kind}_states": tensor, "state_idx": index})
        getattr(layer, f"{kind}_states")[index].copy_(tensor)
        layer.has_previous_state[index] = True


@dataclass(frozen=True)
class LayerTemplate:
    """What one layer's state must look like for this model, read off a cache
    the model filled: anything loaded from outside is checked against it."""

    parts: tuple[str, ...]  # ("attention",), ("sliding",), ("recurrent",) or two of them
    dtype: torch.dtype | None = None  # of the attention part
    kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    window: int | None = None  # the most tokens a sliding layer holds
    slots: tuple[tuple[str, int], ...] = ()  # the recurrent tensors' (kind, index)
    recurrent: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()  # their shapes and dtypes


class ForwardArguments:
    """How this model's forward takes a cache and positions, for kvchat's own
    forwards over a token range (checkpoint prefills, the probe)."""

    def __init__(self, model):
        parameters = inspect.signature(model.forward).parameters
        # Mamba-family models take cache_params and refuse past_key_values.
        mamba_style = "cache_params" in parameters and "past_key_values" not in parameters
        self.cache_name = "cache_params" if mamba_style else "past_key_values"
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


def _probe(model, cache_argument: str) -> DynamicCache:
    """A fresh cache after the model ran over one token: what each layer fills."""
    cache = DynamicCache(config=model.config)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=token, use_cache=True, **{cache_argument: cache})
    return cache


def _continues_state(model, arguments: ForwardArguments) -> bool:
    """Whether a forward over several tokens continues the recurrent state a
    cache holds: 12 tokens in one forward against 6 and then 6, compared on
    the last logits and on every recurrent tensor (where a lost state shows
    even when attention layers carry most of the context).

    Equal up to rounding: chunked kernels may compute in float32 even for a
    float64 model (Qwen3.5's DeltaNet is off by 5e-8 of the largest logit),
    while a lost state is off by a good part of the tensor. So the bound is
    1e-3 of each tensor's largest value, or the square root of a half
    dtype's epsilon."""
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (1, 12), generator=generator).to(model.device)

    def run(begin, end, cache):
        extra = arguments(cache, begin, end, model.device)
        return model(input_ids=tokens[:, begin:end], use_cache=True, **extra).logits[0, -1]

    with torch.no_grad():
        whole_cache, split_cache = (
            DynamicCache(config=model.config),
            DynamicCache(config=model.config),
        )
        whole = [run(0, 12, whole_cache)]
        run(0, 6, split_cache)
        split = [run(6, 12, split_cache)]
    for whole_layer, split_layer in zip(whole_cache.layers, split_cache.layers, strict=True):
        if hasattr(whole_layer, "number_of_states"):  # a layer with recurrent tensors
            for kind, i in _recurrent_slots(whole_layer):
                whole.append(getattr(whole_layer, f"{kind}_states")[i])
                split.append(getattr(split_layer, f"{kind}_states")[i])
    for a, b in zip(whole, split, strict=True):
        tolerance = max(torch.finfo(a.dtype).eps ** 0.5, 1e-3) * a.abs().max()
        if a.shape != b.shape or (a - b).abs().max() > tolerance:
            return False
    return True


def _templates(cache: DynamicCache, parts: list) -> list[LayerTemplate]:
    """Each stateful layer's tensor layout, read off a probed cache: which
    recurrent tensors it fills, and shapes."""
    templates = []
    for layer, layer_parts in zip(cache.layers, parts, strict=True):
        if not layer_parts:
            continue  # a dummy layer: no state, no template
        fields: dict = {"parts": layer_parts}
        if layer_parts[0] != "recurrent":
            keys, values = layer.keys, layer.values
            fields.update(
                dtype=keys.dtype,
                kv_heads=keys.shape[1],
                key_dim=keys.shape[3],
                value_dim=values.shape[3],
            )
            if layer_parts[0] == "sliding":
                fields["window"] = int(layer.sliding_window)
        if "recurrent" in layer_parts:
            slots = _recurrent_slots(layer)
            tensors = [getattr(layer, f"{kind}_states")[i] for kind, i in slots]
            fields.update(slots=slots, recurrent=tuple((tuple(t.shape), t.dtype) for t in tensors))
        templates.append(LayerTemplate(**fields))
    return templates


def _indexer_template(layer) -> LayerTemplate:
    keys = layer.indexer_keys
    return LayerTemplate(
        parts=("attention",), dtype=keys.dtype, kv_heads=1, key_dim=keys.shape[-1], value_dim=0
    )


def _indexer_problem(cache: DynamicCache, indexed: list[int]) -> str | None:
    """Why kvchat cannot carry these indexer keys, or None."""
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "indexer_position_ids", None) is not None:
            # Per-token positions (Qwen4-Exp's), which kvchat does not carry.
            return f"layer {i} keeps indexer_position_ids"
    dtypes = {
        k.dtype for k in (getattr(layer, "keys", None) for layer in cache.layers) if k is not None
    }
    for i in indexed:
        dtype = cache.layers[i].indexer_keys.dtype
        if {dtype} != dtypes:
            # The core keeps every attention-like layer in one dtype.
            kv = sorted(map(str, dtypes))
            return f"layer {i}'s indexer keys are {dtype}, its keys and values {kv}"
    return None


class CacheBridge:
    """One per model: knows its layer layout and builds caches for it.

    The core's layers are the cache's stateful layers, in order, then the
    indexer keys of each DynamicIndexedLayer that fills them."""

    def __init__(self, model):
        self._config = model.config
        probe = DynamicCache(config=model.config)
        self.layer_classes = [type(layer).__name__ for layer in probe.layers]
        self._cache_layers = len(probe.layers)
        self._parts = [_PARTS.get(type(layer)) for layer in probe.layers]
        self._indexed_layers = {
            i for i, layer in enumerate(probe.layers) if type(layer) is DynamicIndexedLayer
        }
        # The cache layers that hold state, in order: the core's first layers.
        self._stateful = [i for i, parts in enumerate(self._parts) if parts != ()]
        unsupported = sorted(
            {type(layer).__name__ for layer in probe.layers if type(layer) not in _PARTS}
        )
        self.forward_arguments = ForwardArguments(model)
        self.cache_argument = self.forward_arguments.cache_name
        # Whether the cache can count its tokens (get_seq_length): only an
        # attention part can; recurrent layers alone leave it to kvchat.
        self.knows_length = any(p and p[0] != "recurrent" for p in self._parts)
        self.supported = bool(self._stateful) and not unsupported
        # Anything but full attention cannot crop back, so needs checkpoints.
        self.needs_checkpoints = any(p != ("attention",) for p in self._parts if p != ())
        # Each layer's tensor layout, read once off a cache the model filled;
        # never learned from a turn or a file, so nothing outside can change it.
        self.templates: list[LayerTemplate] = []
        self._indexer_of: dict[int, int] = {}  # cache layer -> the core layer of its indexer
        problem = None if self.supported else f"cache layers {unsupported or ['<no state>']}"
        if self.supported:
            filled = _probe(model, self.cache_argument)
            self.templates = _templates(filled, self._parts)
            indexed = [
                i for i in sorted(self._indexed_layers) if filled.layers[i].indexer_keys is not None
            ]
            problem = _indexer_problem(filled, indexed)
            # Every recurrent part relies on it: the tail after a checkpoint
            # is prefilled in one forward from the restored state.
            if problem is None and any("recurrent" in p for p in self._parts if p):
                if not _continues_state(model, self.forward_arguments):
                    problem = "a forward over several tokens does not continue the cached state"
            if problem is None:
                self.templates += [_indexer_template(filled.layers[i]) for i in indexed]
                self._indexer_of = {i: len(self._stateful) + k for k, i in enumerate(indexed)}
            else:
                self.supported, self.templates = False, []
        self.num_layers = len(self.templates) if self.supported else len(self._stateful)
        if problem is not None:
            logger.warning(
                "kvchat: %s: not supported; every turn will prefill the whole prompt "
                "(correct, but without reuse)",
                problem,
            )

    @property
    def slots(self) -> list:
        """Per layer, the (kind, index) of each recurrent tensor (None: no recurrent part),
        as session files record them."""
        return [
            [list(slot) for slot in t.slots] if "recurrent" in t.parts else None
            for t in self.templates
        ]

    def detach_recurrent(self, cache: DynamicCache) -> None:
        """Gives ``cache`` its own copies of its recurrent tensors, which the model
        updates in place: a cache handed back to the caller after the session
        stored those tensors by reference must not write into the session."""
        # The templates past the stateful layers are indexer keys: no recurrent part.
        layer_templates = self.templates[: len(self._stateful)]
        for index, template in zip(self._stateful, layer_templates, strict=True):
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
        return cache.get_seq_length() if self.knows_length else sequence_length - 1

    def to_cache(self, states: list[_C.LayerState], reserve: int = 0) -> DynamicCache:
        """A cache holding ``states`` (empty: none), with room for ``reserve`` tokens
        in its full-attention layers, which append in place.

        Consumes ``states``: each full-attention entry is set to None once its
        buffer exists, so when the buffer moves to a larger arena the old one
        is freed layer by layer rather than held until the list goes away."""
        cache = self.new_cache()
        if states and len(states) != self.num_layers:
            raise ValueError(
                f"states has {len(states)} layers but the model's cache has {self.num_layers} "
                "that hold state"
            )
        for j, index in enumerate(self._stateful):
            parts = self._parts[index]
            if parts == ("attention",):
                buffer = _take_buffer(states, j, reserve)
                if index in self._indexed_layers:
                    indexer = _take_buffer(states, self._indexer_of.get(index), reserve)
                    cache.layers[index] = BufferedIndexedLayer(buffer, indexer, reserve)
                else:
                    cache.layers[index] = BufferedLayer(buffer, reserve)
            elif states:
                # The layer's parts (this model's layout) say what each of the
                # state's parts is: a hybrid gives (attention, recurrent).
                layer = cache.layers[index]
                for part, part_state in zip(parts, states[j].parts() or [states[j]], strict=True):
                    if part == "recurrent":
                        _write_recurrent(layer, part_state, self.templates[j].slots)
                    else:
                        _write_attention(layer, part_state, sliding=part == "sliding")
        return cache

    def from_cache(self, cache: DynamicCache, tokens: int) -> list[_C.LayerState]:
        """The cache's tensors as core layer states (by reference), after ``tokens`` tokens."""
        if len(cache.layers) != self._cache_layers:
            raise ValueError(
                f"cache has {len(cache.layers)} layers but the model has {self._cache_layers}"
            )
        states = [self._read(j, cache.layers[i], tokens) for j, i in enumerate(self._stateful)]
        return states + [_read_indexer(cache.layers[i]) for i in self._indexer_of]

    def snapshot(self, cache: DynamicCache, tokens: int) -> list[_C.LayerState | None]:
        """Owned copies of what cannot be cropped back to ``tokens`` later."""
        return [state.snapshot() for state in self.from_cache(cache, tokens)]

    def _read(self, j: int, layer, tokens: int) -> _C.LayerState:
        """Core layer ``j``'s state, from its cache ``layer``."""
        index = self._stateful[j]
        parts = self._parts[index]
        attention = None
        if parts[0] != "recurrent":
            attention = _read_attention(layer, sliding=parts[0] == "sliding")
            if "recurrent" not in parts:
                return attention
        slots = _recurrent_slots(layer)
        if slots != self.templates[j].slots:
            raise RuntimeError(
                f"layer {index} ({self.layer_classes[index]}) filled recurrent tensors {slots}, "
                f"not {self.templates[j].slots} as when kvchat probed it"
            )
        tensors = [getattr(layer, f"{kind}_states")[i] for kind, i in slots]
        recurrent = _C.RecurrentState(tensors, tokens)
        return recurrent if attention is None else _C.HybridState(attention, recurrent)
