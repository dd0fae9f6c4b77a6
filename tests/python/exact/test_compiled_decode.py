"""Compiled decode (docs/compiled-decode.md): a turn of a manager that
compiles decodes in the engine's batch, whose step is compiled once for
every shape; a turn with its own ``compile_config`` decodes alone in a
pooled StaticCache that generate compiles. Both give plain generate's
tokens and compile once, not once a turn. (Several conversations decoding
compiled together: test_compiled_batch.py.)

The exactness tests compile with inductor, as users run it, in float64 on the
CPU (``compile=True``), one family per layer kind: attention, sliding window
(past its window), conv, DeltaNet, and Mamba beside attention in one layer.
The recompile tests count the graphs torch.compile builds with a backend that
only counts, so they need no compiler.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    DEVICE,
    LONG_SYSTEM,
    SYSTEM,
    model_for,
    reference_ids,
    reference_turn,
    user_message,
)
from kvchat import SessionManager
from kvchat.bridge.static_cache import bucket
from kvchat.compiled import CompiledDecode, compile_everywhere
from kvchat.tiny import tiny_model
from transformers import CompileConfig, StaticCache

MAX_NEW = 12
TURNS = 4
# Attention, sliding window (4 layers of 16 tokens; turns run past it), conv
# (LFM2), DeltaNet (Qwen3.5), Mamba2 beside attention in every layer (FalconH1).
EXACT_FAMILIES = ["llama", "gemma3", "lfm2", "qwen3_5", "falcon_h1"]


def _compiled_reference(model, tokenizer, messages, capacity):
    """Plain generate on the whole conversation, in a compiled StaticCache of
    the capacity kvchat's turn used (so both run the same compiled graph)."""
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    return reference_turn(
        model,
        tokenizer,
        messages,
        MAX_NEW,
        past_key_values=cache,
        compile_config=compile_everywhere(),
    )


def _conversation(manager, model, tokenizer, check, session="s", turns=TURNS, system=SYSTEM):
    """Turns with the raw replies fed back; ``check(turn, messages, reply)`` after each."""
    messages = [system]
    for turn in range(turns):
        messages.append(user_message(turn))
        reply = manager.chat(session, messages, max_new_tokens=MAX_NEW)
        check(turn, messages, reply)
        messages.append({"role": "assistant", "content": reply})
    return messages


@pytest.mark.slow
@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_compiled_turns_match_compiled_static_cache(family, tokenizer):
    torch._dynamo.reset()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=True)

    def check(turn, messages, reply):
        report = manager.last_turn("s")
        prompt_tokens = report.prompt_tokens
        capacity = bucket(prompt_tokens + MAX_NEW)
        static_reply, _, _ = _compiled_reference(model, tokenizer, messages, capacity)
        plain_reply, _, _ = reference_turn(model, tokenizer, messages, MAX_NEW)
        assert reply == static_reply == plain_reply, (family, turn)
        if turn:
            assert report.reused_tokens > 0, (family, turn, report)

    _conversation(manager, model, tokenizer, check)
    stats = manager.stats()
    assert stats.compiled_turns == TURNS
    assert stats.static_caches_built == 0  # each decoded in the engine's compiled batch
    assert stats.compiles >= 1


@pytest.mark.slow
def test_lfm2_checkpoints_read_off_a_compiled_turns_prefill(tokenizer, caplog):
    """A long system prompt puts a checkpoint inside LFM2's first prompt,
    read off the prefill of a turn whose decode compiles (in the engine's
    static batch): every turn exact, an edit of the first user message
    restores that checkpoint, and no warning says the windows could not be
    read."""
    torch._dynamo.reset()
    model = model_for("lfm2")
    manager = SessionManager(model, tokenizer, compile=True, settle=False)

    def check(turn, messages, reply):
        report = manager.last_turn("s")
        capacity = bucket(report.prompt_tokens + MAX_NEW)
        static_reply, _, _ = _compiled_reference(model, tokenizer, messages, capacity)
        assert reply == static_reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
        return report

    with caplog.at_level("WARNING", logger="kvchat"):
        messages = _conversation(manager, model, tokenizer, check, turns=2, system=LONG_SYSTEM)
        messages[1] = user_message(7)  # diverges right after the system prompt
        check(2, messages, manager.chat("s", messages, max_new_tokens=MAX_NEW))
    report = manager.last_turn("s")
    assert report.checkpoint_restored == report.reused_tokens > 0, report
    assert "checkpoints will stop" not in caplog.text
    assert manager.stats().compiled_turns == 3


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and counts them: one
    call per graph dynamo captures, so a recompile is one more call.
    (torch.compile wants a function, not a callable object.)"""

    def __init__(self):
        self.graphs = 0

    def config(self) -> CompileConfig:
        def backend(graph_module, example_inputs):
            self.graphs += 1
            return graph_module.forward

        return CompileConfig(backend=backend, mode=None)


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2"])
def test_next_turns_and_sessions_never_recompile(family, tokenizer, caplog):
    """The batch step compiles for the first turn's shape (one row, 256
    columns), its columns a dynamic size from that compile on: the
    conversation outgrows those columns and no later turn compiles (dynamo
    compiled once more there before the batch marked its columns dynamic),
    no other session compiles anything, and no shape compiles twice."""
    torch._dynamo.reset()
    backend = CountingBackend()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=backend.config())
    columns, compiled = [], []
    original = manager._compiled.batch_forward

    def batch_forward(model_, kwargs, shape):
        columns.append(shape[1])
        return original(model_, kwargs, shape)

    manager._compiled.batch_forward = batch_forward
    with caplog.at_level("INFO", logger="kvchat"):
        _conversation(manager, model, tokenizer, lambda *_: compiled.append(backend.graphs))
    first = compiled[0]
    assert first >= 1, "the first turn's decode did not compile"
    assert "compiled the decode for 1 rows x 256 columns" in caplog.text
    assert len(set(columns)) >= 2, sorted(set(columns))  # it outgrew its first columns
    assert compiled == [first] * TURNS, compiled
    # Another session, in shapes already run.
    manager.chat("other", [SYSTEM, user_message(5)], max_new_tokens=MAX_NEW)
    assert backend.graphs == compiled[-1]
    assert "compiled the decode again" not in caplog.text
    stats = manager.stats()
    assert stats.compiled_turns == TURNS + 1 and stats.static_caches_built == 0
    # stats() counts what the backend was given: each graph dynamo compiled.
    assert stats.compiles == backend.graphs and stats.compile_ms > 0


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_turns_in_a_used_bucket_compile_nothing(family, tokenizer, caplog):
    """With inductor, as users compile: the first turn compiles the decode
    (stats() counts it, and a log line says so); the next turns, in the
    same bucket, compile nothing."""
    torch._dynamo.reset()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=True)
    counts = []

    def check(turn, messages, reply):
        stats = manager.stats()
        counts.append((stats.compiles, stats.recompiles, stats.compile_ms))
        # The batch's columns: what it holds and 128 more, in 256s.
        assert manager.last_turn("s").prompt_tokens + MAX_NEW <= 128  # one shape

    with caplog.at_level("INFO", logger="kvchat"):
        _conversation(manager, model, tokenizer, check, turns=2)
    compiles, recompiles, compile_ms = counts[0]
    assert compiles >= 1 and recompiles == 0 and compile_ms > 0, counts
    assert counts == [counts[0]] * 2, counts
    assert "compiled the decode for 1 rows x 256 columns" in caplog.text
    assert "compiled the decode again" not in caplog.text


def _exact_generate_turns(manager, model, session, steps):
    """Turns through ``manager.generate`` on one growing sequence, each
    token-identical to plain generate; ``steps``: (new ids, max_new_tokens).
    The compiles each turn added."""
    sequence = torch.empty(0, dtype=torch.long)
    added = []
    for new, max_new in steps:
        sequence = torch.cat([sequence, new])
        before = manager.stats().compiles
        out = manager.generate(
            sequence[None].to(DEVICE), session, max_new_tokens=max_new, do_sample=False
        )[0].cpu()
        added.append(manager.stats().compiles - before)
        assert tuple(out[sequence.numel() :].tolist()) == reference_ids(model, sequence, max_new)
        sequence = out
    return added


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2"])
def test_warm_up_compiles_what_the_next_turns_use(family, tokenizer):
    """warm_up for two buckets, then turns in them: none compiles, and each
    is exact. Gemma 3's first turn stays inside its 16-token window and the
    next crosses it; the last decodes in the second bucket."""
    torch._dynamo.reset()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=True, max_batch_size=4)
    assert manager.warm_up([200, 400]) == [256, 512]
    warmed = manager.stats()
    assert warmed.compiles >= 2 and warmed.compile_ms > 0 and warmed.compiled_turns == 0
    steps = [
        (torch.arange(5, 13), 4),  # 12 positions: within the window
        (torch.arange(20, 40), 12),  # past it
        (torch.arange(40, 50), 230),  # capacity 512
    ]
    assert _exact_generate_turns(manager, model, "s", steps) == [0, 0, 0]
    stats = manager.stats()
    assert stats.compiles == warmed.compiles and stats.compiled_turns == 3
    assert stats.static_caches_built == 0  # decoded in the batch


def test_warm_up_checks_its_arguments(tokenizer):
    eager = SessionManager(model_for("llama"), tokenizer)
    with pytest.raises(ValueError, match="compile=False"):
        eager.warm_up(256)
    compiled = CompiledDecode(True, None)
    for bad, error, match in (
        ("256", TypeError, "lengths must be an int or a list of ints, got '256'"),
        (None, TypeError, "lengths must be an int or a list of ints, got None"),
        ([], ValueError, "lengths is empty"),
        ([256, 0], ValueError, "lengths must be positive ints, got 0"),
        ([True], ValueError, "lengths must be positive ints, got True"),
        ([2.5], ValueError, "lengths must be positive ints, got 2.5"),
        ([5000], ValueError, "5000 positions exceed max_context_length=4096"),
    ):
        with pytest.raises(error, match=re.escape(match)):
            compiled.check_warm_up(bad, 4096)
    with pytest.raises(ValueError, match="max_context_length=4 is too short"):
        compiled.check_warm_up(2, 4)
    assert compiled.check_warm_up([1000, 300, 1000, 4000], 4096) == [512, 1024, 4096]
    assert compiled.check_warm_up(300, None) == [512]
    # A model whose decode cannot compile: nothing to warm up, no error.
    assert CompiledDecode(True, "indexer keys").warm_up(None, None, None, [256]) == []


def test_default_decodes_eagerly_on_every_device(tokenizer):
    """compile=False (the default): a turn's own compile_config does not turn
    compiling on, on the CPU or a GPU (KVCHAT_TEST_DEVICE=cuda)."""
    model = model_for("llama")
    torch._dynamo.reset()
    backend = CountingBackend()
    manager = SessionManager(model, tokenizer)
    config = backend.config()
    manager.chat("s", [SYSTEM, user_message(0)], max_new_tokens=4, compile_config=config)
    assert manager.stats().compiled_turns == 0 and backend.graphs == 0


def test_a_second_capacity_compiles_once_and_no_later_one_does(tokenizer):
    """Turns that bring their own compile_config decode alone in a pooled
    StaticCache: a conversation that outgrows its bucket compiles once more
    for the second capacity (a dynamic size), the third not at all."""
    torch._dynamo.reset()
    backend = CountingBackend()
    model = model_for("llama")
    config = backend.config()
    manager = SessionManager(model, tokenizer, compile=config)
    messages = [SYSTEM, user_message(0)]
    graphs = []
    for max_new in (12, 300, 560):  # capacities 256, 512 and 768 for this prompt
        manager.chat(
            "s", messages, max_new_tokens=max_new, eos_token_id=None, compile_config=config
        )
        graphs.append(backend.graphs)
        assert manager.last_turn("s").generated_tokens == max_new
    assert manager.stats().static_caches_built == 3
    assert graphs[0] >= 1 and graphs[1] == 2 * graphs[0] and graphs[2] == graphs[1], graphs
    # The second capacity's graphs recompile the first's functions.
    assert manager.stats().compiles == graphs[2] and manager.stats().recompiles == graphs[0]


def test_sessions_on_a_shared_prefix_stay_exact(tokenizer):
    """A second session starts from the first one's system prompt (a shared
    prefix the core holds once) and decodes compiled from it."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend="eager", mode=None))
    system = {"role": "system", "content": " ".join(["You answer in short plain words."] * 8)}
    for session in ("a", "b"):
        messages = [system, user_message(ord(session))]
        reply = manager.chat(session, messages, max_new_tokens=MAX_NEW)
        assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    assert manager.last_turn("b").reused_tokens > 32
    assert manager.stats().prefix_shares == 1


def test_disable_compile_decodes_eagerly(tokenizer):
    torch._dynamo.reset()
    backend = CountingBackend()
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=backend.config())
    messages = [SYSTEM, user_message(0)]
    reply = manager.chat("s", messages, max_new_tokens=MAX_NEW, disable_compile=True)
    assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    assert manager.stats().compiled_turns == 0 and backend.graphs == 0
    # A compiled turn after an eager one starts from the eager turn's cache.
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    reply = manager.chat("s", messages, max_new_tokens=MAX_NEW)
    assert manager.last_turn("s").reused_tokens > 0
    assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    assert manager.stats().compiled_turns == 1


def test_returned_cache_is_never_reused_by_the_pool(tokenizer):
    """generate's output can carry the cache; a caller who keeps it must not
    see the next turn overwrite it."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend="eager", mode=None))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]], device=DEVICE)
    out = manager.generate(
        ids, "s", max_new_tokens=4, do_sample=False, return_dict_in_generate=True
    )
    kept = out.past_key_values
    keys = kept.layers[0].keys.clone()
    manager.generate(ids + 1, "t", max_new_tokens=4, do_sample=False)  # in the batch
    manager.generate(ids + 2, "u", max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(kept.layers[0].keys, keys)
    assert manager.stats().static_caches_built == 2


def test_sliding_window_full_and_not_full_round_trip(tokenizer):
    """Loading a session's sliding-window state and reading it back gives the
    same tokens, before the window fills and after."""
    from kvchat.bridge import CacheBridge

    model = tiny_model("gemma3", dtype=torch.float64, seed=0).to(DEVICE)
    bridge = CacheBridge(model)
    for tokens in (5, 40):  # the window is 16
        ids = torch.arange(3, 3 + tokens, device=DEVICE)[None]
        dynamic = bridge.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=dynamic)
        states = bridge.from_cache(dynamic, tokens)
        static = bridge.to_static_cache(list(states), 64)
        back = bridge.from_cache(static, tokens)
        for before, after in zip(states, back, strict=True):
            assert before.num_tokens == after.num_tokens == tokens
            for a, b in zip(before.tensors(), after.tensors(), strict=True):
                assert torch.equal(a, b)
        bridge.give_back(static)


def test_compile_setting_is_checked():
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="compile must be True, False or a transformers"):
            CompiledDecode(bad, None)
    assert not CompiledDecode(False, None).enabled
    assert not CompiledDecode(True, "indexer keys").enabled
    assert CompiledDecode(True, None).config_for({})._compile_all_devices
    assert CompiledDecode(True, None).config_for({"disable_compile": True}) is None


def test_capacity_buckets():
    sizes = (1, 256, 257, 1000, 1089, 2048, 2049, 4161, 40000)
    assert [bucket(n) for n in sizes] == [256, 256, 512, 1024, 1280, 2048, 2304, 4352, 40960]
    for n in range(1, 40000, 7):  # never less, and never much more, than asked
        assert n <= bucket(n) < n + max(256, n / 16 + 1)
    assert CompiledDecode.capacity(1000, 1500) == 1024
    assert CompiledDecode.capacity(1100, 1200) == 1200  # never past the context
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        bucket(0)


def test_sessions_on_two_threads_stay_exact(tokenizer):
    """Two conversations' compiled turns at once: each takes its own pooled
    cache, and neither sees the other's tokens."""
    import threading

    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend="eager", mode=None))
    failures = []

    def converse(session, offset):
        messages = [SYSTEM]
        try:
            for turn in range(3):
                messages.append(user_message(turn + offset))
                reply = manager.chat(session, messages, max_new_tokens=MAX_NEW)
                if reply != reference_turn(model, tokenizer, messages, MAX_NEW)[0]:
                    failures.append((session, turn))
                messages.append({"role": "assistant", "content": reply})
        except Exception as error:  # reported below, not lost in the thread
            failures.append((session, repr(error)))

    threads = [threading.Thread(target=converse, args=(f"s{i}", 3 * i)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert manager.stats().compiled_turns == 6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_first_turn_is_the_compiled_static_cache(dtype, tokenizer):
    """In bfloat16 and float16 a turn that reuses nothing runs exactly the
    computation of generate with a compiled StaticCache of its capacity, so
    its reply is the same; later turns reuse and stay finite (their logits
    differ from a full prefill's by rounding: see test_bfloat16.py)."""
    torch._dynamo.reset()
    model = tiny_model("llama", dtype=dtype, seed=0).to(DEVICE)
    manager = SessionManager(model, tokenizer, compile=True)
    messages = [SYSTEM, user_message(0)]
    reply = manager.chat("s", messages, max_new_tokens=MAX_NEW)
    capacity = bucket(manager.last_turn("s").prompt_tokens + MAX_NEW)
    assert reply == _compiled_reference(model, tokenizer, messages, capacity)[0]
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    manager.chat("s", messages, max_new_tokens=MAX_NEW)
    report = manager.last_turn("s")
    assert report.reused_tokens > 0 and report.generated_tokens == MAX_NEW
    assert manager.stats().compiled_turns == 2 and manager.stats().invalidations == 0


def test_a_failing_compiler_fails_one_turn_then_decodes_eagerly(tokenizer, caplog):
    """A backend that cannot compile (a GPU without its compiler, say) fails
    the turn it meets, which aborts cleanly; later turns decode eagerly."""

    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend=broken, mode=None))
    messages = [SYSTEM, user_message(0)]
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        manager.chat("s", messages, max_new_tokens=MAX_NEW)
    assert "decodes eagerly from now on" in caplog.text
    assert manager.stats().static_cache_bytes == 0  # the pool is freed
    assert manager.messages("s") == []  # nothing half-done
    reply = manager.chat("s", messages, max_new_tokens=MAX_NEW)
    assert reply == reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    assert manager.stats().compiled_turns == 0


def test_a_users_fullgraph_forward_under_compile_true_never_fails_a_turn(tokenizer, caplog):
    """The user compiled the forward with fullgraph=True and the manager
    compiles the decode: with plain generate between turns (the reference
    here), that forward reaches its recompile limit, which is no
    TorchDynamoException and failed every turn from then on. Before any
    token it now runs the turn again, eagerly, then plain: every turn is
    generate's, and none raises."""
    from helpers import exact_turns

    torch._dynamo.reset()
    try:
        model = tiny_model("llama", seed=0).to(DEVICE)
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        manager = SessionManager(model, tokenizer, compile=True)
        _, reports = exact_turns(manager, "s", [SYSTEM], model, tokenizer, 3)
        assert reports[-1].reason == "unsupported_generation"
        assert "cannot run on kvchat's cache" in caplog.text
    finally:
        torch._dynamo.reset()


def test_a_models_own_error_at_the_prefill_leaves_the_decode_compiled(tokenizer):
    """generate compiles the decode steps, so an error before the first token
    is the model's, not the compile's: it is raised, and later turns still
    decode compiled (one bad request turned a manager eager for good)."""
    torch._dynamo.reset()
    try:
        model = model_for("llama")
        config = CompileConfig(backend="eager", mode=None)
        manager = SessionManager(model, tokenizer, compile=config)
        original = model.forward

        def failing(*args, **kwargs):
            raise torch._dynamo.exc.TorchRuntimeError("a shape mismatch found while tracing")

        model.forward = failing
        with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="shape mismatch"):
            manager.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
        model.forward = original
        manager.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
        assert manager.stats().compiled_turns == 1
    finally:
        torch._dynamo.reset()


def test_the_models_generation_config_is_read_as_generate_reads_it():
    from transformers import GenerationConfig

    model_config = GenerationConfig(disable_compile=True)
    assert CompiledDecode(True, None, model_config).config_for({}) is None
    assert CompiledDecode(True, None, model_config).config_for({"disable_compile": False})
    turn_config = GenerationConfig()  # a turn's own config replaces the model's
    assert CompiledDecode(True, None, model_config).config_for({"generation_config": turn_config})
    chosen = CompileConfig(fullgraph=True)
    model_config = GenerationConfig(compile_config=chosen)
    assert CompiledDecode(True, None, model_config).config_for({}).fullgraph
    manager_config = CompileConfig(dynamic=False)
    picked = CompiledDecode(manager_config, None, model_config).config_for({})
    assert picked.dynamic is False and not picked.fullgraph


@pytest.mark.slow  # traces a graph for each of three capacities
def test_pool_keeps_a_cache_for_each_of_a_few_capacities(tokenizer):
    """Turns with their own compile_config asking for several capacities in
    turn do not rebuild a cache every turn."""
    model = model_for("llama")
    config = CompileConfig(backend="eager", mode=None)
    manager = SessionManager(model, tokenizer, compile=config)
    for _ in range(3):
        for session, max_new in (("a", 100), ("b", 400), ("c", 700)):
            manager.chat(
                session, [SYSTEM, user_message(0)], max_new_tokens=max_new, compile_config=config
            )
    assert manager.stats().static_caches_built == 3
    assert manager.stats().static_cache_bytes > 0


@pytest.mark.parametrize("matches", [True, False])
def test_a_stop_string_that_matches_or_never_does(matches, tokenizer):
    """A compiled turn that stops early on a stop string, and one whose stop
    string never appears, both give plain generate's tokens, and the next
    turn starts from the cache they left."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend="eager", mode=None))
    messages = [SYSTEM, user_message(0)]
    free_reply = reference_turn(model, tokenizer, messages, MAX_NEW)[0]
    # A word of the reply (random weights also write byte fragments, which no
    # stop string can match).
    stop = re.findall(r"[A-Za-z]{3,}", free_reply)[0] if matches else "zebra-never-said"
    kwargs = dict(stop_strings=[stop], tokenizer=tokenizer)

    for turn in range(2):
        reply = manager.chat("s", messages, max_new_tokens=MAX_NEW, **kwargs)
        assert reply == reference_turn(model, tokenizer, messages, MAX_NEW, **kwargs)[0]
        if turn == 0:
            assert (len(reply) < len(free_reply)) == matches
        messages += [{"role": "assistant", "content": reply}, user_message(turn + 1)]
    assert manager.last_turn("s").reused_tokens > 0
    assert manager.stats().compiled_turns == 2
