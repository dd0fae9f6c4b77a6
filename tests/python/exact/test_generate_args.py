"""Generate arguments kvchat cannot serve from a cache run as plain generate,
and bad ones are refused before the session is touched.

Each test compares with plain ``model.generate`` given the same arguments."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICE,
    MAX_NEW,
    SYSTEM,
    exact_turn,
    exact_turns,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model


def turns_match_plain(mgr, model, tokenizer, turns=3, **kwargs):
    """Several turns with ``kwargs``; each equals plain generate with them."""
    return exact_turns(mgr, "s", [SYSTEM], model, tokenizer, turns, **kwargs)[1][-1]


def test_prompt_lookup_decoding_is_exact(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    report = turns_match_plain(mgr, llama, tokenizer, prompt_lookup_num_tokens=3)
    assert report.reason == "unsupported_generation" and report.reused_tokens == 0


def test_assistant_model_decoding_is_exact(llama, tokenizer):
    draft = model_for("llama", seed=1)
    mgr = SessionManager(llama, tokenizer)
    report = turns_match_plain(mgr, llama, tokenizer, assistant_model=draft)
    assert report.reason == "unsupported_generation"


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_use_cache_false_is_honoured(family, tokenizer):
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    report = turns_match_plain(mgr, model, tokenizer, turns=2, use_cache=False)
    assert report.reason == "unsupported_generation"
    assert mgr.stats().plain_turn_reasons == {"generate_args": 2}


def test_reuse_resumes_after_a_plain_turn(llama, tokenizer):
    # A plain turn leaves the session's cache as it was; the next normal turn reuses it.
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    messages.append(
        {"role": "assistant", "content": mgr.chat("s", messages, max_new_tokens=MAX_NEW)}
    )
    # Settling runs after the reply, in the background: counted once it is done,
    # or the plain turn would seem to change what it finished meanwhile.
    assert mgr.wait_settled(timeout=120)
    cached = mgr.info("s").cached_tokens
    messages.append(user_message(1))
    mgr.chat("s", messages, max_new_tokens=MAX_NEW, use_cache=False)
    assert mgr.info("s").cached_tokens == cached
    _, _, expected = reference_turn(llama, tokenizer, messages)
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").output_ids == expected


@pytest.mark.parametrize("implementation", ["static", "dynamic"])
def test_cache_implementation_is_served(implementation, llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    report = turns_match_plain(mgr, llama, tokenizer, cache_implementation=implementation)
    # kvchat's own cache is dynamic: asking for it changes nothing. Anything else
    # is the caller's own cache, so the turn runs as plain generate.
    if implementation == "dynamic":
        assert report.reason != "unsupported_generation" and report.reused_tokens > 0
    else:
        assert report.reason == "unsupported_generation"


@pytest.mark.parametrize("output", ["output_hidden_states", "output_attentions"])
def test_prompt_hidden_states_and_attentions_cover_the_whole_prompt(output, llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)  # something to reuse, were it allowed
    messages += [{"role": "assistant", "content": "Fine."}, user_message(1)]
    prompt = render_prompt(tokenizer, messages).unsqueeze(0).to(llama.device)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **{output: True})
    got = mgr.generate(prompt, session_id="s", **kwargs)
    want = llama.generate(prompt, **kwargs)
    field = "hidden_states" if output == "output_hidden_states" else "attentions"
    # The first step's entries cover every prompt token, as plain generate's do.
    for ours, theirs in zip(getattr(got, field)[0], getattr(want, field)[0], strict=True):
        assert ours.shape == theirs.shape
        assert ours.shape[-2] == prompt.shape[1]
        torch.testing.assert_close(ours, theirs)
    assert mgr.last_turn("s").reason == "unsupported_generation"


def test_misspelled_argument_leaves_every_session_as_it_was(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    messages = [SYSTEM, user_message(0)]
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.wait_settled(timeout=60)  # settling would grow the cache after `before`
    before = (mgr.info("s"), mgr.messages("s"), mgr.last_turn("s"))
    messages += [{"role": "assistant", "content": "Fine."}, user_message(1)]
    with pytest.raises(ValueError, match="temprature"):
        mgr.chat("s", messages, temprature=0.5)
    with pytest.raises(ValueError, match="temprature"):
        mgr.chat("new", messages, temprature=0.5)
    prompt = render_prompt(tokenizer, messages).unsqueeze(0)
    with pytest.raises(ValueError, match="temprature"):
        mgr.generate(prompt, session_id="s", temprature=0.5)
    with pytest.raises(ValueError, match="temprature"):
        mgr.stream_chat("s", messages, temprature=0.5)
    assert (mgr.info("s"), mgr.messages("s"), mgr.last_turn("s")) == before
    assert mgr.sessions() == ["s"]


def test_a_turn_that_fails_in_generate_leaves_no_half_state(tokenizer):
    # Hybrid, so checkpoints and recurrent state are in play too.
    model = model_for("lfm2")
    mgr = SessionManager(model, tokenizer)
    messages = [SYSTEM, user_message(0)]
    messages.append(
        {"role": "assistant", "content": mgr.chat("s", messages, max_new_tokens=MAX_NEW)}
    )
    history = mgr.messages("s")
    messages.append(user_message(1))

    class Boom(RuntimeError):
        pass

    def explode(input_ids, scores):
        raise Boom("the model failed mid-turn")

    with pytest.raises(Boom):
        mgr.chat("s", messages, logits_processor=[explode])
    # The history is as it was; the cache is dropped whole, checkpoints included,
    # so the budget counts nothing the session no longer uses.
    info = mgr.info("s")
    assert mgr.messages("s") == history
    assert (info.cached_tokens, info.nbytes, info.checkpoints, info.resident) == (0, 0, 0, False)
    assert mgr.stats().resident_bytes == 0
    _, _, expected = reference_turn(model, tokenizer, messages)
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").output_ids == expected


def test_a_model_kvchat_cannot_carry_runs_as_plain_generate_without_a_cache(tokenizer, monkeypatch):
    # Mamba2's generate refuses a past_key_values argument: the fallback must
    # pass no cache at all (it used to crash). Its layers are hidden from the
    # bridge here, as kvchat carries them now.
    from kvchat.bridge import probe
    from transformers import Mamba2Config, Mamba2ForCausalLM

    parts = {k: v for k, v in probe.PARTS.items() if k.__name__ != "LinearAttentionLayer"}
    monkeypatch.setattr(probe, "PARTS", parts)
    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        state_size=16,
        expand=2,
        head_dim=16,
        num_heads=8,
        n_groups=1,
        conv_kernel=4,
    )
    model = Mamba2ForCausalLM(config).to(torch.float64).eval()
    mgr = SessionManager(model, tokenizer)
    report = turns_match_plain(mgr, model, tokenizer, turns=2)
    assert report.reason == "unsupported_layers" and report.reused_tokens == 0


@pytest.mark.parametrize("prompt_tokens", [10, 30, 250])
@pytest.mark.parametrize("compiled", [False, True])
def test_no_max_new_tokens_generates_what_generate_does(prompt_tokens, compiled, tokenizer):
    """Without max_new_tokens or max_length, generate makes 20 new tokens past
    any prompt (its default max_length, counted from the prompt); kvchat must
    plan the same, or a prompt past 20 tokens was refused (it planned 0) and a
    compiled turn's cache had no room for them (250 + 20 crosses 256)."""
    from transformers import CompileConfig

    model = model_for("llama")
    compile_setting = CompileConfig(backend="eager", mode=None) if compiled else False
    mgr = SessionManager(model, tokenizer, compile=compile_setting)
    ids = torch.arange(3, 3 + prompt_tokens, device=model.device)[None] % 500 + 3
    expected = model.generate(ids, do_sample=False)
    for session in ("s", "s"):  # a fresh turn, then one from the cache
        out = mgr.generate(ids, session, do_sample=False)
        assert torch.equal(out, expected)
    assert expected.shape[1] == prompt_tokens + 20
    assert mgr.stats().compiled_turns == (2 if compiled else 0)


@pytest.mark.parametrize("family", ["llama", "lfm2"])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_turns_under_autocast_run_as_plain_generate(family, half, tokenizer, caplog):
    # Autocast casts float32 work only, so the model is float32 here (float64
    # would run untouched). Under it the rotary keys come out float32 and the
    # values in half precision: a cache cannot hold them, so the turn runs plain.
    model = tiny_model(family, dtype=torch.float32, seed=0).to(DEVICE)
    mgr = SessionManager(model, tokenizer)
    messages = [SYSTEM, user_message(0)]
    with torch.autocast(DEVICE.type, dtype=half), caplog.at_level("INFO", logger="kvchat"):
        reply, report = exact_turn(mgr, "s", messages, model, tokenizer, MAX_NEW)
        assert report.reason == "unsupported_generation" and report.reused_tokens == 0
        messages += [{"role": "assistant", "content": reply}, user_message(1)]
        _, report = exact_turn(mgr, "s", messages, model, tokenizer, MAX_NEW)
        assert report.reason == "unsupported_generation"
    # Each such turn is logged with its reason, and counted by it.
    logged = [r for r in caplog.records if "plain generate (torch.autocast is on)" in r.message]
    assert len(logged) == 2 and all(r.levelname == "INFO" for r in logged)
    stats = mgr.stats()
    assert stats.plain_turns == 2 and stats.plain_turn_reasons == {"autocast": 2}
    # Out of autocast, the session's turns reuse again, and are not counted.
    _, reports = exact_turns(mgr, "s", messages[:1], model, tokenizer, 2)
    assert reports[-1].reason != "unsupported_generation" and reports[-1].reused_tokens > 0
    assert mgr.stats().plain_turn_reasons == {"autocast": 2}


def test_a_streamed_turn_under_autocast_runs_under_it_as_plain_generate(tokenizer):
    # stream_chat runs the model on a worker thread, and autocast is per
    # thread: the caller's is carried there, so the stream gives what chat
    # and plain generate under that autocast give.
    model = tiny_model("llama", dtype=torch.float32, seed=0).to(DEVICE)
    mgr = SessionManager(model, tokenizer)
    messages = [SYSTEM, user_message(0)]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        expected = reference_turn(model, tokenizer, messages)[2]
        "".join(mgr.stream_chat("s", messages, max_new_tokens=MAX_NEW))
    report = mgr.last_turn("s")
    assert report.reason == "unsupported_generation" and report.output_ids == expected
    assert mgr.stats().plain_turn_reasons == {"autocast": 1}


@pytest.fixture
def fresh_dynamo():
    # Dynamo counts compiles per code object, which transformers' wrappers
    # share across models: start from none, as a user's process would, and
    # leave none to the next test.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_a_forward_compiled_with_fullgraph_runs_as_plain_generate(
    family, tokenizer, caplog, fresh_dynamo
):
    # torch.compile(fullgraph=True) cannot trace kvchat's cache (its buffers
    # are a C++ extension's), and failed the turn. Plain generate runs such a
    # forward, so the turn runs as that, and so does every later one. The
    # "eager" backend: dynamo traces (and refuses) the same, without inductor.
    model = tiny_model(family, seed=0).to(DEVICE)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    mgr = SessionManager(model, tokenizer)
    messages = [SYSTEM, user_message(0)]
    with caplog.at_level("WARNING", logger="kvchat"):
        reply, report = exact_turn(mgr, "s", messages, model, tokenizer, MAX_NEW)
    assert report.reason == "unsupported_generation" and report.reused_tokens == 0
    assert sum("cannot run on kvchat's cache" in r.message for r in caplog.records) == 1
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    _, report = exact_turn(mgr, "s", messages, model, tokenizer, MAX_NEW)
    assert report.reason == "unsupported_generation"
    assert mgr.stats().plain_turn_reasons == {"forward_refuses_cache": 2}
    # Streamed, from a worker thread, on a new manager (its first turn
    # refused): the stream is the reply, never the prompt that the refused
    # attempt handed generate's streamer first.
    streamed = SessionManager(model, tokenizer)
    text = "".join(streamed.stream_chat("t", messages[:2], max_new_tokens=MAX_NEW))
    report = streamed.last_turn("t")
    expected = reference_turn(model, tokenizer, messages[:2])[2]
    assert report.reason == "unsupported_generation" and report.output_ids == expected
    assert text == reply


def test_a_forward_compiled_without_fullgraph_reuses_and_is_exact(tokenizer, fresh_dynamo):
    # Without fullgraph, dynamo runs the cache's C++ calls eagerly (graph
    # breaks): turns reuse the cache, and are generate's.
    model = tiny_model("llama", seed=0).to(DEVICE)
    model.forward = torch.compile(model.forward, backend="eager")
    mgr = SessionManager(model, tokenizer)
    _, reports = exact_turns(mgr, "s", [SYSTEM], model, tokenizer, 2)
    assert reports[-1].reason != "unsupported_generation" and reports[-1].reused_tokens > 0


@pytest.mark.parametrize("kind", ["TorchRuntimeError", "Unsupported"])
def test_a_forward_that_fails_plain_generate_too_is_raised_and_not_remembered(kind, tokenizer):
    # A model's own error found while tracing (TorchRuntimeError: a shape
    # mismatch, say) is raised as it is; a refusal that plain generate meets
    # too is raised after that run. Neither turns the manager plain: once the
    # forward works, turns reuse again.
    model = tiny_model("llama", seed=0).to(DEVICE)
    error = getattr(torch._dynamo.exc, kind)
    original = model.forward

    def failing(*args, **kwargs):
        raise error("found while tracing")

    mgr = SessionManager(model, tokenizer)
    model.forward = failing
    with pytest.raises(error, match="found while tracing"):
        mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
    model.forward = original
    _, reports = exact_turns(mgr, "s", [SYSTEM], model, tokenizer, 2)
    assert reports[-1].reason != "unsupported_generation" and reports[-1].reused_tokens > 0
