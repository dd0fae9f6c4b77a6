"""Bad input raises a clear Python exception naming the argument; never a crash."""

from __future__ import annotations

import pytest
import torch
from helpers import SYSTEM, user_message
from kvchat import _C, SessionManager, UnknownSessionError
from kvchat.tiny import CHATML_TEMPLATE, tiny_tokenizer


@pytest.fixture
def mgr(llama, tokenizer):
    return SessionManager(llama, tokenizer, max_context_length=256)


def test_unknown_session_id(mgr):
    for call in (mgr.info, mgr.last_turn, mgr.clear, mgr.remove):
        with pytest.raises(UnknownSessionError, match="session_id 'ghost'"):
            call("ghost")
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


def test_past_key_values_is_refused(mgr):
    with pytest.raises(ValueError, match="past_key_values"):
        mgr.generate(torch.ones(1, 3, dtype=torch.long), past_key_values=object())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_sessions": 0}, ValueError, "max_sessions"),
        ({"max_sessions": "4"}, ValueError, "max_sessions"),
        ({"max_cache_bytes": "lots"}, ValueError, "max_cache_bytes"),
        ({"max_cache_bytes": -1}, ValueError, "max_cache_bytes"),
        ({"max_cache_bytes": 1.5}, TypeError, "max_cache_bytes"),
        ({"max_context_length": 0}, ValueError, "max_context_length"),
        ({"match": "bytes"}, ValueError, "match must be one of"),
        ({"busy": "skip"}, ValueError, "busy must be one of"),
        ({"overflow": "wrap"}, ValueError, "overflow must be one of"),
        ({"max_checkpoints": -1}, ValueError, "max_checkpoints"),
        ({"max_checkpoints": 2.0}, ValueError, "max_checkpoints"),
        ({"max_checkpoint_bytes": "big"}, ValueError, "max_checkpoint_bytes"),
        ({"max_checkpoint_bytes": 0}, ValueError, "max_checkpoint_bytes"),
    ],
)
def test_bad_constructor_arguments(llama, tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        SessionManager(llama, tokenizer, **kwargs)


def test_not_a_model(tokenizer):
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        SessionManager("gpt2", tokenizer)


def test_core_tensor_checks_name_the_argument():
    ok = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="keys must be"):
        _C.AttentionState(torch.zeros(2, 3, 4), ok)
    with pytest.raises(ValueError, match="disagree"):
        _C.AttentionState(ok, torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="dtype"):
        _C.AttentionState(ok, ok.double())
    session = _C.ChatSession("s", num_layers=2)
    markers = _C.TurnMarkers([2], [])
    ids = torch.arange(3)
    with pytest.raises(ValueError, match="model has 2 layers"):
        session.commit(ids, [_C.AttentionState(ok, ok)], 0, markers)
    with pytest.raises(ValueError, match="token_ids must be int64"):
        session.commit(ids.int(), [_C.AttentionState(ok, ok)] * 2, 0, markers)
    with pytest.raises(ValueError, match="prompt_ids must be a 1-D"):
        session.plan(ids.view(1, 3))
    with pytest.raises(IndexError, match="new_from"):
        session.commit(ids, [_C.AttentionState(ok, ok)] * 2, 9, markers)
    assert session.cache_info().cached_tokens == 0  # nothing half-updated


def test_parse_bytes_accepts_human_sizes():
    from kvchat.units import parse_bytes

    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(1000) == 1000
    assert parse_bytes(None) is None
