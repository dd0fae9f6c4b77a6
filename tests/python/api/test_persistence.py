"""Saving and loading sessions, in this process and across a restart, and the
disk spill. Every continued turn is compared with a session that never left."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import (
    LONG_SYSTEM,
    MAX_NEW,
    REUSE_FAMILIES,
    SYSTEM,
    TESTS,
    exact_turn,
    exact_turns,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import SessionFileError, SessionManager


def saved_after_two_turns(model, tokenizer, tmp_path):
    """A session of two turns, saved: (its manager, its messages, the file)."""
    stayed = SessionManager(model, tokenizer)
    messages = exact_turns(stayed, "s", [LONG_SYSTEM], model, tokenizer, 2)[0]
    stayed.wait_settled()  # the file and the session here then hold the same
    path = tmp_path / "s.safetensors"
    stayed.save("s", path)
    return stayed, messages, path


@pytest.mark.parametrize("family", REUSE_FAMILIES)
def test_save_load_continues_exactly(family, tokenizer, tmp_path):
    model = model_for(family)
    stayed, messages, path = saved_after_two_turns(model, tokenizer, tmp_path)

    fresh = SessionManager(model, tokenizer)
    assert fresh.load(path) == "s"
    assert fresh.messages("s") == messages
    assert fresh.info("s").cached_tokens == stayed.info("s").cached_tokens

    messages.append(user_message(2))
    _, _, expected = reference_turn(model, tokenizer, messages)
    stayed.chat("s", messages, max_new_tokens=MAX_NEW)
    fresh.chat("s", messages, max_new_tokens=MAX_NEW)
    assert fresh.last_turn("s").output_ids == stayed.last_turn("s").output_ids == expected
    assert fresh.last_turn("s").reused_tokens == stayed.last_turn("s").reused_tokens > 0


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_5"])
def test_a_session_started_from_a_shared_prefix_saves_and_loads(family, tokenizer, tmp_path):
    """A hybrid session that started from another session's prefix holds that
    prefix as a checkpoint, attention part included; its file loads (it was
    refused as 'a hybrid state [attention, recurrent]' before)."""
    model = model_for(family)
    stayed = SessionManager(model, tokenizer)
    exact_turns(stayed, "donor", [LONG_SYSTEM], model, tokenizer, 1)
    messages = exact_turns(stayed, "s", [LONG_SYSTEM], model, tokenizer, 1, 3)[0]
    assert stayed.last_turn("s").reason == "shared_prefix"
    stayed.save("s", tmp_path / "s.safetensors")
    fresh = SessionManager(model, tokenizer)
    fresh.load(tmp_path / "s.safetensors")
    messages.append(user_message(4))
    _, _, expected = reference_turn(model, tokenizer, messages)
    fresh.chat("s", messages, max_new_tokens=MAX_NEW)
    assert fresh.last_turn("s").output_ids == expected
    assert fresh.last_turn("s").reused_tokens > 0


RESTART = textwrap.dedent(
    """
    import json, sys, torch
    from kvchat import SessionManager
    from kvchat.tiny import tiny_model, tiny_tokenizer
    family, path, tests = sys.argv[1:4]
    sys.path.insert(0, tests)
    from helpers import MAX_NEW, user_message
    mgr = SessionManager(tiny_model(family, dtype=torch.float64), tiny_tokenizer())
    sid = mgr.load(path)
    messages = mgr.messages(sid) + [user_message(2)]
    mgr.chat(sid, messages, max_new_tokens=MAX_NEW)
    report = mgr.last_turn(sid)
    print(json.dumps({"output_ids": list(report.output_ids), "reused": report.reused_tokens}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "falcon_h1"])
def test_restart_in_a_new_process_continues_exactly(family, tokenizer, tmp_path):
    model = model_for(family)
    stayed, messages, path = saved_after_two_turns(model, tokenizer, tmp_path)

    child = subprocess.run(
        [sys.executable, "-c", RESTART, family, str(path), str(TESTS)],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    restarted = json.loads(child.stdout.strip().splitlines()[-1])

    messages.append(user_message(2))
    stayed.chat("s", messages, max_new_tokens=MAX_NEW)
    assert tuple(restarted["output_ids"]) == stayed.last_turn("s").output_ids
    assert restarted["reused"] == stayed.last_turn("s").reused_tokens > 0


@pytest.fixture
def saved(llama, tokenizer, tmp_path):
    mgr = SessionManager(llama, tokenizer)
    exact_turns(mgr, "s", [SYSTEM], llama, tokenizer, 2)
    path = tmp_path / "s.safetensors"
    mgr.save("s", path)
    return path


def assert_unchanged(mgr, before_ids, before_messages):
    assert mgr.messages("kept") == before_messages
    assert mgr.info("kept").cached_tokens == before_ids
    assert "new" not in mgr.sessions()


def bad_file_is_rejected(llama, tokenizer, path, match):
    mgr = SessionManager(llama, tokenizer)
    exact_turns(mgr, "kept", [SYSTEM], llama, tokenizer, 1, 5)
    assert mgr.wait_settled(timeout=60)  # settling would grow the cache after `before`
    before = (mgr.info("kept").cached_tokens, mgr.messages("kept"))
    with pytest.raises(SessionFileError, match=match):
        mgr.load(path, session_id="kept")
    with pytest.raises(SessionFileError, match=match):
        mgr.load(path, session_id="new")
    assert_unchanged(mgr, *before)


def test_truncated_file_is_rejected(llama, tokenizer, saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 200])
    bad_file_is_rejected(llama, tokenizer, saved, "truncated or corrupted|not a readable")


def test_corrupted_tensor_bytes_are_rejected(llama, tokenizer, saved):
    data = bytearray(saved.read_bytes())
    data[-50] ^= 0xFF  # inside the last tensor
    saved.write_bytes(bytes(data))
    bad_file_is_rejected(llama, tokenizer, saved, "checksum")


def test_garbage_and_foreign_files_are_rejected(llama, tokenizer, tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    bad_file_is_rejected(llama, tokenizer, garbage, "not a readable session file")


def test_a_different_model_is_rejected(tokenizer, saved):
    other = model_for("llama", seed=1)  # same config, other weights
    bad_file_is_rejected(other, tokenizer, saved, "different model.*weights differ")
    qwen = model_for("qwen2")
    bad_file_is_rejected(qwen, tokenizer, saved, "different model")


def test_save_and_load_argument_errors(llama, tokenizer, tmp_path):
    mgr = SessionManager(llama, tokenizer)
    with pytest.raises(KeyError, match="nobody"):
        mgr.save("nobody", tmp_path / "x.safetensors")
    exact_turns(mgr, "s", [SYSTEM], llama, tokenizer, 1)
    with pytest.raises(TypeError, match="path"):
        mgr.save("s", 42)
    with pytest.raises(FileNotFoundError, match="missing"):
        mgr.load(tmp_path / "missing.safetensors")
    with pytest.raises(TypeError, match="session_id"):
        mgr.load(tmp_path / "missing.safetensors", session_id=3)


def test_spill_dir_reloads_evicted_sessions_exactly(llama, tokenizer, tmp_path):
    probe = SessionManager(llama, tokenizer)
    exact_turns(probe, "p", [LONG_SYSTEM], llama, tokenizer, 1)
    budget = int(probe.info("p").nbytes * 1.5)  # about one session
    spill = tmp_path / "spill"
    mgr = SessionManager(llama, tokenizer, max_cache_bytes=budget, spill_dir=spill)
    systems = {
        sid: {"role": "system", "content": f"Session {sid}. " + LONG_SYSTEM["content"]}
        for sid in "abc"
    }
    conversations = {sid: [systems[sid]] for sid in "abc"}
    reasons = []
    for turn in range(3):  # round robin, so each turn evicts another session
        for sid, messages in conversations.items():
            conversations[sid], (report,) = exact_turns(
                mgr, sid, messages, llama, tokenizer, 1, turn
            )
            assert mgr.stats().resident_bytes <= budget
            reasons.append(report.reason)
    stats = mgr.stats()
    assert stats.evictions > 0 and stats.spill_writes > 0 and stats.spill_loads > 0
    assert (stats.tier_writes, stats.tier_loads) == (stats.spill_writes, stats.spill_loads)
    assert "spill_reload" in reasons
    # Reading a spill file never deletes it; removing the session does.
    files = list(spill.glob("*.safetensors"))
    assert files
    for sid in "abc":
        mgr.remove(sid)
    assert not list(spill.glob("*.safetensors"))


def test_saving_a_session_the_budget_evicted_says_the_file_holds_no_cache(
    llama, tokenizer, tmp_path, caplog
):
    """A session larger than max_cache_bytes keeps no cache in memory, so its
    file holds its messages only: save says so, and the loaded session still
    continues exactly (it prefills)."""
    mgr = SessionManager(llama, tokenizer, max_cache_bytes=1024)
    messages = exact_turns(mgr, "big", [LONG_SYSTEM], llama, tokenizer, 1)[0]
    mgr.wait_settled()
    assert mgr.info("big").cached_tokens == 0
    path = tmp_path / "big.safetensors"
    with caplog.at_level("WARNING", logger="kvchat"):
        mgr.save("big", path)
    assert any("'big' holds no cache" in r.getMessage() for r in caplog.records)
    fresh = SessionManager(llama, tokenizer)
    fresh.load(path)
    assert fresh.messages("big") == messages and fresh.info("big").cached_tokens == 0
    messages.append(user_message(1))
    _, _, expected = reference_turn(llama, tokenizer, messages)
    fresh.chat("big", messages, max_new_tokens=MAX_NEW)
    assert fresh.last_turn("big").output_ids == expected


def test_saving_a_session_the_budget_spilled_saves_the_spilled_cache(
    llama, tokenizer, tmp_path, caplog
):
    """With a spill folder the evicted cache is on disk: save writes it into
    the file (no warning), and the loaded session's next turn reuses it and
    is exact."""
    mgr = SessionManager(llama, tokenizer, max_cache_bytes=1024, spill_dir=tmp_path / "spill")
    messages = exact_turns(mgr, "big", [LONG_SYSTEM], llama, tokenizer, 1)[0]
    mgr.wait_settled()
    assert mgr.info("big").cached_tokens == 0 and mgr.stats().spill_writes >= 1
    path = tmp_path / "big.safetensors"
    with caplog.at_level("WARNING", logger="kvchat"):
        mgr.save("big", path)
    assert not [r for r in caplog.records if "holds no cache" in r.getMessage()]
    assert mgr.stats().spill_loads == 0  # save's read is no turn's load
    fresh = SessionManager(llama, tokenizer)
    fresh.load(path)
    assert fresh.messages("big") == messages and fresh.info("big").cached_tokens > 0
    messages.append(user_message(1))
    _, report = exact_turn(fresh, "big", messages, llama, tokenizer)
    assert report.reused_tokens > 0.5 * report.prompt_tokens, report


def test_loading_over_a_spilled_session_forgets_what_it_spilled(llama, tokenizer, tmp_path):
    """A load replaces the session: the cache it spilled before is no longer
    its own, so a later save writes the loaded file's contents, never the
    old conversation (here one without a cache, which was saved with the
    old one's cache before)."""
    spill = tmp_path / "spill"
    mgr = SessionManager(llama, tokenizer, max_cache_bytes=1024, spill_dir=spill)
    secret = [LONG_SYSTEM, {"role": "user", "content": "My password is hunter2"}]
    mgr.chat("s", secret, max_new_tokens=MAX_NEW)
    mgr.wait_settled()
    assert list(spill.glob("*.safetensors"))
    other = SessionManager(llama, tokenizer, max_cache_bytes=1024)  # no spill: messages only
    new = exact_turns(other, "o", [SYSTEM], llama, tokenizer, 1)[0]
    other.wait_settled()
    other.save("o", tmp_path / "new.safetensors")
    mgr.load(tmp_path / "new.safetensors", session_id="s")
    assert not list(spill.glob("*.safetensors"))
    mgr.save("s", tmp_path / "s.safetensors")
    fresh = SessionManager(llama, tokenizer)
    fresh.load(tmp_path / "s.safetensors")
    assert fresh.messages("s") == new and fresh.info("s").cached_tokens == 0


def test_saving_a_resident_session_warns_of_nothing(llama, tokenizer, tmp_path, caplog):
    mgr = SessionManager(llama, tokenizer)
    exact_turns(mgr, "s", [SYSTEM], llama, tokenizer, 1)
    with caplog.at_level("WARNING", logger="kvchat"):
        mgr.save("s", tmp_path / "s.safetensors")
    assert not [r for r in caplog.records if "holds no cache" in r.getMessage()]
