"""What kvchat knows of one model's cache, as a value: ``ModelLayout``.

The layout is read once, off a cache the model filled (``probe.probe_layout``),
and never learned from a turn or a file, so nothing from outside can change it.
Everything that checks state against the model takes this value: session
files, the tiers, the bridge's conversions. None of them needs the model or
transformers to do so.

A layer's parts are the core's own ``LayerKind`` values (one enum on both
sides of the binding): ``attention``, ``sliding_window`` or ``recurrent``, or
two of them for a hybrid layer (attention first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import torch

from .. import _C

LayerKind = _C.LayerKind
ATTENTION = LayerKind.attention
SLIDING = LayerKind.sliding_window
RECURRENT = LayerKind.recurrent

Parts = tuple  # of LayerKind: () for a stateless layer
# Every layer kvchat carries: none, one part, or a hybrid's attention then recurrent.
_SHAPES = {(), (ATTENTION,), (SLIDING,), (RECURRENT,), (ATTENTION, RECURRENT), (SLIDING, RECURRENT)}


def describe(parts: Parts) -> str:
    """``attention``, ``sliding_window/recurrent``: the parts as messages name them."""
    return "/".join(part.name for part in parts)


@dataclass(frozen=True)
class LayerTemplate:
    """What one core layer's state must look like for this model: anything
    loaded from outside is checked against it."""

    parts: Parts  # (ATTENTION,), (SLIDING,), (RECURRENT,), or attention then RECURRENT
    dtype: torch.dtype | None = None  # of the attention part
    kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    window: int | None = None  # the most tokens a sliding layer holds
    slots: tuple[tuple[str, int], ...] = ()  # the recurrent tensors' (kind, index)
    recurrent: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()  # their shapes and dtypes

    @property
    def attention(self) -> LayerKind | None:
        """The attention part's kind (ATTENTION or SLIDING), or None."""
        return None if self.parts[0] == RECURRENT else self.parts[0]

    @property
    def has_recurrent(self) -> bool:
        return RECURRENT in self.parts


@dataclass(frozen=True)
class ModelLayout:
    """One model's cache, layer by layer, as kvchat carries it.

    The core's layers are the cache's stateful layers, in order, then the
    indexer keys of each layer in ``indexed``. Invariants (``__post_init__``):
    a supported layout has a template for every core layer; an unsupported
    one has none and says why in ``problem``."""

    layer_classes: tuple[str, ...]  # every cache layer's class, dummies included
    # Per cache layer: its parts, () for a stateless (dummy) layer, None for a
    # class kvchat does not know.
    parts: tuple[Parts | None, ...]
    indexed: tuple[int, ...] = ()  # cache layers whose indexer keys the core holds
    templates: tuple[LayerTemplate, ...] = ()  # per core layer
    problem: str | None = None  # why kvchat cannot carry this cache; None: it can

    def __post_init__(self):
        if len(self.parts) != len(self.layer_classes):
            raise ValueError(f"{len(self.parts)} parts for {len(self.layer_classes)} layers")
        for i, parts in enumerate(self.parts):
            if parts not in _SHAPES and not (parts is None and not self.supported):
                raise ValueError(f"layer {i}: parts {parts!r} are no layer kvchat carries")
        expected = len(self.stateful) + len(self.indexed) if self.supported else 0
        if len(self.templates) != expected:
            raise ValueError(f"{len(self.templates)} templates for {expected} core layers")
        if self.supported:
            for j, i in enumerate(self.stateful):
                if self.templates[j].parts != self.parts[i]:
                    raise ValueError(f"layer {i}: a template of {self.templates[j].parts}")
            for i in self.indexed:
                if not 0 <= i < len(self.parts) or self.parts[i] != (ATTENTION,):
                    raise ValueError(f"indexed layer {i} is no attention layer")

    @property
    def supported(self) -> bool:
        return self.problem is None

    @cached_property
    def stateful(self) -> tuple[int, ...]:
        """The cache layers that hold state, in order: the core's first layers."""
        return tuple(i for i, parts in enumerate(self.parts) if parts != ())

    @property
    def num_layers(self) -> int:
        """The core's layers: as many as templates; the stateful ones if unsupported."""
        return len(self.templates) if self.supported else len(self.stateful)

    @cached_property
    def indexer_of(self) -> Mapping[int, int]:
        """Cache layer -> the core layer that holds its indexer keys (read-only:
        the layout is shared with callers of ``SessionManager.layout``)."""
        return MappingProxyType({i: len(self.stateful) + k for k, i in enumerate(self.indexed)})

    @property
    def knows_length(self) -> bool:
        """Whether the cache counts its tokens (get_seq_length): only an
        attention part can; recurrent layers alone leave it to kvchat."""
        return any(parts and parts[0] != RECURRENT for parts in self.parts)

    @property
    def needs_checkpoints(self) -> bool:
        """Anything but full attention cannot crop back, so needs checkpoints."""
        return any(parts != (ATTENTION,) for parts in self.parts if parts != ())

    @property
    def conv_windows_only(self) -> bool:
        """Whether every state that cannot crop back is a convolution window
        in a layer of its own (LFM2's short convolutions), for the whole
        model: a checkpoint inside a forward is then a slice of that forward's
        inputs (``windows``)."""
        recurrent = [t for t in self.templates if t.parts != (ATTENTION,)]
        return bool(recurrent) and all(
            t.parts == (RECURRENT,) and all(kind == "conv" for kind, _ in t.slots)
            for t in recurrent
        )

    @property
    def slots(self) -> list:
        """Per core layer, the (kind, index) of each recurrent tensor (None: no
        recurrent part), as session files record them."""
        return [[list(s) for s in t.slots] if t.has_recurrent else None for t in self.templates]
