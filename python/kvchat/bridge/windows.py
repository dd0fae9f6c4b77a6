"""Checkpoints inside a prompt's tail read off the one forward that prefills
it, for a model whose every state that cannot crop back is a convolution
window (LFM2's short convolutions; ``ModelLayout.checkpoints_from_windows``).

A conv layer's state after token ``p`` is its last ``width`` inputs up to
``p``, and the forward over the tail hands the layer all of those inputs at
once (``update_conv_state``). So the window at each stop is a slice of them,
and the turn needs no forward that stops there: a stop costs a copy of a few
columns per layer, where stopping cost a second pass over every weight (a
6% longer first turn on LFM2-350M, RESULTS §21).

The slice is the one a forward stopping at ``p`` would have kept, computed
from the same inputs as plain ``generate``'s single forward. Whether a model
hands its layer the inputs this way is checked on every use, not assumed:
the window at the prompt's end must equal, bit for bit, what the layer itself
kept. If it does not (a model that writes its state another way), the turn
keeps no inner checkpoint and the bridge goes back to stopping the forward.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import _C
from .layout import ModelLayout

logger = logging.getLogger("kvchat")


class WindowCheckpoints:
    """While entered, records from ``cache``'s conv layers the window at each
    of ``positions`` (rising, in ``(begin, end)``), where the cache holds
    ``begin`` tokens and the forward runs to the prompt's ``end``; then
    ``checkpoints()`` gives them as the core's checkpoints."""

    def __init__(self, layout: ModelLayout, cache, begin: int, end: int, positions: list[int]):
        if not layout.checkpoints_from_windows:
            raise ValueError("this model's checkpoints are not convolution windows")
        self._layout, self._cache = layout, cache
        self._begin, self._end, self._positions = begin, end, list(positions)
        self._windows: dict[int, dict[tuple[int, int], torch.Tensor]] = {
            p: {} for p in self._positions
        }
        self._seen: dict[tuple[int, int], int] = {}  # (core layer, state index) -> tokens
        self._checked: set[tuple[int, int]] = set()
        self.problem: str | None = None  # why the windows cannot be trusted
        self._patched: dict[int, tuple] = {}  # id(layer) -> (layer, state indexes due)

    def __enter__(self):
        layout = self._layout
        for j, index in enumerate(layout.stateful):
            template = layout.templates[j]
            if not template.has_recurrent:
                continue
            layer = self._cache.layers[index]
            original = getattr(layer, "update_conv_state", None)
            if original is None:
                self.problem = f"layer {index} ({type(layer).__name__}) takes no conv inputs"
                continue
            widths = {
                i: shape[-1]
                for (_, i), (shape, _) in zip(template.slots, template.recurrent, strict=True)
            }
            # An instance attribute over the class's method, removed once the
            # layer has passed the prompt's end (before decoding) or on exit.
            layer.update_conv_state = functools.partial(self._update, layer, j, widths, original)
            self._patched[id(layer)] = (layer, set(widths))
        return self

    def __exit__(self, *exc):
        for layer, _ in list(self._patched.values()):
            self._unpatch(layer)

    def _unpatch(self, layer) -> None:
        if self._patched.pop(id(layer), None) is not None:
            del layer.update_conv_state

    def _update(self, layer, j, widths, original, conv_states, state_idx=0, **kwargs):
        key = (j, state_idx)
        seen = self._seen.get(key, self._begin)
        previous = None
        if self.problem is None and seen < self._end:
            try:
                previous = self._record(layer, key, widths[state_idx], seen, conv_states)
            except Exception as error:  # never fail the forward over a checkpoint
                self.problem = f"layer {self._layout.stateful[j]}: {error!r}"
        result = original(conv_states, state_idx, **kwargs)
        tokens = conv_states.shape[-1]
        self._seen[key] = seen + tokens
        if seen < self._end <= seen + tokens:
            if self.problem is None:
                self._check_end(layer, key, widths[state_idx], previous, conv_states, seen)
            _, waiting = self._patched.get(id(layer), (None, set()))
            waiting.discard(state_idx)
            if not waiting:
                self._unpatch(layer)
        return result

    def _record(self, layer, key, width, seen, conv_states):
        """Keeps the windows at the positions this call's inputs reach; returns
        the layer's window before them (None: the layer had none)."""
        _, state_idx = key
        previous = None
        if layer.has_previous_state[state_idx]:
            previous = layer.conv_states[state_idx].clone()  # the call writes it in place
        tokens = conv_states.shape[-1]
        for position in self._positions:
            if seen < position <= seen + tokens:
                window = _window(previous, conv_states[..., : position - seen], width)
                self._windows[position][key] = window.clone()
        return previous

    def _check_end(self, layer, key, width, previous, conv_states, seen):
        expected = _window(previous, conv_states[..., : self._end - seen], width)
        kept = layer.conv_states[key[1]]
        if kept.shape != expected.shape or not torch.equal(kept, expected):
            self.problem = (
                f"layer {self._layout.stateful[key[0]]} kept a conv state that is not "
                "the last window of its inputs"
            )
        self._checked.add(key)

    def checkpoints(self) -> list[_C.Checkpoint]:
        """The checkpoints, or none if any window is missing or untrusted
        (``problem`` says why)."""
        expected = {(j, i) for j, t in enumerate(self._layout.templates) for _, i in t.slots}
        if self.problem is None and self._checked != expected:
            missing = [self._layout.stateful[j] for j, _ in sorted(expected - self._checked)]
            self.problem = f"the forward did not hand conv layers {missing} their inputs"
        if self.problem is not None:
            return []
        checkpoints = []
        for position in self._positions:
            windows = self._windows[position]
            states = []
            for j, template in enumerate(self._layout.templates):
                if not template.has_recurrent:
                    states.append(None)  # attention crops back by views
                    continue
                tensors = [windows[(j, i)] for _, i in template.slots]
                states.append(_C.RecurrentState(tensors, position))
            checkpoints.append(_C.Checkpoint(position, states))
        return checkpoints


def _window(previous: torch.Tensor | None, inputs: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` inputs after ``previous``, zero-padded on the left
    as the layer pads a first prefill shorter than its window."""
    full = inputs if previous is None else torch.cat([previous, inputs], dim=-1)
    if full.shape[-1] < width:
        full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
    return full[..., -width:]
