"""WindowCheckpoints' arithmetic on a stand-in conv layer: the window at each
stop is the layer's last inputs up to it, zero-padded as a first prefill
shorter than the window is, and a layer that keeps anything else, or a
prefill that comes in pieces, is caught."""

from __future__ import annotations

import pytest
import torch
from kvchat.bridge import RECURRENT, LayerTemplate, ModelLayout
from kvchat.bridge.windows import WindowCheckpoints

WIDTH, CHANNELS = 3, 4


def _layout() -> ModelLayout:
    template = LayerTemplate(
        parts=(RECURRENT,),
        slots=(("conv", 0),),
        recurrent=(((1, CHANNELS, WIDTH), torch.float64),),
    )
    return ModelLayout(("LinearAttentionLayer",), ((RECURRENT,),), templates=(template,))


class _ConvLayer:
    """Keeps its last WIDTH inputs in place, as transformers'
    LinearAttentionLayer does (``keeps="first"``: its first ones, which no
    checkpoint may trust)."""

    def __init__(self, keeps="last", state=None):
        self.keeps = keeps
        self.has_previous_state = {0: state is not None}
        self.conv_states = {0: torch.zeros(1, CHANNELS, WIDTH, dtype=torch.float64)}
        if state is not None:
            self.conv_states[0].copy_(state)

    def update_conv_state(self, conv_states, state_idx=0, **kwargs):
        full = conv_states
        if self.has_previous_state[state_idx]:
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        elif full.shape[-1] < WIDTH:
            full = torch.nn.functional.pad(full, (WIDTH - full.shape[-1], 0))
        kept = full[..., -WIDTH:] if self.keeps == "last" else full[..., :WIDTH]
        self.conv_states[state_idx].copy_(kept)
        self.has_previous_state[state_idx] = True
        return full


class _Cache:
    def __init__(self, layer):
        self.layers = [layer]


def _inputs(tokens: int, start: int = 1) -> torch.Tensor:
    """Column t holds start + t in every channel, so a window names its tokens."""
    column = torch.arange(start, start + tokens, dtype=torch.float64)
    return column.expand(1, CHANNELS, tokens).clone()


def _columns(state) -> list[float]:
    (tensor,) = state.tensors()
    return tensor[0, 0].tolist()


def test_windows_at_each_stop_over_an_empty_cache():
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [2, 5, 7, 9]) as windows:
        layer.update_conv_state(_inputs(10))  # tokens 1..10
        assert "update_conv_state" not in vars(layer)  # unpatched once past the prompt
        layer.update_conv_state(_inputs(1, start=11))  # decoding: not recorded
    checkpoints, problem = windows.finish()
    assert problem is None
    assert [c.position for c in checkpoints] == [2, 5, 7, 9]
    assert [_columns(c.states[0]) for c in checkpoints] == [
        [0.0, 1.0, 2.0],  # shorter than the window: zero-padded on the left
        [3.0, 4.0, 5.0],
        [5.0, 6.0, 7.0],
        [7.0, 8.0, 9.0],
    ]
    assert all(c.states[0].meta["tokens"] == c.position for c in checkpoints)


def test_a_nan_in_the_inputs_is_the_prompts_not_a_failed_check():
    """NaN != NaN: a prompt whose states hold a NaN (an overflow in float16,
    say) kept its window all the same, and must not switch windows off."""
    layer = _ConvLayer()
    inputs = _inputs(10)
    inputs[..., 8] = float("nan")  # token 9, inside the last window
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [5]) as windows:
        layer.update_conv_state(inputs)
    checkpoints, problem = windows.finish()
    assert problem is None and [c.position for c in checkpoints] == [5]
    assert _columns(checkpoints[0].states[0]) == [3.0, 4.0, 5.0]


def test_a_tail_shorter_than_the_window_over_held_tokens():
    """The layer overwrites its state in place: the windows come from the
    state it held before the call."""
    layer = _ConvLayer(state=_inputs(WIDTH, start=-2))  # tokens -2, -1, 0 held
    with WindowCheckpoints(_layout(), _Cache(layer), 20, 22, [21]) as windows:
        layer.update_conv_state(_inputs(2))  # tokens 1, 2
    checkpoints, problem = windows.finish()
    assert problem is None
    assert [_columns(c.states[0]) for c in checkpoints] == [[-1.0, 0.0, 1.0]]


def test_a_layer_that_keeps_another_window_gives_no_checkpoint():
    layer = _ConvLayer(keeps="first")
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        layer.update_conv_state(_inputs(8))
    checkpoints, problem = windows.finish()
    assert checkpoints == [] and "kept a state that is not the last window" in problem


def test_a_prefill_in_pieces_gives_no_checkpoint():
    """A piece may skip the method (LFM2's one-token path), which would
    misplace every window after it: pieces are refused, not counted."""
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [2, 7]) as windows:
        layer.update_conv_state(_inputs(6))
        layer.update_conv_state(_inputs(4, start=7))
    checkpoints, problem = windows.finish()
    assert checkpoints == [] and "not the tail [0, 10) in one call" in problem
    assert torch.equal(layer.conv_states[0], _inputs(WIDTH, start=8))  # the layer still ran


def test_a_forward_that_bypasses_the_layer_gives_no_checkpoint():
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        type(layer).update_conv_state(layer, _inputs(8))  # the state written another way
    checkpoints, problem = windows.finish()
    assert checkpoints == [] and "did not hand conv layers [0]" in problem
    assert "update_conv_state" not in vars(layer)


def test_a_call_the_capture_cannot_read_still_runs_the_layer():
    """A conv state the probe never saw (a second state index) is no reason
    to fail the forward: the layer runs, and the turn keeps no checkpoint."""
    layer = _ConvLayer()
    layer.has_previous_state[1] = False
    layer.conv_states[1] = torch.zeros(1, CHANNELS, WIDTH, dtype=torch.float64)
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        full = layer.update_conv_state(_inputs(8), 1)
    assert torch.equal(full, _inputs(8))
    assert layer.conv_states[1][0, 0].tolist() == [6.0, 7.0, 8.0]
    checkpoints, problem = windows.finish()
    assert checkpoints == [] and problem.startswith("layer 0: KeyError(1)")


@pytest.mark.parametrize("positions", [[0], [4, 4], [5, 4], [8]])
def test_positions_outside_the_tail_or_not_rising_are_refused(positions):
    with pytest.raises(ValueError, match="must rise within"):
        WindowCheckpoints(_layout(), _Cache(_ConvLayer()), 0, 8, positions)


def test_stopped_windows_read_nothing_and_hand_back_their_positions():
    """The engine prefills the tail in chunks (rows decode meanwhile): stop()
    unpatches the layer before the first forward, so the chunks run the
    layer's own method unrecorded, and returns where the prefill must stop."""
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [2, 7]) as windows:
        assert "update_conv_state" in vars(layer)
        assert windows.stop() == [2, 7]
        assert "update_conv_state" not in vars(layer) and windows.stopped
        layer.update_conv_state(_inputs(6))
        layer.update_conv_state(_inputs(4, start=7))
    assert torch.equal(layer.conv_states[0], _inputs(WIDTH, start=8))


def test_windows_cannot_stop_once_the_tail_began():
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [2, 7]) as windows:
        layer.update_conv_state(_inputs(6))
        with pytest.raises(RuntimeError, match="after a forward over the tail began"):
            windows.stop()
