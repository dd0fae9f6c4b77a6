"""Packed weights (engine/packed.py): on a CPU the engine's thread runs the
model's linear layers through oneDNN on a packed copy of their weights; every
other thread runs them as before. The copy follows the weight when it
changes, is shared by the managers of one model and goes with the last.

These models are float32 and bfloat16 (float64 is never packed), so their
replies are held to what test_bfloat16.py holds those dtypes to: plain
generate's first token wherever it leads clearly. The real SmolLM2's float32
replies, packed by default, are asserted token for token in test_real_model.py.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import LONG_SYSTEM, MARGIN, MAX_NEW, plain_with_margin, user_message
from kvchat import SessionManager
from kvchat.engine import packed
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _packed_product(x, weight, bias):
    """What oneDNN gives for ``x`` on ``weight`` packed as the engine packs it."""
    reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), packed.ROWS_HINT)
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


def _on_engine(manager, fn):
    return manager._engine.run(fn)


def _telling_input(layer):
    """An input on which oneDNN's product differs from nn.Linear's: on others
    (3x5 rows on this torch) the two agree bit for bit, and a test comparing
    results could not tell which path ran."""
    generator = torch.Generator().manual_seed(0)
    for rows in [(1, 3), (2,), (3, 5), (5, 7)]:
        x = torch.randn(*rows, layer.in_features, generator=generator)
        with torch.no_grad():
            plain = F.linear(x, layer.weight, layer.bias)
            if not torch.equal(_packed_product(x, layer.weight, layer.bias), plain):
                return x
    pytest.fail("oneDNN's product equals nn.Linear's on every input tried")


def test_the_engine_thread_runs_linears_packed_and_the_callers_thread_does_not(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    linears = _linears(model)
    assert manager.stats().packed_weight_bytes == sum(
        m.weight.numel() * m.weight.element_size() for m in linears
    )
    layer = model.model.layers[0].mlp.up_proj
    x = _telling_input(layer)
    on_engine = _on_engine(manager, lambda: layer(x))
    with torch.no_grad():
        here = layer(x)
        assert torch.equal(on_engine, _packed_product(x, layer.weight, layer.bias))
        assert torch.equal(here, F.linear(x, layer.weight, layer.bias))
    # With gradients on, even the engine's thread computes as nn.Linear does.
    with_grad = _on_engine(manager, lambda: torch.enable_grad()(layer)(x))
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), here)
    manager.close()


def test_a_weight_changed_in_place_or_replaced_is_packed_again(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[1].self_attn.o_proj
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    before = _on_engine(manager, lambda: layer(x))
    with torch.no_grad():
        layer.weight.mul_(2)  # what an optimizer step or load_state_dict does
        assert torch.equal(
            _on_engine(manager, lambda: layer(x)), _packed_product(x, layer.weight, None)
        )
        assert not torch.equal(_on_engine(manager, lambda: layer(x)), before)
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
        assert torch.equal(
            _on_engine(manager, lambda: layer(x)), _packed_product(x, layer.weight, None)
        )
        # Another dtype than the one packed: nn.Linear's own product.
        layer.double()
        x64 = x.double()
        assert torch.equal(_on_engine(manager, lambda: layer(x64)), F.linear(x64, layer.weight))
    manager.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_replies_decoded_together_on_packed_weights_keep_plain_generates_clear_tokens(
    dtype, tokenizer
):
    """Three conversations, three turns, decoding in one batch on packed
    weights: every turn's first token, the first turn's included (its
    products are no longer plain generate's), is plain generate's wherever
    that one leads clearly."""
    model = tiny_model("llama", dtype=dtype)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    assert manager.stats().packed_weight_bytes > 0
    sessions = [[LONG_SYSTEM] + [user_message(10 * k + j) for j in range(k)] for k in range(3)]
    checked = 0
    for turn in range(3):
        for messages in sessions:
            messages.append(user_message(turn))
        expected = [plain_with_margin(model, render_prompt(tokenizer, m)) for m in sessions]
        calls = [chat_call(manager, f"s{k}", m, MAX_NEW) for k, m in enumerate(sessions)]
        for k, (report, (ids, margin)) in enumerate(
            zip(together(manager, calls), expected, strict=True)
        ):
            if margin > MARGIN:
                assert report.output_ids[0] == ids[0], (k, turn, margin)
                checked += 1
            # Each goes on from plain generate's reply, so every prompt is the same.
            reply = tokenizer.decode(ids, skip_special_tokens=True)
            sessions[k].append({"role": "assistant", "content": reply})
    assert manager.stats().max_batch_rows == 3
    assert checked >= 4, f"only {checked} turns had a clear first token"
    manager.close()


def _big_mlp_model(tokenizer, dtype):
    """A one-layer Llama whose MLP weights have 2**18 elements, what "auto"
    packs in float32, and whose attention weights have fewer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def test_auto_packs_no_float64_and_no_small_layer_and_false_packs_nothing(tokenizer):
    cases = [
        (tiny_model("llama", dtype=torch.float64), True),  # never float64
        (tiny_model("llama", dtype=torch.float32), "auto"),  # each weight under 2**18
        # Weights "auto" would pack in float32:
        (_big_mlp_model(tokenizer, torch.bfloat16), "auto"),  # auto: float32 only
        (_big_mlp_model(tokenizer, torch.float32), False),
    ]
    for model, setting in cases:
        manager = SessionManager(model, tokenizer, pack_weights=setting)
        manager.chat("s", [user_message(0)], max_new_tokens=2)
        assert manager.stats().packed_weight_bytes == 0, (model.dtype, setting)
        assert not any("forward" in m.__dict__ for m in _linears(model))
        manager.close()


def test_auto_packs_float32_layers_of_two_to_the_eighteen_elements(tokenizer):
    model = _big_mlp_model(tokenizer, torch.float32)
    manager = SessionManager(model, tokenizer)
    big = [m for m in _linears(model) if m.weight.numel() >= packed.AUTO_MIN_ELEMENTS]
    assert big and len(big) < len(_linears(model))
    assert manager.stats().packed_weight_bytes == sum(4 * m.weight.numel() for m in big)
    assert all(isinstance(m.__dict__.get("forward"), packed._PackedForward) for m in big)
    manager.close()


def test_auto_packs_nothing_when_the_copy_would_take_over_half_the_free_memory(
    tokenizer, monkeypatch
):
    model = _big_mlp_model(tokenizer, torch.float32)
    needed = sum(
        4 * m.weight.numel()
        for m in _linears(model)
        if m.weight.numel() >= packed.AUTO_MIN_ELEMENTS
    )
    monkeypatch.setattr(packed, "_available_bytes", lambda: 2 * needed)
    fits = SessionManager(model, tokenizer)
    assert fits.stats().packed_weight_bytes == needed
    fits.close()
    monkeypatch.setattr(packed, "_available_bytes", lambda: 2 * needed - 1)
    short = SessionManager(model, tokenizer)
    assert short.stats().packed_weight_bytes == 0
    assert f"needs {needed} bytes" in short._engine._packed.why_not
    assert not any("forward" in m.__dict__ for m in _linears(model))
    short.close()
    asked = SessionManager(model, tokenizer, pack_weights=True)  # True: asked, so packed
    assert asked.stats().packed_weight_bytes == sum(4 * m.weight.numel() for m in _linears(model))
    asked.close()


def test_managers_of_one_model_share_the_copy_and_the_last_one_removes_it(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    first = SessionManager(model, tokenizer, pack_weights=True)
    second = SessionManager(model, tokenizer, pack_weights=True)
    forwards = [m.__dict__["forward"] for m in _linears(model)]
    assert all(f.users == 2 for f in forwards)
    first.close()
    assert [m.__dict__.get("forward") for m in _linears(model)] == forwards
    second.chat("s", [user_message(1)], max_new_tokens=3)
    second.close()
    assert not any("forward" in m.__dict__ for m in _linears(model))
    assert second.stats().packed_weight_bytes == 0


def test_someone_elses_forward_and_a_compiled_manager_are_left_alone(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    theirs = model.lm_head
    theirs.forward = lambda x: F.linear(x, theirs.weight)  # accelerate's hooks do this
    manager = SessionManager(model, tokenizer, pack_weights=True)
    assert not isinstance(theirs.__dict__["forward"], packed._PackedForward)
    others = [m for m in _linears(model) if m is not theirs]
    assert all(isinstance(m.__dict__.get("forward"), packed._PackedForward) for m in others)
    manager.close()
    compiled = SessionManager(model, tokenizer, compile=True, pack_weights=True)
    assert compiled.stats().packed_weight_bytes == 0
    assert "compiled" in compiled._engine._packed.why_not
    compiled.close()


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_pack_weights_takes_auto_true_or_false(tokenizer, value):
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"pack_weights.*{value!r}"):
        SessionManager(model, tokenizer, pack_weights=value)


def test_a_weight_changed_through_data_is_packed_again_before_the_next_turn(tokenizer):
    """``weight.data.mul_(...)`` (peft's merge, an EMA copy) changes the bits
    without the version counter: the engine still computes on the new ones,
    in a layer it runs and in a whole reply."""
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(2))
    before = _on_engine(manager, lambda: layer(x))
    version = layer.weight._version
    layer.weight.data.mul_(2)
    layer.weight.data[3, 5] += 1  # one more element, alone
    assert layer.weight._version == version  # what the fast check cannot see
    after = _on_engine(manager, lambda: layer(x))
    assert not torch.equal(after, before)
    assert torch.equal(after, _packed_product(x, layer.weight, None))
    # A whole reply: a head of zeros scores every token alike, so greedy takes id 0.
    manager.chat("s", [user_message(0)], max_new_tokens=3)
    model.lm_head.weight.data.zero_()
    manager.chat(
        "s",
        [user_message(0), {"role": "assistant", "content": "x"}, user_message(1)],
        max_new_tokens=3,
    )
    assert set(manager.last_turn("s").output_ids) == {0}
    manager.close()


def test_model_weights_made_under_inference_mode_are_packed_and_followed(tokenizer):
    with torch.inference_mode():
        model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    assert manager.stats().packed_weight_bytes > 0
    manager.chat("s", [user_message(0)], max_new_tokens=2)
    layer = model.model.layers[1].mlp.up_proj
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():  # the only place an inference tensor changes
        layer.weight.add_(1)
    assert torch.equal(
        _on_engine(manager, lambda: layer(x)), _packed_product(x, layer.weight, None)
    )
    manager.close()


def test_a_packed_module_is_still_called_with_input_by_name(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(layer(input=x), F.linear(x, layer.weight))
    assert torch.equal(
        _on_engine(manager, lambda: layer(input=x)), _packed_product(x, layer.weight, None)
    )
    manager.close()


def test_under_autocast_the_engine_computes_in_autocasts_dtype(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(5))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    on_engine = _on_engine(manager, lambda: autocast(layer)(x))
    with torch.no_grad():
        here = autocast(layer)(x)
    assert here.dtype == torch.bfloat16
    assert on_engine.dtype == torch.bfloat16 and torch.equal(on_engine, here)
    manager.close()


def test_two_managers_never_use_an_old_copy_while_the_other_packs_again(tokenizer, monkeypatch):
    """Two engines share one layer's copy; while the first packs a changed
    weight again, the second runs the layer: on the new weight, not on the
    old copy beside the new weight's marks."""
    model = tiny_model("llama", dtype=torch.float32)
    first = SessionManager(model, tokenizer, pack_weights=True)
    second = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(6))
    _on_engine(first, lambda: layer(x))
    _on_engine(second, lambda: layer(x))
    reorder = torch.ops.mkldnn._reorder_linear_weight
    seen, started = [], []

    def reorder_while_the_other_runs(weight, rows):
        if threading.current_thread() is first._engine._loop.thread and not started:
            started.append(True)
            seen.append(_on_engine(second, lambda: layer(x)))
        return reorder(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder_while_the_other_runs)
    with torch.no_grad():
        layer.weight.mul_(3)
    first._engine.run(lambda: layer(x))
    monkeypatch.undo()
    assert seen and torch.equal(seen[0], _packed_product(x, layer.weight, None))
    first.close()
    second.close()


def test_a_model_in_use_can_be_deep_copied_and_pickled_as_a_plain_model(tokenizer):
    """copy.deepcopy (an EMA or swa_utils copy) and pickle (torch.save) of a
    model a manager packs: they work, the copy's layers compute as the
    original's, the pickle names nothing of kvchat, and a manager on the copy
    packs it and leaves it plain when closed."""
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    copied = copy.deepcopy(model)
    payload = pickle.dumps(model)
    assert b"kvchat" not in payload
    loaded = pickle.loads(payload)
    saved = io.BytesIO()
    torch.save(model, saved)  # pickle's protocol 2
    saved.seek(0)
    assert isinstance(torch.load(saved, weights_only=False), type(model))
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for other in (copied, loaded):
            layer = other.model.layers[0].mlp.up_proj
            assert torch.equal(layer(x), model.model.layers[0].mlp.up_proj(x))
    manager.close()
    on_copy = SessionManager(copied, tokenizer, pack_weights=True)
    assert on_copy.stats().packed_weight_bytes == manager_bytes(model)
    on_copy.chat("s", [user_message(0)], max_new_tokens=2)
    on_copy.close()
    assert not any("forward" in m.__dict__ for m in _linears(copied))


def manager_bytes(model):
    return sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))


def test_a_peft_adapter_merged_between_turns_reaches_the_engine(tokenizer):
    """peft's merge_adapter adds the LoRA product to the base layer's weight
    through ``.data`` (no version counter): the engine's next turn computes
    the merged layer on the merged weight, as the user's own call does."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model("llama", dtype=torch.float32),
        peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False),
    )
    manager = SessionManager(model, tokenizer, pack_weights=True)
    manager.chat("s", [user_message(0)], max_new_tokens=2)
    wrapper = model.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(wrapper.base_layer.__dict__.get("forward"), packed._PackedForward)
    x = torch.randn(2, wrapper.in_features, generator=torch.Generator().manual_seed(8))
    model.merge_adapter()
    with torch.no_grad():
        merged = F.linear(x, wrapper.base_layer.weight)
        assert torch.allclose(wrapper(x), merged)  # the user's call: adapters merged
    on_engine = _on_engine(manager, lambda: wrapper(x))
    assert torch.equal(on_engine, _packed_product(x, wrapper.base_layer.weight, None))
    assert torch.allclose(on_engine, merged, atol=1e-5)
    manager.close()


def test_a_weight_that_cannot_be_packed_again_runs_unpacked_not_stale(tokenizer, monkeypatch):
    """The copy of a changed weight cannot be made (no memory): the engine
    goes on with nn.Linear's product on the new weight, and the turn's
    caller gets its answer."""
    model = tiny_model("llama", dtype=torch.float32)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(9))
    _on_engine(manager, lambda: layer(x))

    def no_memory(weight, rows):
        raise MemoryError("no room for another copy")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_memory)
    layer.weight.data.mul_(2)
    with torch.no_grad():
        assert torch.equal(_on_engine(manager, lambda: layer(x)), F.linear(x, layer.weight))
    monkeypatch.undo()
    manager.close()


def test_onednn_turned_off_in_torch_is_not_used(tokenizer):
    """torch.backends.mkldnn's flag off (a user avoiding oneDNN): no copy is
    packed, and a manager built before the flag went off runs nn.Linear's
    product while it is off."""
    model = tiny_model("llama", dtype=torch.float32)
    with torch.backends.mkldnn.flags(enabled=False):
        manager = SessionManager(model, tokenizer, pack_weights=True)
    assert manager.stats().packed_weight_bytes == 0
    assert "torch.backends.mkldnn" in manager._engine._packed.why_not
    manager.close()
    manager = SessionManager(model, tokenizer, pack_weights=True)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(10))
    with torch.backends.mkldnn.flags(enabled=False), torch.no_grad():
        assert torch.equal(_on_engine(manager, lambda: layer(x)), F.linear(x, layer.weight))
    manager.close()


def test_bfloat16_is_not_packed_on_a_cpu_whose_onednn_has_no_bfloat16(tokenizer, monkeypatch):
    """pack_weights=True on a CPU without oneDNN's bfloat16 (no avx512bw/vl/dq):
    the manager is built and answers, with the bfloat16 layers unpacked,
    instead of raising oneDNN's error from the constructor."""
    model = tiny_model("llama", dtype=torch.bfloat16)  # first: its imports read the real ops
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def reorder_as_that_cpu(weight, rows):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("bf16 path needs the cpu support avx512bw, avx512vl and avx512dq")
        return reorder(weight, rows)

    # What torch.ops.mkldnn._is_mkldnn_bf16_supported() says there.
    monkeypatch.setattr(packed, "_bfloat16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder_as_that_cpu)
    manager = SessionManager(model, tokenizer, pack_weights=True)
    assert manager.stats().packed_weight_bytes == 0
    manager.chat("s", [user_message(0)], max_new_tokens=2)
    manager.close()


def test_a_manager_that_cannot_pack_every_layer_leaves_none_packed(tokenizer, monkeypatch):
    """The third copy cannot be made (no memory): SessionManager raises it,
    and the two layers packed before it are left plain, not packed for good
    with no manager to remove them."""
    model = tiny_model("llama", dtype=torch.float32)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    made = []

    def third_fails(weight, rows):
        if len(made) == 2:
            raise MemoryError("no room for another copy")
        made.append(weight)
        return reorder(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", third_fails)
    with pytest.raises(MemoryError):
        SessionManager(model, tokenizer, pack_weights=True)
    assert len(made) == 2
    assert not any("forward" in m.__dict__ for m in _linears(model))


def test_managers_built_at_once_on_threads_share_one_copy(tokenizer, monkeypatch):
    """Two managers of one model built on two threads at once: each layer is
    packed once and both use that copy (before, each packed its own and the
    later one replaced the earlier's on the module, two copies held)."""
    import time

    model = tiny_model("llama", dtype=torch.float32)
    pack = packed._PackedForward._pack

    def slow_pack(self, weight):  # widens the window between looking and installing
        time.sleep(0.002)
        pack(self, weight)

    monkeypatch.setattr(packed._PackedForward, "_pack", slow_pack)
    managers = [None, None]

    def build(k):
        managers[k] = SessionManager(model, tokenizer, pack_weights=True)

    threads = [threading.Thread(target=build, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = (m._engine._packed.forwards for m in managers)
    installed = [m.__dict__["forward"] for m in _linears(model)]
    assert [id(f) for f in first] == [id(f) for f in second] == [id(f) for f in installed]
    assert all(f.users == 2 for f in installed)
    for manager in managers:
        manager.close()
    assert not any("forward" in m.__dict__ for m in _linears(model))
