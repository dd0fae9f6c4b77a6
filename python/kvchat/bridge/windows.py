"""Checkpoints inside a prompt's tail read off the one forward that prefills
it, for a model whose every state that cannot crop back is a convolution
window (LFM2's short convolutions; ``ModelLayout.conv_windows_only``).

A conv layer's state after token ``p`` is its last ``width`` inputs up to
``p``, and the forward over the tail hands the layer all of those inputs at
once (``update_conv_state``). So the window at each stop is a slice of them,
and the turn needs no forward that stops there: a stop costs a copy of a few
columns per layer, where stopping cost a second pass over every weight (a
6% longer first turn on LFM2-350M, RESULTS §21).

The slice is taken from the inputs generate's own forward computed, as plain
``generate`` computes them in its single forward; a forward stopping at ``p``
would have computed the same values up to matrix-shape rounding, which the
probe bounds (``probe._split_problem``). Whether a model hands its layer the
inputs this way is checked on every use, not assumed: the window at the
prompt's end must equal, bit for bit, what the layer itself kept. If it does
not (a model that writes its state another way), the turn keeps no inner
checkpoint and the bridge goes back to stopping the forward.

The one forward is the engine's when no other row decodes. While rows decode
the engine prefills a long tail in chunks of ``max_step_tokens`` instead
(engine/loop.py), and a chunk may be a single token, which LFM2 runs through
its decode path without ``update_conv_state``: windows cannot be read across
such chunks. The engine then calls ``stop()`` before the tail's first
forward, and its prefill stops at each position and snapshots the state
there, as for any layer that cannot crop.
"""

from __future__ import annotations

import functools

import torch

from .. import _C
from .layout import ModelLayout


class WindowCheckpoints:
    """While entered, records from ``cache``'s conv layers the window at each
    of ``positions`` (rising, in ``(begin, end)``), where the cache holds
    ``begin`` tokens and one forward runs over the tail to the prompt's
    ``end`` (a prefill in chunks is refused: the turn stops the forward
    instead); then ``finish()`` gives them as the core's checkpoints."""

    def __init__(self, layout: ModelLayout, cache, begin: int, end: int, positions: list[int]):
        if not layout.conv_windows_only:
            raise ValueError("this model's checkpoints are not convolution windows alone")
        positions = list(positions)
        if not all(begin < p < end for p in positions) or positions != sorted(set(positions)):
            raise ValueError(
                f"checkpoint positions must rise within ({begin}, {end}), got {positions}"
            )
        self._layout, self._cache = layout, cache
        self._begin, self._end, self._positions = begin, end, positions
        self._windows: dict[int, dict[tuple[int, int], torch.Tensor]] = {p: {} for p in positions}
        self._seen: dict[tuple[int, int], int] = {}  # (core layer, state index) -> tokens
        # Per (core layer, state index) that reached the prompt's end: whether
        # the window there differs from the layer's own, as a device tensor
        # (read once, after generate: no stall inside the forward).
        self._differs: dict[tuple[int, int], torch.Tensor] = {}
        self._problem: str | None = None  # why the windows cannot be trusted
        self._patched: dict[int, tuple] = {}  # id(layer) -> (layer, state indexes due)
        # stop(): this turn's checkpoints are taken by stopping the prefill.
        self.stopped = False

    def __enter__(self):
        try:
            self._patch()
        except BaseException:
            self._unpatch_all()
            raise
        return self

    def __exit__(self, *exc):
        self._unpatch_all()

    def _patch(self) -> None:
        layout = self._layout
        for j, index in enumerate(layout.stateful):
            template = layout.templates[j]
            if not template.has_recurrent:
                continue
            layer = self._cache.layers[index]
            original = getattr(layer, "update_conv_state", None)
            if original is None:
                self._problem = f"layer {index} ({type(layer).__name__}) takes no conv inputs"
                continue
            widths = {
                i: shape[-1]
                for (_, i), (shape, _) in zip(template.slots, template.recurrent, strict=True)
            }
            # An instance attribute over the class's method, removed once the
            # layer has passed the prompt's end (before decoding) or on exit;
            # never traced by a compiled forward.
            update = functools.partial(self._update, layer, j, widths, original)
            layer.update_conv_state = torch.compiler.disable(update)
            self._patched[id(layer)] = (layer, set(widths))

    @property
    def positions(self) -> list[int]:
        """The checkpoint positions it reads (or, stopped, the prefill stops at)."""
        return list(self._positions)

    def stop(self) -> list[int]:
        """Reads no window (the tail is to be prefilled in several forwards,
        module docstring) and returns the positions, where the prefill must
        stop instead. Call before the first forward over the tail."""
        if self._seen:
            raise RuntimeError("the windows were stopped after a forward over the tail began")
        self._unpatch_all()
        self.stopped = True
        return list(self._positions)

    def _unpatch_all(self) -> None:
        for layer, _ in list(self._patched.values()):
            self._unpatch(layer)

    def _unpatch(self, layer) -> None:
        if self._patched.pop(id(layer), None) is not None:
            del layer.update_conv_state

    def _update(self, layer, j, widths, original, conv_states, state_idx=0, **kwargs):
        key, tokens = (j, state_idx), conv_states.shape[-1]
        seen = self._seen.get(key, self._begin)
        self._seen[key] = seen + tokens
        if seen >= self._end:  # past the prompt (the layer is unpatched by now)
            return original(conv_states, state_idx, **kwargs)
        where = f"layer {self._layout.stateful[j]}"
        previous = None
        if self._problem is None:
            try:
                if (seen, seen + tokens) != (self._begin, self._end):
                    # A prefill in pieces (one may skip this method, as
                    # LFM2's one-token path does) could misplace the windows.
                    raise ValueError(
                        f"inputs for tokens [{seen}, {seen + tokens}), not the tail "
                        f"[{self._begin}, {self._end}) in one call"
                    )
                if layer.has_previous_state[state_idx]:
                    # The layer's call below writes it in place.
                    previous = layer.conv_states[state_idx].clone()
                self._record(key, widths[state_idx], previous, conv_states)
            except Exception as error:  # never fail the forward over a checkpoint
                self._problem = f"{where}: {error!r}"
        result = original(conv_states, state_idx, **kwargs)
        if self._problem is None:
            try:
                self._check_end(layer, key, widths[state_idx], previous, conv_states)
            except Exception as error:
                self._problem = f"{where}: {error!r}"
        # One call per state reads the whole tail: the layer is done with.
        _, waiting = self._patched.get(id(layer), (None, set()))
        waiting.discard(state_idx)
        if not waiting:
            self._unpatch(layer)
        return result

    def _record(self, key, width, previous, conv_states) -> None:
        """Keeps the window at each position (the call's inputs are the tail's)."""
        for position in self._positions:
            window = _window(previous, conv_states[..., : position - self._begin], width)
            # Contiguous, as the snapshots of a stopped forward are.
            self._windows[position][key] = window.clone(memory_format=torch.contiguous_format)

    def _check_end(self, layer, key, width, previous, conv_states) -> None:
        """Notes whether the layer kept the window at the prompt's end, as a
        device tensor: read once, after generate, with no stall in the forward."""
        expected = _window(previous, conv_states, width)
        kept = layer.conv_states[key[1]]
        if kept.shape != expected.shape:
            raise ValueError(f"a conv state of shape {tuple(kept.shape)}")
        # Bit for bit, NaN included: a NaN in a prompt's states (an overflow,
        # say) is that prompt's, not a sign that windows cannot be read here.
        both_nan = torch.isnan(kept) & torch.isnan(expected)
        self._differs[key] = ((kept != expected) & ~both_nan).any()

    def finish(self) -> tuple[list[_C.Checkpoint], str | None]:
        """(the checkpoints, None), or ([], why) if any window is missing or
        untrusted. Call after the forward."""
        problem = self._problem
        expected = {(j, i) for j, t in enumerate(self._layout.templates) for _, i in t.slots}
        if problem is None and set(self._differs) != expected:
            missing = sorted({self._layout.stateful[j] for j, _ in expected - set(self._differs)})
            problem = f"the forward did not hand conv layers {missing} their inputs"
        if problem is None and bool(torch.stack([*self._differs.values()]).any()):
            differ = sorted(self._layout.stateful[j] for (j, _), d in self._differs.items() if d)
            problem = (
                f"conv layers {differ} kept a state that is not the last window of their inputs"
            )
        if problem is not None:
            return [], problem
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
        return checkpoints, None


def _window(previous: torch.Tensor | None, inputs: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` inputs after ``previous``, zero-padded on the left
    as the layer pads a first prefill shorter than its window."""
    full = inputs if previous is None else torch.cat([previous, inputs], dim=-1)
    if full.shape[-1] < width:
        full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
    return full[..., -width:]
