"""The storage tiers' parts on their own, without a model or a Redis server:
the load-versus-prefill cost model, the snapshot codec (cutting, manifests,
reassembly) and the key names."""

from __future__ import annotations

import json

import pytest
import torch
from kvchat.tiers.cost import ReloadCost
from kvchat.tiers.redis.chunks import (
    FORMAT,
    StoreMiss,
    assemble,
    attention_tensors,
    cut,
    decode_manifest,
    encode_snapshot,
)
from kvchat.tiers.redis.keys import Keys


# ------------------------------------------------------------------ cost model
def test_every_load_is_worth_it_until_a_prefill_was_measured():
    cost = ReloadCost(default_ms_per_byte=1e-6)
    assert cost.worth_loading(10**12, 1)


def test_a_load_is_worth_it_only_when_its_bytes_cost_less_than_the_tokens_it_adds():
    cost = ReloadCost(default_ms_per_byte=1e-6)
    cost.observe_prefill(100, 100.0)  # 1 ms a token
    assert cost.worth_loading(9_000_000, 10)  # 9 ms of reading against 10 ms of prefill
    assert not cost.worth_loading(11_000_000, 10)
    assert not cost.worth_loading(10_000_000, 10)  # a tie prefills: nothing is read


def test_short_prefills_do_not_set_the_rate_and_rates_are_running_means():
    cost = ReloadCost(default_ms_per_byte=1e-6)
    cost.observe_prefill(15, 1500.0)  # fixed costs dominate: ignored
    assert cost.prefill_ms_per_token is None
    cost.observe_prefill(100, 100.0)
    cost.observe_prefill(100, 200.0)
    assert cost.prefill_ms_per_token == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)
    cost.observe_load(1000, 1.0)
    assert cost.load_ms_per_byte == pytest.approx(0.7 * 1e-6 + 0.3 * 1e-3)


def test_a_cost_model_needs_a_positive_default_rate():
    with pytest.raises(ValueError, match="default_ms_per_byte"):
        ReloadCost(0)


# ------------------------------------------------------------------ cutting
def test_keys_and_values_are_cut_by_tokens_so_a_prefix_keeps_its_blocks():
    torch.manual_seed(0)
    grown = torch.randn(1, 2, 150, 8)
    how, short = cut(grown[:, :, :130], True, block_tokens=64, chunk_bytes=1 << 20)
    _, long = cut(grown, True, block_tokens=64, chunk_bytes=1 << 20)
    assert how == "tokens"
    assert [len(c) for c in short] == [2 * 64 * 8 * 4, 2 * 64 * 8 * 4, 2 * 2 * 8 * 4]
    assert short[:2] == long[:2]  # the first 128 tokens: the same bytes, not uploaded again
    assert short[2] != long[2]


def test_a_block_never_passes_chunk_bytes_and_other_tensors_are_cut_by_bytes():
    tensor = torch.zeros(1, 2, 64, 8)  # 64 bytes a token
    _, pieces = cut(tensor, True, block_tokens=64, chunk_bytes=640)
    assert [len(p) for p in pieces] == [640] * 6 + [256]  # 10 tokens a block, 4 in the last
    how, pieces = cut(torch.zeros(1000, dtype=torch.float64), False, 64, chunk_bytes=3000)
    assert how == "bytes" and [len(p) for p in pieces] == [3000, 3000, 2000]
    assert cut(torch.zeros(0), False, 64, 3000) == ("bytes", [b""])


# ------------------------------------------------------------------ snapshots
def _snapshot(dtype):
    torch.manual_seed(1)
    layout = {
        "ids": [5, 6, 7],
        "layers": [{"kind": "attention"}, {"kind": "recurrent"}, {"kind": "sliding"}],
    }
    tensors = {
        "layer.0.0": torch.randn(1, 2, 3, 4).to(dtype),
        "layer.0.1": torch.randn(1, 2, 3, 4).to(dtype),
        "layer.1.0": torch.randn(1, 6, 5).to(dtype),
        "layer.2.0": torch.randn(1, 2, 3, 4).to(dtype)[:, :, :, :3],  # strided
        "empty": torch.zeros(0, dtype=dtype),
    }
    return layout, tensors


def _encode(layout, tensors, **overrides):
    options = dict(
        session_id="alice",
        model="m",
        fingerprint={"model": "tiny"},
        messages=[{"role": "user", "content": "hi"}],
        block_tokens=2,
        chunk_bytes=64,
    )
    return encode_snapshot(layout, tensors, **{**options, **overrides})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_a_snapshot_comes_back_bit_for_bit(dtype):
    layout, tensors = _snapshot(dtype)
    manifest, chunks = _encode(layout, tensors)
    raw = json.dumps(manifest).encode()
    read, ids = decode_manifest(raw, {"model": "tiny"}, "alice")
    assert ids.tolist() == [5, 6, 7]
    assert read["messages"] == [{"role": "user", "content": "hi"}]
    assert attention_tensors(dict(read["layout"], ids=ids.tolist())) == {"layer.0.0", "layer.0.1"}
    assert read["tensors"]["layer.0.0"]["split"] == "tokens"
    assert read["tensors"]["layer.2.0"]["split"] == "bytes"  # sliding windows are cut by bytes
    for name, tensor in tensors.items():
        back = assemble(read["tensors"][name], chunks)
        assert back.dtype == dtype and back.shape == tensor.shape, name
        assert torch.equal(back.view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def test_a_manifest_not_written_for_this_model_and_session_is_a_miss_saying_why():
    layout, tensors = _snapshot(torch.float32)
    manifest, _ = _encode(layout, tensors)

    def reason(raw, fingerprint=None, session="alice"):
        with pytest.raises(StoreMiss) as caught:
            decode_manifest(raw, fingerprint or {"model": "tiny"}, session)
        return caught.value.reason

    assert reason(b"not json") == "malformed"
    assert reason(b"[1, 2]") == "malformed"
    assert reason(json.dumps({**manifest, "format": "kvchat-store-1"})) == "format"
    assert reason(json.dumps(manifest), fingerprint={"model": "other"}) == "fingerprint"
    assert reason(json.dumps(manifest), session="bob") == "session"
    assert reason(json.dumps({**manifest, "ids": "%%%"})) == "malformed"
    assert manifest["format"] == FORMAT


def test_chunks_that_do_not_make_the_tensor_do_not_assemble():
    layout, tensors = _snapshot(torch.float32)
    manifest, chunks = _encode(layout, tensors)
    entry = manifest["tensors"]["layer.0.0"]
    first = entry["chunks"][0]
    with pytest.raises(ValueError, match="chunk sizes"):
        assemble(entry, {**chunks, first: chunks[first][:-4]})
    with pytest.raises(ValueError, match="blocks make"):
        assemble({**entry, "shape": [1, 2, 4, 4]}, chunks)
    with pytest.raises(StoreMiss, match="unknown dtype"):
        assemble({**entry, "dtype": "float99"}, chunks)


# ------------------------------------------------------------------ keys
def test_keys_separate_models_prefixes_and_sessions_and_take_any_session_id():
    a, b = Keys("kv", "p1"), Keys("kv", "p1")
    a.bind({"model": "one"})
    b.bind({"model": "two"})
    odd = "ns/ü\n{*}:\x00"
    assert a.manifest(odd).startswith("kv:") and "\n" not in a.manifest(odd)
    assert a.manifest("s") != b.manifest("s") != a.manifest("t")
    assert a.held("s") == a.held("s", "p1") != a.held("s", "p2")
    assert a.held("s").startswith(a.held_prefix("s") + ":")
    assert a.route("ns", "c") != a.route("other", "c")


def test_chunks_are_shared_across_namespaces_only_without_isolation():
    keys = Keys("kv", "p")
    keys.bind({"model": "one"})
    assert keys.chunk("d", "alice/s") == keys.chunk("d", "bob/s")
    keys.isolate_namespaces = True
    assert keys.chunk("d", "alice/s") != keys.chunk("d", "bob/s")
    assert keys.chunk("d", "alice/s") == keys.chunk("d", "alice/t")
    assert keys.index("alice/s") != keys.index("bob/s")


def test_a_model_layout_checks_its_invariants():
    """The value every tier and file checks state against refuses to be
    built inconsistent, so nothing downstream trusts a wrong one."""
    from kvchat.bridge import ATTENTION, RECURRENT, LayerTemplate, ModelLayout

    attention = LayerTemplate((ATTENTION,), torch.float32, 2, 8, 8)
    ok = ModelLayout(("DynamicLayer", "DummyLayer"), ((ATTENTION,), ()), (), (attention,))
    assert ok.supported and ok.num_layers == 1 and not ok.needs_checkpoints
    bad = [
        (("DynamicLayer",), (None,), (), (attention,)),  # an unknown layer, supported
        (("DynamicLayer",), ((RECURRENT,),), (), (attention,)),  # template disagrees
        (("DynamicLayer",), ((ATTENTION,),), (3,), (attention, attention)),  # no layer 3
        (("DynamicLayer",), (("attention",),), (), (attention,)),  # not the core's kinds
        (("DynamicLayer",), ((ATTENTION,),), (), ()),  # no template
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            ModelLayout(*fields)
    unsupported = ModelLayout(("Mystery",), (None,), problem="cache layers ['Mystery']")
    assert not unsupported.supported and unsupported.num_layers == 1  # its stateful layers
