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
``prefill.FeedOnlyTail``). These models took the cache as ``cache_params``, every model as ``cache``
from transformers 5.24 (``CacheBridge.cache_argument``: the name the forward declares).

That, and every recurrent layer's reuse, is exact only where a forward over
several tokens starts from the state the cache holds: Mamba2's chunked scan
does; the Mamba (v1) selective scan of Mamba, FalconMamba and Jamba starts
from zeros. A probe decides (``_split_problem``), for every model:
GLM-MoE-DSA's sparse selection is inexact the same way.
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


def _probe(model, cache_argument: str) -> DynamicCache:
    """A fresh cache after the model ran over one token: what each layer fills."""
    cache = DynamicCache(config=model.config)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=token, use_cache=True, **{cache_argument: cache})
    return cache


# The split probe: a prefix forward, then this many tokens in one more forward.
_PROBE_TAIL = 6
# A model that declares a sparse selection (each query attends to the top
# few keys it picks) is probed with a prefix this many times that selection:
# its inexactness needs more keys than it selects, and shows only where a
# near-tie in the selection falls differently, which a longer prefix makes
# likely (at 4x, 15 of 16 random prompts showed it on GLM-MoE-DSA).
_SELECTION_MULTIPLE = 4


def _selected_tokens(config) -> int:
    """The most keys a query's sparse attention selects, as the config
    declares it (0: it declares none)."""
    text = config.get_text_config()
    tokens = getattr(text, "index_topk", None) or 0  # DeepSeek-V3.2, GLM-MoE-DSA
    blocks, size = getattr(text, "index_topk_blocks", None), getattr(text, "index_block_size", None)
    if blocks and size:  # MiniMax-M3: blocks of keys, plus the local ones
        tokens = max(tokens, (blocks + (getattr(text, "index_local_blocks", None) or 0)) * size)
    return int(tokens)


@dataclass(frozen=True)
class SplitError:
    """One tensor of the probe: how far the split forward is from the whole
    one (``split``), how far a forward that lost the state is (``lost``), the
    tensor's largest value and the compute precision's epsilon."""

    name: str
    split: float
    lost: float
    largest: float
    eps: float
    roundings: int = 1  # of the largest value, allowed whatever ``lost`` is

    @property
    def allowed(self) -> float:
        return max(self.roundings * self.eps * self.largest, self.eps**0.5 * self.lost)

    @property
    def ok(self) -> bool:
        return self.split <= self.allowed


# A convolution's state is a window of its last inputs, narrower than the
# probe's tail: in the first layer the tail's own tokens fill it whatever came
# before, so the history cannot move it (a lost state is off by what the split
# is off by) and only rounding is measured. The allowance applies to every
# layer's window; a deeper one that a lost state moves is off by far more
# (1.8x to 3100x the allowance, zeroing the conv state alone, on every hybrid
# family in float32 and bfloat16), and the logits and recurrent states are
# still held to one rounding. Matrix products of other shapes
# move it by up to 2.3 roundings of its largest value in float32
# (transformers 5.24's reference convolution): four are allowed. A recurrent
# state that the history does not move is another matter (a scan that
# ignores its cache): it stays at one rounding.
_WINDOW_ROUNDINGS = 4


def _split_errors(model, arguments: ForwardArguments) -> list[SplitError]:
    """Runs the probe: the same random tokens in one forward ("whole"), in
    two ("split": a prefix, then the last ``_PROBE_TAIL`` tokens over the
    cache it filled) and the tail alone from an empty cache ("lost": what a
    forward that ignores the cache gives). Compared: the logits of the
    prefix's last positions and of the tail (a prefix computed without what
    follows it is what a cache holds), and every recurrent tensor."""
    selected = _selected_tokens(model.config)
    prefix = max(_PROBE_TAIL, _SELECTION_MULTIPLE * selected)
    total = prefix + _PROBE_TAIL
    kept = range(prefix - _PROBE_TAIL, total)  # the logits compared
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (1, total), generator=generator).to(model.device)
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def run(begin, end, cache, keep_from=None):
        extra = arguments(cache, begin, end, model.device)
        keep_from = begin if keep_from is None else keep_from
        if takes_keep:  # only the logits compared: a long prefix, a large vocabulary
            extra["logits_to_keep"] = end - keep_from
        logits = model(input_ids=tokens[:, begin:end], use_cache=True, **extra).logits[0]
        return logits[-(end - keep_from) :]

    with torch.no_grad():
        whole_cache, split_cache, lost_cache = (DynamicCache(config=model.config) for _ in range(3))
        whole = run(0, total, whole_cache, keep_from=kept.start)
        split = torch.cat(
            [run(0, prefix, split_cache, keep_from=kept.start), run(prefix, total, split_cache)]
        )
        lost = run(prefix, total, lost_cache)
    pieces = [("logits", whole, split, lost, _PROBE_TAIL, 1)]
    for index, layers in enumerate(
        zip(whole_cache.layers, split_cache.layers, lost_cache.layers, strict=True)
    ):
        if hasattr(layers[0], "number_of_states"):  # a layer with recurrent tensors
            for kind, i in _recurrent_slots(layers[0]):
                tensors = [getattr(layer, f"{kind}_states")[i] for layer in layers]
                roundings = _WINDOW_ROUNDINGS if kind == "conv" else 1
                pieces.append((f"layer {index} {kind} {i}", *tensors, None, roundings))
    # The coarsest precision the computation went through: the model's
    # dtype even where a state is kept in float32, and never finer than
    # float32, which chunked kernels use even in a float64 model.
    model_eps = max(torch.finfo(model.dtype).eps, torch.finfo(torch.float32).eps)
    errors = []
    for name, a, b, c, tail, roundings in pieces:
        a, b, c = a.double(), b.double(), c.double()
        eps = max(model_eps, torch.finfo(b.dtype).eps)
        tail_a = a if tail is None else a[-tail:]  # the positions the lost forward ran
        if a.shape != b.shape or tail_a.shape != c.shape:
            errors.append(SplitError(name, float("inf"), 0.0, 0.0, eps))
            continue
        errors.append(
            SplitError(
                name,
                split=float((a - b).abs().max()),
                lost=float((tail_a - c).abs().max()),
                largest=float(a.abs().max()),
                eps=eps,
                roundings=roundings,
            )
        )
    return errors


def _split_problem(model, arguments: ForwardArguments) -> str | None:
    """Why a forward over several tokens over a cache does not give what one
    forward over all of them gives, up to rounding (None: it does): what
    every turn that reuses a cache relies on (see ``_split_errors``).

    Rounding and a wrong continuation differ in kind, not by a fixed size.
    Rounding follows the compute precision, the model's dtype even where a
    state is kept in float32 (bfloat16 moved FalconH1's float32 states by
    1e-2 of their largest value on an AVX2 CPU), while a lost state, or a
    sparse selection that falls otherwise (GLM-MoE-DSA), moves a tensor by a
    good part of what losing the whole history does, in every dtype. So a
    tensor may be off by sqrt(eps) of what a forward from an empty state is
    off by (9% in bfloat16, 3e-4 in float32): supported models measured at
    most 2.3e-2 of it in bfloat16 and 1e-5 in float32; Mamba's scan, which
    restarts from zeros, 0.3 or more; GLM-MoE-DSA 0.17 or more, in float64
    too. A tensor the history barely moves may also be off by one rounding
    of its largest value, which different matrix shapes can cause: not more,
    since a random model's first recurrent state can depend on earlier tokens
    by only two roundings' worth (FalconH1 in bfloat16); a convolution's
    window, which the history cannot move in the first layer, by four
    (``_WINDOW_ROUNDINGS``)."""
    errors = _split_errors(model, arguments)
    for error in errors:
        logger.debug("kvchat probe: %s", error)
    failed = [error for error in errors if not error.ok]
    if not failed:
        return None
    worst = max(failed, key=lambda e: e.split / max(e.allowed, 1e-300))
    return (
        "a forward over several tokens does not continue the cached state "
        f"({worst.name} off by {worst.split:.3g}, rounding allows {worst.allowed:.3g}, "
        f"a lost state is off by {worst.lost:.3g})"
    )


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
            # Every reused turn relies on it: the uncached tail (after a
            # checkpoint, for a recurrent part) is prefilled in one forward
            # over the cache. Any layer kind can break it (a sparse
            # selection, a scan that restarts), so every model is probed.
            if problem is None:
                problem = _split_problem(model, self.forward_arguments)
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
