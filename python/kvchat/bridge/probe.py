"""Reads a model's ``ModelLayout`` off caches the model filled: which layer
classes it has, what each stateful layer holds, and whether a forward over
several tokens continues exactly from the state a cache holds.

That split is what every reused turn relies on: the uncached tail (after a
checkpoint, for a recurrent part) is prefilled in one forward over the cache.
It holds for attention and for Mamba2's chunked scan; the Mamba (v1)
selective scan of Mamba, FalconMamba and Jamba starts from zeros, and
GLM-MoE-DSA's sparse selection is inexact the same way. Any layer kind can
break it, so every model is probed (``_split_problem``); a model that fails
runs every turn as plain generate.
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

from .forward import ForwardArguments
from .layers import recurrent_slots
from .layout import ATTENTION, RECURRENT, SLIDING, LayerTemplate, ModelLayout

logger = logging.getLogger("kvchat")

# Which parts each supported layer class has. Exact classes only: a subclass
# may keep state kvchat would not carry over, so it gets no reuse instead.
PARTS = {
    DummyLayer: (),  # stateless: nothing to carry, always reusable
    DynamicLayer: (ATTENTION,),
    DynamicIndexedLayer: (ATTENTION,),  # plus indexer keys: ModelLayout.indexed
    DynamicSlidingWindowLayer: (SLIDING,),
    LinearAttentionLayer: (RECURRENT,),
    LinearAttentionAndFullAttentionLayer: (ATTENTION, RECURRENT),
    LinearAttentionAndSlidingWindowAttentionLayer: (SLIDING, RECURRENT),
}


def probe_layout(model, arguments: ForwardArguments) -> ModelLayout:
    """The model's layout, or an unsupported one naming its problem."""
    layers = DynamicCache(config=model.config).layers
    classes = tuple(type(layer).__name__ for layer in layers)
    parts = tuple(PARTS.get(type(layer)) for layer in layers)
    unsupported = sorted({type(layer).__name__ for layer in layers if type(layer) not in PARTS})
    if unsupported or all(p == () for p in parts):
        return ModelLayout(classes, parts, problem=f"cache layers {unsupported or ['<no state>']}")
    filled = _probe(model, arguments.cache_name)
    indexed = tuple(
        i
        for i, layer in enumerate(layers)
        if type(layer) is DynamicIndexedLayer and filled.layers[i].indexer_keys is not None
    )
    problem = _indexer_problem(filled, indexed) or _split_problem(model, arguments)
    if problem is not None:
        return ModelLayout(classes, parts, problem=problem)
    templates = _templates(filled, parts) + [_indexer_template(filled.layers[i]) for i in indexed]
    return ModelLayout(classes, parts, indexed, tuple(templates))


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
# Windows that no history can reach at all (every layer before them only
# convolves, within the probe's tail) are not compared: see _split_errors.
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
    # How many tokens back the next layer's inputs reach while every layer
    # so far mixes tokens only through a convolution window; None once one
    # carries history (attention keys or a recurrent state).
    reach = 0
    for index, layers in enumerate(
        zip(whole_cache.layers, split_cache.layers, lost_cache.layers, strict=True)
    ):
        slots = recurrent_slots(layers[0]) if hasattr(layers[0], "number_of_states") else ()
        keys = getattr(layers[0], "keys", None)
        windows_only = bool(slots) and all(kind == "conv" for kind, _ in slots)
        windows_only = windows_only and (keys is None or keys.numel() == 0)
        widest = 0
        for kind, i in slots:
            tensors = [getattr(layer, f"{kind}_states")[i] for layer in layers]
            width = tensors[0].shape[-1]
            widest = max(widest, width)
            if kind == "conv" and reach is not None and reach + width <= _PROBE_TAIL:
                # A layer's convolution reads the layer's input (LFM2's, Mamba2's
                # and gated DeltaNet's do), here filled from the tail's own tokens
                # whatever came before (the first layer; LFM2's second too): no
                # history to lose, only rounding, which grows with the width.
                logger.debug("kvchat probe: layer %d %s %d holds no history", index, kind, i)
                continue
            roundings = _WINDOW_ROUNDINGS if kind == "conv" else 1
            pieces.append((f"layer {index} {kind} {i}", *tensors, None, roundings))
        if reach is not None:
            reach = reach + widest - 1 if windows_only else None
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
        if layer_parts[0] != RECURRENT:
            keys, values = layer.keys, layer.values
            fields.update(
                dtype=keys.dtype,
                kv_heads=keys.shape[1],
                key_dim=keys.shape[3],
                value_dim=values.shape[3],
            )
            if layer_parts[0] == SLIDING:
                fields["window"] = int(layer.sliding_window)
        if RECURRENT in layer_parts:
            slots = recurrent_slots(layer)
            tensors = [getattr(layer, f"{kind}_states")[i] for kind, i in slots]
            fields.update(slots=slots, recurrent=tuple((tuple(t.shape), t.dtype) for t in tensors))
        templates.append(LayerTemplate(**fields))
    return templates


def _indexer_template(layer) -> LayerTemplate:
    keys = layer.indexer_keys
    return LayerTemplate(
        parts=(ATTENTION,), dtype=keys.dtype, kv_heads=1, key_dim=keys.shape[-1], value_dim=0
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
