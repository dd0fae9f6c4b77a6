"""Session files without a model: the codec (a cache as a layout and its
tensors, and back) and the file's checks, on layer states built by hand
against a hand-written ``ModelLayout`` (an attention layer and a hybrid
attention-and-recurrent layer, with a checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from kvchat import _C
from kvchat.bridge.layout import ATTENTION, RECURRENT, LayerTemplate, ModelLayout
from kvchat.tiers.session_file import (
    SessionFileError,
    decode_state,
    encode_state,
    read_metadata,
    read_session,
    write_session,
)
from safetensors.torch import save_file

HEADS, DIM, TOKENS = 2, 8, 5
RECURRENT_SHAPES = ((1, 4, 3), (1, 2, 8, 8))  # a conv window, a scan state
SLOTS = (("conv", 0), ("ssm", 1))
FINGERPRINT = {"model_type": "toy", "dtype": "float32", "weights": "abc"}


def _layout(dtype) -> ModelLayout:
    attention = LayerTemplate((ATTENTION,), dtype, HEADS, DIM, DIM)
    hybrid = LayerTemplate(
        (ATTENTION, RECURRENT),
        dtype,
        HEADS,
        DIM,
        DIM,
        slots=SLOTS,
        recurrent=tuple((shape, dtype) for shape in RECURRENT_SHAPES),
    )
    parts = ((ATTENTION,), (ATTENTION, RECURRENT))
    return ModelLayout(("DynamicLayer", "HybridLayer"), parts, (), (attention, hybrid))


def _kv(dtype, tokens=TOKENS):
    return (torch.randn(1, HEADS, tokens, DIM).to(dtype) for _ in range(2))


def _state(dtype) -> _C.CachedState:
    """Five tokens: an attention layer, a hybrid layer, and a checkpoint at 3
    holding what cannot crop (the hybrid's recurrent part)."""
    torch.manual_seed(0)
    recurrent = _C.RecurrentState([torch.randn(s).to(dtype) for s in RECURRENT_SHAPES], TOKENS)
    hybrid = _C.HybridState(_C.AttentionState(*_kv(dtype)), recurrent)
    earlier = _C.RecurrentState([torch.randn(s).to(dtype) for s in RECURRENT_SHAPES], 3)
    snapshot = _C.HybridState(_C.AttentionState(*_kv(dtype, 3)), earlier).snapshot()
    checkpoint = _C.Checkpoint(3, [None, snapshot])
    layers = [_C.AttentionState(*_kv(dtype)), hybrid]
    return _C.CachedState([5, 6, 7, 8, 9], layers, [checkpoint], "hello", 4)


def _tensors(states) -> list[torch.Tensor]:
    return [t for s in states if s is not None for t in s.tensors()]


def _assert_same(a: _C.CachedState, b: _C.CachedState) -> None:
    assert list(a.ids) == list(b.ids) and a.text == b.text
    assert a.trusted_tokens == b.trusted_tokens
    assert [s.meta for s in a.layers] == [s.meta for s in b.layers]
    for x, y in zip(_tensors(a.layers), _tensors(b.layers), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert [c.position for c in a.checkpoints] == [c.position for c in b.checkpoints]
    for c, d in zip(a.checkpoints, b.checkpoints, strict=True):
        assert [None if s is None else s.meta for s in c.states] == [
            None if s is None else s.meta for s in d.states
        ]
        for x, y in zip(_tensors(c.states), _tensors(d.states), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cache_comes_back_from_its_layout_and_tensors_bit_for_bit(dtype):
    layout = _layout(dtype)
    state = _state(dtype)
    described, tensors = encode_state(state, layout.slots)
    # The layout is plain JSON (it goes in the file's metadata) and names
    # every tensor; the tensors are the session's own, not copies.
    described = json.loads(json.dumps(described))
    assert len(tensors) == 2 + 4 + 2
    assert tensors["layer.0.0"].data_ptr() == state.layers[0].tensors()[0].data_ptr()
    _assert_same(decode_state(described, tensors, layout, "cpu"), state)


def test_nothing_cached_encodes_as_no_layout():
    assert encode_state(None, []) == (None, {})
    empty = _C.CachedState([], [], [], "", 0)
    assert encode_state(empty, []) == (None, {})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d, t, layout: t.update({"layer.0.0": t["layer.0.0"][:, :1]}), "layer.0"),
        (lambda d, t, layout: t.update({"layer.1.2": t["layer.1.2"].double()}), "layer.1.0"),
        (lambda d, t, layout: d["layers"].pop(), "1 layers, the model 2"),
        (lambda d, t, layout: d.update(slots=[None, [["ssm", 0]]]), "recurrent tensors"),
        (lambda d, t, layout: d["layers"][1].update(kind="attention"), "layer.1"),
        (lambda d, t, layout: d["layers"][0].update(tensors="2"), "tensor count"),
        (lambda d, t, layout: d["layers"].__setitem__(0, None), "no state"),
        (lambda d, t, layout: d["checkpoints"][0]["states"].pop(), "checkpoint 0"),
        (lambda d, t, layout: d.update(text=7), "text"),
        (lambda d, t, layout: _both(t, "layer.0", lambda x: x.double()), "layer.0"),
        (lambda d, t, layout: _both(t, "layer.0", lambda x: x[..., :4]), "layer.0"),
        (lambda d, t, layout: t.update({"layer.0.1": t["layer.0.1"][:, :, :3]}), "layer.0"),
        (lambda d, t, layout: t.update({"layer.1.3": t["layer.1.3"][..., :4]}), "layer.1.1"),
        (lambda d, t, layout: _one_recurrent_tensor(d), "1 recurrent tensors"),
        (lambda d, t, layout: d["layers"][0].update(tensors=True), "tensor count True"),
        (lambda d, t, layout: d["checkpoints"][0]["states"].__setitem__(1, None), "no state"),
        (lambda d, t, layout: t["layer.1.1"].view(-1).__setitem__(0, float("nan")), "finite"),
        (
            lambda d, t, layout: t["checkpoint.0.1.0"].view(-1).__setitem__(0, float("inf")),
            "finite",
        ),
        (lambda d, t, layout: d["ids"].__setitem__(0, -1), "ids"),
        (lambda d, t, layout: d["ids"].__setitem__(0, True), "ids"),
        (lambda d, t, layout: d.update(trusted_tokens=True), "trusted_tokens"),
        (lambda d, t, layout: d.update(trusted_tokens=TOKENS + 1), "trusted_tokens"),
        (lambda d, t, layout: d["checkpoints"][0].update(position=True), "position"),
    ],
    ids=[
        "attention-heads",
        "recurrent-dtype",
        "layer-count",
        "slots",
        "kind",
        "count",
        "missing-layer",
        "checkpoint-layers",
        "text",
        "attention-dtype",
        "head-size",
        "values-tokens",
        "recurrent-shape",
        "recurrent-count",
        "bool-count",
        "checkpoint-hybrid-omitted",
        "nan",
        "checkpoint-inf",
        "negative-id",
        "bool-id",
        "bool-trusted",
        "trusted-past-ids",
        "bool-position",
    ],
)
def test_a_layout_that_does_not_fit_the_model_names_what(change, match):
    layout = _layout(torch.float32)
    described, tensors = encode_state(_state(torch.float32), layout.slots)
    described = json.loads(json.dumps(described))
    change(described, tensors, layout)
    with pytest.raises(ValueError, match=match):
        decode_state(described, tensors, layout, "cpu")


def _both(tensors, layer, change):
    """``change`` applied to the layer's keys and values alike."""
    for j in (0, 1):
        tensors[f"{layer}.{j}"] = change(tensors[f"{layer}.{j}"])


def _one_recurrent_tensor(described):
    """The hybrid layer's description claims one recurrent tensor of its two."""
    hybrid = described["layers"][1]
    hybrid["parts"][1]["tensors"] = 1
    hybrid["tensors"] = 3


def _write(tmp_path, state=None, dtype=torch.float32):
    path = tmp_path / "s.safetensors"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    state = _state(dtype) if state is None else state
    write_session(path, "alice", messages, state, FINGERPRINT, _layout(dtype).slots)
    return path, messages, state


def test_a_session_file_holds_the_session_and_its_cache(tmp_path):
    path, messages, state = _write(tmp_path)
    loaded = read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))
    assert loaded.session_id == "alice" and loaded.messages == messages
    _assert_same(loaded.state, state)
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed


def test_a_file_from_another_model_names_what_differs(tmp_path):
    path, _, _ = _write(tmp_path)
    other = dict(FINGERPRINT, weights="xyz")
    with pytest.raises(SessionFileError, match="different model: weights differ"):
        read_session(path, other, "cpu", _layout(torch.float32))


def test_a_changed_byte_anywhere_fails_the_checksum(tmp_path):
    path, _, _ = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(SessionFileError, match="checksum"):
        read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))


def test_a_truncated_or_foreign_file_is_refused_by_name(tmp_path):
    path, _, _ = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SessionFileError, match="s.safetensors"):
        read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not a session")
    with pytest.raises(SessionFileError, match="not a readable session file"):
        read_metadata(foreign)


def test_a_file_checked_against_another_layout_is_refused_whole(tmp_path):
    """The fingerprint matches but the cache does not fit the model's layers
    (a float16 layout for a float32 file): SessionFileError, not a state."""
    path, _, _ = _write(tmp_path)
    with pytest.raises(SessionFileError, match="layer"):
        read_session(path, FINGERPRINT, "cpu", _layout(torch.float16))


def test_a_session_with_nothing_cached_saves_its_messages_only(tmp_path):
    empty = _C.CachedState([], [], [], "", 0)
    path, messages, _ = _write(tmp_path, state=empty)
    loaded = read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))
    assert loaded.state is None and loaded.messages == messages


def test_a_file_with_no_usable_session_id_is_a_session_file_error(tmp_path):
    path = tmp_path / "s.safetensors"
    write_session(path, "", [], _state(torch.float32), FINGERPRINT, _layout(torch.float32).slots)
    with pytest.raises(SessionFileError, match="session id"):
        read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))


def test_a_safetensors_file_kvchat_did_not_write_is_not_a_session_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(SessionFileError, match="not a kvchat session file"):
        read_session(path, FINGERPRINT, "cpu", _layout(torch.float32))
