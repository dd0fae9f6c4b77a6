"""WindowCheckpoints' arithmetic on a stand-in conv layer: the window at each
stop is the layer's last inputs up to it, zero-padded as a first prefill
shorter than the window is, and a layer that keeps anything else is caught."""

from __future__ import annotations

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
    """Keeps its last WIDTH inputs, as transformers' LinearAttentionLayer does
    (``keeps="first"``: its first ones, which no checkpoint may trust)."""

    def __init__(self, keeps="last", state=None):
        self.keeps = keeps
        self.has_previous_state = {0: state is not None}
        self.conv_states = {0: state}

    def update_conv_state(self, conv_states, state_idx=0, **kwargs):
        full = conv_states
        if self.has_previous_state[state_idx]:
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        elif full.shape[-1] < WIDTH:
            full = torch.nn.functional.pad(full, (WIDTH - full.shape[-1], 0))
        kept = full[..., -WIDTH:] if self.keeps == "last" else full[..., :WIDTH]
        self.conv_states[state_idx] = kept.clone()
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


def test_windows_at_each_stop_over_an_empty_cache_in_two_calls():
    layer = _ConvLayer()
    inputs = _inputs(10)  # tokens 1..10
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 10, [2, 5, 7, 9]) as windows:
        layer.update_conv_state(inputs[..., :6])  # a prefill in chunks: two calls
        layer.update_conv_state(inputs[..., 6:])
    checkpoints = windows.checkpoints()
    assert windows.problem is None
    assert [c.position for c in checkpoints] == [2, 5, 7, 9]
    assert [_columns(c.states[0]) for c in checkpoints] == [
        [0.0, 1.0, 2.0],  # shorter than the window: zero-padded on the left
        [3.0, 4.0, 5.0],
        [5.0, 6.0, 7.0],
        [7.0, 8.0, 9.0],
    ]
    assert all(c.states[0].meta["tokens"] == c.position for c in checkpoints)
    assert "update_conv_state" not in vars(layer)  # unpatched once past the prompt


def test_windows_over_a_cache_that_holds_earlier_tokens():
    layer = _ConvLayer(state=_inputs(WIDTH, start=-2))  # tokens -2, -1, 0 held
    with WindowCheckpoints(_layout(), _Cache(layer), 20, 24, [21, 22]) as windows:
        layer.update_conv_state(_inputs(4))
    assert [_columns(c.states[0]) for c in windows.checkpoints()] == [
        [-1.0, 0.0, 1.0],
        [0.0, 1.0, 2.0],
    ]


def test_a_layer_that_keeps_another_window_gives_no_checkpoint():
    layer = _ConvLayer(keeps="first")
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        layer.update_conv_state(_inputs(8))
    assert windows.checkpoints() == []
    assert "not the last window" in windows.problem


def test_a_forward_that_bypasses_the_layer_gives_no_checkpoint():
    layer = _ConvLayer()
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        type(layer).update_conv_state(layer, _inputs(8))  # the state written another way
    assert windows.checkpoints() == []
    assert "did not hand conv layers [0]" in windows.problem
    assert "update_conv_state" not in vars(layer)


def test_a_call_the_capture_cannot_read_still_runs_the_layer():
    """A conv state the probe never saw (a second state index) is no reason
    to fail the forward: the layer runs, and the turn keeps no checkpoint."""
    layer = _ConvLayer()
    layer.has_previous_state[1], layer.conv_states[1] = False, None
    with WindowCheckpoints(_layout(), _Cache(layer), 0, 8, [4]) as windows:
        full = layer.update_conv_state(_inputs(8), 1)
    assert torch.equal(full, _inputs(8))
    assert _columns_of(layer.conv_states[1]) == [6.0, 7.0, 8.0]
    assert windows.checkpoints() == []
    assert windows.problem.startswith("layer 0: KeyError(1)")


def _columns_of(tensor) -> list[float]:
    return tensor[0, 0].tolist()
