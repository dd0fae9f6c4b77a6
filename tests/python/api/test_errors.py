"""Bad input raises a clear Python exception naming the argument; never a crash.

Every row of the error table in docs/errors.md maps to the tests that cover it
(``README_ROWS``), and ``test_every_readme_row_is_covered`` keeps the two in step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import SYSTEM, TESTS, doc_table_rows, user_message
from kvchat import _C, SessionBusy, SessionManager, UnknownSessionError
from kvchat.tiny import CHATML_TEMPLATE, tiny_tokenizer


@pytest.fixture
def mgr(llama, tokenizer):
    return SessionManager(llama, tokenizer, max_context_length=256)


def test_unknown_session_id(mgr, tmp_path):
    for call in (mgr.info, mgr.messages, mgr.last_turn, mgr.clear, mgr.remove):
        with pytest.raises(UnknownSessionError, match="session_id 'ghost'"):
            call("ghost")
    with pytest.raises(UnknownSessionError, match="session_id 'ghost'"):
        mgr.save("ghost", tmp_path / "ghost.safetensors")
    assert not (tmp_path / "ghost.safetensors").exists()
    assert issubclass(UnknownSessionError, KeyError)


@pytest.mark.parametrize("session_id", [None, 3, "", b"alice"])
def test_bad_session_id(mgr, session_id):
    with pytest.raises(TypeError, match="session_id"):
        mgr.chat(session_id, [user_message(0)])


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ("hello", TypeError, "messages must be a list"),
        ([], ValueError, "messages must not be empty"),
        (["hi"], TypeError, r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], ValueError, r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": 5}], ValueError, r"messages\[0\]\['content'\]"),
    ],
)
def test_malformed_messages(mgr, messages, error, match):
    with pytest.raises(error, match=match):
        mgr.chat("s", messages)
    assert "s" not in mgr.sessions()


def test_tokenizer_without_chat_template(llama):
    tok = tiny_tokenizer(chat_template=CHATML_TEMPLATE)
    tok.chat_template = None
    mgr = SessionManager(llama, tok)
    with pytest.raises(ValueError, match="chat_template"):
        mgr.chat("s", [user_message(0)])
    with pytest.raises(ValueError, match="tokenizer is None"):
        SessionManager(llama).chat("s", [user_message(0)])


def test_prompt_longer_than_max_context_length(mgr):
    long = [SYSTEM, {"role": "user", "content": "word " * 400}]
    with pytest.raises(ValueError, match=r"max_context_length=256"):
        mgr.chat("s", long, max_new_tokens=4)
    assert mgr.sessions() == []


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([1, 2, 3]), "input_ids must be a 2-D tensor"),
        (torch.ones(1, 3), "integer token ids"),
        ([[1, 2, 3]], "input_ids must be a 2-D tensor"),
        (torch.zeros(1, 0, dtype=torch.long), "at least one token"),
    ],
)
def test_bad_input_ids(mgr, ids, match):
    with pytest.raises(ValueError, match=match):
        mgr.generate(ids, max_new_tokens=2)


@pytest.mark.parametrize("name", ["past_key_values", "cache_params", "cache"])
def test_past_key_values_is_refused(mgr, name):
    """A cache of the caller's, by any name (Mamba's was cache_params; from
    transformers 5.24 every model's is cache)."""
    with pytest.raises(ValueError, match=f"{name} is managed by kvchat"):
        mgr.generate(torch.ones(1, 3, dtype=torch.long), **{name: object()})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_sessions": 0}, ValueError, "max_sessions"),
        ({"max_sessions": "4"}, ValueError, "max_sessions"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"max_batch_size": 2.5}, ValueError, "max_batch_size"),
        ({"max_step_tokens": -1}, ValueError, "max_step_tokens"),
        ({"settle_delay": -0.5}, ValueError, r"settle_delay must be .* >= 0, got -0.5"),
        ({"settle_delay": float("inf")}, ValueError, "settle_delay must be a finite"),
        ({"settle_delay": None}, TypeError, "settle_delay must be a number of seconds, got None"),
        ({"settle_delay": "1"}, TypeError, "settle_delay must be a number of seconds, got '1'"),
        ({"settle_delay": 10**400}, ValueError, "settle_delay must be a finite number"),
        ({"max_cache_bytes": "lots"}, ValueError, "max_cache_bytes"),
        ({"max_cache_bytes": -1}, ValueError, "max_cache_bytes"),
        ({"max_cache_bytes": 1.5}, TypeError, "max_cache_bytes"),
        ({"max_context_length": 0}, ValueError, "max_context_length"),
        ({"match": "bytes"}, ValueError, "match must be one of"),
        ({"busy": "skip"}, ValueError, "busy must be one of"),
        ({"overflow": "wrap"}, ValueError, "overflow must be one of"),
        ({"max_checkpoints": -1}, ValueError, "max_checkpoints"),
        ({"max_checkpoints": 2.0}, ValueError, "max_checkpoints"),
        (
            {"checkpoints": "all"},
            ValueError,
            r"checkpoints must be one of \('last', 'every'\), got 'all'",
        ),
        ({"checkpoints": ["last"]}, ValueError, "checkpoints must be one of"),
        ({"max_checkpoint_bytes": "big"}, ValueError, "max_checkpoint_bytes"),
        ({"max_checkpoint_bytes": 0}, ValueError, "max_checkpoint_bytes"),
        ({"min_shared_tokens": 0}, ValueError, "min_shared_tokens"),
        ({"min_shared_tokens": "8"}, ValueError, "min_shared_tokens"),
        ({"share_prefixes": "yes"}, TypeError, "share_prefixes"),
        ({"isolate_namespaces": 1}, TypeError, "isolate_namespaces"),
        (
            {"pack_weights": "all"},
            ValueError,
            r"pack_weights must be 'auto', True or False, got 'all'",
        ),
        ({"pack_weights": None}, ValueError, "pack_weights.*None"),
    ],
)
def test_bad_constructor_arguments(llama, tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        SessionManager(llama, tokenizer, **kwargs)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5, "8", True])
def test_bad_max_new_tokens(mgr, max_new_tokens):
    with pytest.raises(
        ValueError, match=f"max_new_tokens must be a positive int, got {max_new_tokens!r}"
    ):
        mgr.chat("s", [user_message(0)], max_new_tokens=max_new_tokens)
    with pytest.raises(ValueError, match="max_new_tokens"):
        mgr.generate(
            torch.ones(1, 3, dtype=torch.long), session_id="g", max_new_tokens=max_new_tokens
        )
    assert mgr.sessions() == []  # nothing was created


def test_busy_session(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, busy="error")
    mgr.chat("s", [user_message(0)], max_new_tokens=2)
    with mgr._core.acquire("s"):  # another call holds the session
        with pytest.raises(SessionBusy, match="session_id 's' is in use"):
            mgr.chat("s", [user_message(0)], max_new_tokens=2)
        with pytest.raises(SessionBusy, match="session_id 's' is in use"):
            mgr.remove("s")
        with pytest.raises(SessionBusy, match="session_id 's' is in use"):
            mgr.clear("s")
    assert mgr.info("s").messages == 2  # untouched by the refused calls


def test_not_a_model(tokenizer):
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        SessionManager("gpt2", tokenizer)


@pytest.mark.parametrize("tokenizer", ["tok", 3, object()], ids=["str", "int", "object"])
def test_a_tokenizer_that_is_not_one_is_a_type_error_naming_it(llama, tokenizer):
    # Was AttributeError: 'str' object has no attribute 'eos_token_id'.
    with pytest.raises(TypeError) as raised:
        SessionManager(llama, tokenizer)
    message = str(raised.value)
    assert message.startswith("tokenizer must be the model's transformers tokenizer")
    assert f"got {type(tokenizer).__name__} " in message and "AutoTokenizer" in message
    if isinstance(tokenizer, str):
        assert "'tok'" in message


def test_an_encoder_decoder_model_is_refused_naming_its_class(tokenizer):
    """T5 has generate() and a config, but no cache a next prompt extends: a
    TypeError naming the class at construction, not transformers' "You must
    specify exactly one of input_ids or inputs_embeds" from the layout probe."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    with pytest.raises(
        TypeError,
        match=r"model must be a decoder-only causal LM \(AutoModelForCausalLM\), "
        r"got T5ForConditionalGeneration, an encoder-decoder model",
    ):
        SessionManager(T5ForConditionalGeneration(config), tokenizer)


@pytest.mark.parametrize("bad", [10**6, 668, -1])
def test_an_id_outside_the_vocabulary_names_the_id_and_the_vocabulary(mgr, llama, bad):
    """Refused before any session is created or changed (was IndexError:
    index out of range in self, from the embedding)."""
    vocab = llama.get_input_embeddings().num_embeddings
    assert vocab == 668
    mgr.generate(torch.tensor([[1, 2, 3]]), session_id="g", max_new_tokens=2)
    before = (mgr.info("g"), mgr.cached_ids("g"))
    for session in ("g", "new"):
        with pytest.raises(
            ValueError,
            match=rf"input_ids holds token id {bad}, outside the model's vocabulary of {vocab} "
            rf"\(ids 0 to {vocab - 1}\)",
        ):
            mgr.generate(torch.tensor([[1, bad, 2]]), session_id=session, max_new_tokens=2)
        with pytest.raises(ValueError, match=f"input_ids holds token id {bad}"):
            mgr.stream_generate(torch.tensor([[bad]]), session_id=session, max_new_tokens=2)
    assert mgr.sessions() == ["g"]
    assert (mgr.info("g"), mgr.cached_ids("g")) == before


def test_an_unknown_session_prints_its_message_without_extra_quotes(mgr):
    with pytest.raises(UnknownSessionError) as raised:
        mgr.info("ghost")
    assert str(raised.value) == "session_id 'ghost' is not a known session"
    assert isinstance(raised.value, KeyError)  # still caught as one


def test_core_tensor_checks_name_the_argument():
    ok = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="keys must be"):
        _C.AttentionState(torch.zeros(2, 3, 4), ok)
    with pytest.raises(ValueError, match="disagree"):
        _C.AttentionState(ok, torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="dtype"):
        _C.AttentionState(ok, ok.double())
    with pytest.raises(ValueError, match="values device meta"):
        _C.AttentionState(ok, torch.zeros(1, 2, 3, 4, device="meta"))
    # A turn's cache of 3 tokens (the prompt's 2 and the first reply token).
    core = _C.SessionManager(
        _C.ManagerLimits(num_layers=2), _C.TurnSettings(markers=_C.TurnMarkers([2], []))
    )
    ids = torch.arange(4)
    with (lease := core.acquire("s")) as session:
        with pytest.raises(ValueError, match="model has 2 layers"):
            with core.begin_turn(lease, ids[:2], 2) as turn:
                turn.finish(
                    _C.TurnResult(sequence=ids, layers=[_C.AttentionState(ok, ok)], cached_tokens=3)
                )
        with pytest.raises(ValueError, match="sequence must be int64"):
            _C.TurnResult(sequence=ids.int())
        with pytest.raises(ValueError, match="prompt_ids must be a 1-D"):
            session.plan(ids.view(2, 2))
        with pytest.raises(ValueError, match="prompt_ids must be a 1-D"):
            core.begin_turn(lease, ids.view(2, 2), 2)
        assert session.cache_info().cached_tokens == 0  # the refused turn left nothing


def test_core_positions_out_of_range():
    ok = torch.zeros(1, 2, 3, 4)
    state = _C.AttentionState(ok, ok)
    for n in (-1, 4):
        with pytest.raises(IndexError, match=f"cannot crop an attention layer of 3 tokens to {n}"):
            state.cropped(n)
    # (A commit's new_from is no argument from Python any more: a turn passes its
    # own kept tokens; tests/cpp/chat_session_test.cpp checks the range.)
    markers = _C.TurnMarkers([2], [])
    core = _C.SessionManager(_C.ManagerLimits(num_layers=1), _C.TurnSettings(markers=markers))
    ids = torch.arange(4)  # a turn's prompt of 2, and 3 tokens cached after it
    with (lease := core.acquire("s")) as session:
        with pytest.raises(IndexError, match="checkpoint position"):
            with core.begin_turn(lease, ids[:2], 2) as turn:
                result = _C.TurnResult(
                    sequence=ids,
                    layers=[state],
                    cached_tokens=3,
                    checkpoints=[_C.Checkpoint(7, [None])],
                )
                turn.finish(result)
        with pytest.raises(IndexError, match="begin must be in"):
            _C.checkpoint_positions(ids, 5, markers)
        assert not session.resident


# docs/errors.md table row (its first cell) -> the tests that cover it.
README_ROWS = {
    "`store` not a `redis://` URL": ["test_redis_tier.py::test_store_argument_errors"],
    "unknown `session_id`": [
        "test_unknown_session_id",
        "test_an_unknown_session_prints_its_message_without_extra_quotes",
        "test_settling.py::test_settle_names_bad_arguments",
    ],
    "`session_id` not a non-empty string": ["test_bad_session_id"],
    "`wait_settled()` with a `timeout`": [
        "test_settling.py::test_wait_settled_names_a_bad_timeout",
    ],
    "`stream.end()` with a `flush_timeout`": [
        "test_turn_end.py::test_end_names_a_bad_flush_timeout_and_leaves_the_turn_running",
        "test_turn_end.py::test_end_passes_on_what_settle_refuses_once_committed",
    ],
    "`messages` not a list": ["test_malformed_messages"],
    "a content part that is not text": [
        "test_messages.py::test_malformed_client_messages_name_the_field",
        "test_messages.py::test_tools_and_template_kwargs_of_the_wrong_type_name_the_argument",
    ],
    "`chat_template_kwargs` holding an argument of `apply_chat_template`": [
        "test_messages.py::test_what_the_template_must_not_run_is_refused_naming_the_argument",
        "test_messages.py::test_a_template_that_raises_is_a_value_error_naming_messages",
    ],
    "tokenizer without a `chat_template`": ["test_tokenizer_without_chat_template"],
    "prompt + `max_new_tokens` over": [
        "test_prompt_longer_than_max_context_length",
        "test_overflow.py::test_truncate_cannot_drop_the_question_itself",
    ],
    "`max_new_tokens` zero": ["test_bad_max_new_tokens"],
    "`input_ids` not a 2-D": ["test_bad_input_ids"],
    "`past_key_values` or `cache_params` passed": ["test_past_key_values_is_refused"],
    "`max_sessions`, `max_cache_bytes`": ["test_bad_constructor_arguments"],
    "`seed` (in `chat`": ["test_engine.py::test_seed_is_checked_before_the_session_is_touched"],
    "a turn started from the engine's own thread": [
        "test_engine.py::test_a_turn_started_from_the_engines_thread_is_refused_by_name"
    ],
    "`match`, `busy`, `overflow` or `checkpoints`": [
        "test_bad_constructor_arguments",
        "test_settling.py::test_settle_names_bad_arguments",
    ],
    "`pack_weights` not": ["test_engine_packed.py::test_pack_weights_takes_auto_true_or_false"],
    "`settle()` with a history": ["test_settling.py::test_settle_refuses_what_chat_would"],
    "a call on a session in use": ["test_busy_session"],
    "`remove`/`clear` with a shared store": [
        "test_redis_tier.py::test_a_delete_that_cannot_reach_redis_says_so_and_a_retry_deletes"
    ],
    "`save`/`load` `path`": ["test_persistence.py::test_save_and_load_argument_errors"],
    "`load` of a truncated": [
        "test_persistence.py::test_truncated_file_is_rejected",
        "test_persistence.py::test_corrupted_tensor_bytes_are_rejected",
        "test_persistence.py::test_garbage_and_foreign_files_are_rejected",
        "test_persistence.py::test_a_different_model_is_rejected",
    ],
    "`load` of a file with any header": [
        "test_file_validation.py::test_checkpoint_dtype_changed_in_the_header_is_refused",
        "test_file_validation.py::test_recurrent_slots_changed_in_the_metadata_are_refused",
        "test_file_validation.py::test_a_file_signed_anew_is_still_checked_against_the_model",
        "test_file_validation.py::test_every_one_byte_header_change_is_refused_or_harmless",
        "test_session_file.py::test_a_layout_that_does_not_fit_the_model_names_what",
        "test_session_file.py::test_a_file_with_no_usable_session_id_is_a_session_file_error",
        "test_fingerprint.py::test_file_from_a_model_differing_in_a_middle_layer_is_refused",
    ],
    "a misspelled or invalid `generate` argument": [
        "test_generate_args.py::test_misspelled_argument_leaves_every_session_as_it_was"
    ],
    "`session_id` or message text that is not valid Unicode": [
        "test_session_id_that_is_not_unicode_text"
    ],
    "a size argument of 2**63": ["test_sizes_beyond_64_bits_name_the_argument"],
    "a tool schema a tool-call grammar cannot write": [
        "test_grammar.py::test_a_text_holding_a_special_token_is_refused_by_name",
        "test_grammar.py::test_a_required_key_holding_a_special_token_is_refused_too",
        "test_grammar.py::test_an_xml_markup_refuses_a_text_with_a_closing_tag",
    ],
    "a turn that raises inside `generate`": [
        "test_generate_args.py::test_a_turn_that_fails_in_generate_leaves_no_half_state",
        "test_budget_accounting.py::test_cancelled_turns_pin_nothing",
    ],
    "a grammar llguidance refuses when": [
        "test_grammar.py::test_a_grammar_llguidance_refuses_on_its_first_tokens_is_refused_when_built",
        "test_grammar.py::test_a_grammar_over_the_size_bound_is_refused_before_it_compiles",
        "test_grammar.py::test_a_schema_llguidance_refuses_names_the_field",
    ],
    "a grammar llguidance refuses later": [
        "test_grammar.py::test_a_grammar_refused_while_decoding_ends_the_reply_as_plain_generate_does"
    ],
    "`tokenizer` that is not a tokenizer": [
        "test_a_tokenizer_that_is_not_one_is_a_type_error_naming_it"
    ],
    "`model` that is not a decoder-only causal LM": [
        "test_not_a_model",
        "test_an_encoder_decoder_model_is_refused_naming_its_class",
    ],
    "`input_ids` holding an id outside": [
        "test_an_id_outside_the_vocabulary_names_the_id_and_the_vocabulary"
    ],
    "core: KV tensors": ["test_core_tensor_checks_name_the_argument"],
    "core: a crop": ["test_core_positions_out_of_range"],
}


def test_every_readme_row_is_covered():
    rows = doc_table_rows("docs/errors.md", "# Errors")
    assert len(rows) == len(README_ROWS)
    for row in rows:
        keys = [key for key in README_ROWS if row.startswith(key)]
        assert len(keys) == 1, f"docs/errors.md row {row!r} has no test in README_ROWS"
        for test in README_ROWS[keys[0]]:
            # Read, not imported: the named file may sit in a folder this run did not collect.
            module, _, name = test.rpartition("::")
            (path,) = TESTS.rglob(module) if module else (Path(__file__),)
            assert re.search(rf"^def {name}\(", path.read_text(), re.M), f"{test} does not exist"


def test_parse_bytes_accepts_human_sizes():
    from kvchat.units import parse_bytes

    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(1000) == 1000
    assert parse_bytes(None) is None


def test_session_id_that_is_not_unicode_text(mgr):
    with pytest.raises(ValueError, match="session_id"):
        mgr.chat("\ud800", [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]"):
        mgr.chat("s", [{"role": "user", "content": "bad \ud800 text"}])
    assert mgr.sessions() == []


@pytest.mark.parametrize(
    "name",
    [
        "max_sessions",
        "max_cache_bytes",
        "max_checkpoints",
        "max_checkpoint_bytes",
        "min_shared_tokens",
        "max_context_length",
    ],
)
@pytest.mark.parametrize("size", [2**63, 2**64 + 5])
def test_sizes_beyond_64_bits_name_the_argument(llama, tokenizer, name, size):
    with pytest.raises(ValueError, match=name):
        SessionManager(llama, tokenizer, **{name: size})


def test_save_never_brings_back_a_session_removed_meanwhile(mgr, llama, tokenizer, tmp_path):
    messages = [SYSTEM, user_message(0)]
    mgr.chat("s", messages, max_new_tokens=4)
    mgr.chat("other", messages, max_new_tokens=4)
    other = (mgr.info("other"), mgr.messages("other"))

    class RemovedBeforeLease:
        """The core, with the session removed just before save() leases it:
        another thread's remove landing between the caller's call and the lease."""

        def __init__(self, core):
            self._core = core

        def acquire(self, session_id, *args, **kwargs):
            self._core.remove(session_id)
            return self._core.acquire(session_id, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._core, name)

    real, mgr._core = mgr._core, RemovedBeforeLease(mgr._core)
    path = tmp_path / "s.safetensors"
    try:
        with pytest.raises(UnknownSessionError):
            mgr.save("s", path)
    finally:
        mgr._core = real
    assert not path.exists()  # nothing written: not an empty session, not a stale one
    assert "s" not in mgr.sessions()  # and the lease did not create it again
    assert (mgr.info("other"), mgr.messages("other")) == other
    # A lease that must not create never does.
    with pytest.raises(UnknownSessionError):
        real.acquire("ghost", create=False)
    assert "ghost" not in real.session_ids()


def test_turn_records_are_read_only(mgr):
    mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=4)
    record = mgr._core.find("s").last_turn()
    with pytest.raises(AttributeError):
        record.reused_tokens = 10**6
    assert mgr.last_turn("s").reused_tokens == record.reused_tokens == 0


@pytest.mark.parametrize(
    "bad", [{"max_cache_bytes": "lots"}, {"max_sessions": 0}, {"max_context_length": -1}]
)
def test_a_refused_argument_starts_no_store_thread(llama, tokenizer, bad):
    # Every argument is checked before the tier is built: a refused manager
    # leaves no Redis writer thread behind (nothing is listening on port 1).
    import threading

    def store_threads():
        return {t for t in threading.enumerate() if t.name == "kvchat-store" and t.is_alive()}

    before = store_threads()
    with pytest.raises(ValueError, match=next(iter(bad))):
        SessionManager(llama, tokenizer, store="redis://127.0.0.1:1/0", **bad)
    assert not store_threads() - before
    # Nor does a tokenizer kvchat cannot read (its parts are built before the tier).
    with pytest.raises(TypeError, match="tokenizer must be"):
        SessionManager(llama, object(), store="redis://127.0.0.1:1/0")
    assert not store_threads() - before
