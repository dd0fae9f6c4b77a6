"""Every byte of a session file is checked before anything is adopted: a
corrupt file raises SessionFileError, changes nothing, and never touches the
rest of the manager."""

from __future__ import annotations

import json
import re
import struct

import pytest
from helpers import LONG_SYSTEM, MAX_NEW, model_for, reference_turn, user_message
from kvchat import SessionFileError, SessionManager


def header_bounds(data: bytes) -> tuple[int, int]:
    """(start, end) of the safetensors JSON header."""
    (length,) = struct.unpack("<Q", data[:8])
    return 8, 8 + length


def saved_lfm2(tokenizer, tmp_path, turns=2):
    """An LFM2 session (conv layers, so checkpoints) saved after ``turns`` turns."""
    model = model_for("lfm2")
    mgr = SessionManager(model, tokenizer)
    messages = [LONG_SYSTEM]
    for turn in range(turns):
        messages.append(user_message(turn))
        messages.append(
            {"role": "assistant", "content": mgr.chat("s", messages, max_new_tokens=MAX_NEW)}
        )
    mgr.wait_settled()
    path = tmp_path / "s.safetensors"
    mgr.save("s", path)
    return model, messages, path


def edited(path, edit):
    data = path.read_bytes()
    start, end = header_bounds(data)
    header = edit(data[start:end].decode())
    assert len(header.encode()) == end - start, "edits keep the header's length"
    out = path.with_name("edited.safetensors")
    out.write_bytes(data[:start] + header.encode() + data[end:])
    return out


def test_checkpoint_dtype_changed_in_the_header_is_refused(tokenizer, tmp_path):
    model, _, path = saved_lfm2(tokenizer, tmp_path)
    header = json.loads(path.read_bytes()[slice(*header_bounds(path.read_bytes()))])
    name = next(n for n in sorted(header) if n.startswith("checkpoint.") and n.endswith(".0"))
    assert header[name]["dtype"] == "F64"

    def to_int64(text):
        return re.sub(rf'("{re.escape(name)}":{{"dtype":)"F64"', r'\1"I64"', text)

    bad = edited(path, to_int64)
    mgr = SessionManager(model, tokenizer)
    with pytest.raises(SessionFileError, match="checksum"):
        mgr.load(bad)
    assert mgr.sessions() == []


def test_recurrent_slots_changed_in_the_metadata_are_refused(tokenizer, tmp_path):
    model, messages, path = saved_lfm2(tokenizer, tmp_path)
    bad = edited(path, lambda text: text.replace('\\"conv\\", 0]', '\\"conv\\", 1]', 1))
    assert bad.read_bytes() != path.read_bytes()
    mgr = SessionManager(model, tokenizer)
    with pytest.raises(SessionFileError):
        mgr.load(bad)
    # The manager is untouched: new sessions and loaded good files work exactly.
    messages.append(user_message(5))
    _, _, expected = reference_turn(model, tokenizer, messages)
    mgr.chat("new", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("new").output_ids == expected
    assert mgr.load(path) == "s"
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").output_ids == expected
    assert mgr.last_turn("s").reused_tokens > 0


def _swap_slots(metadata, cache, tensors):
    layer = next(i for i, s in enumerate(cache["slots"]) if s)
    cache["slots"][layer] = [["conv", 1]]


def _nan_in_keys(metadata, cache, tensors):
    tensors["layer.0.0"].view(-1)[0] = float("nan")


def _empty_session_id(metadata, cache, tensors):
    metadata["session_id"] = ""


@pytest.mark.parametrize(
    ("forge", "match"),
    [
        (_swap_slots, "recurrent tensors"),
        (_nan_in_keys, "not finite"),
        (_empty_session_id, "no usable session id"),
    ],
    ids=["slots", "nan", "session-id"],
)
def test_a_file_signed_anew_is_still_checked_against_the_model(forge, match, tokenizer, tmp_path):
    """The checksum has no key: a file rewritten and its digest recomputed
    passes it, and must still be refused whole, leaving the manager as it was."""
    from kvchat.tiers import session_file as persist
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, _, path = saved_lfm2(tokenizer, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    tensors = load_file(str(path))
    cache = json.loads(metadata["cache"])
    forge(metadata, cache, tensors)
    metadata["cache"] = json.dumps(cache)
    metadata["sha256"] = persist._digest(metadata, tensors)
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata=metadata)
    mgr = SessionManager(model, tokenizer)
    with pytest.raises(SessionFileError, match=match):
        mgr.load(forged)
    assert mgr.sessions() == []


@pytest.mark.slow
def test_every_one_byte_header_change_is_refused_or_harmless(tokenizer, tmp_path):
    model, messages, path = saved_lfm2(tokenizer, tmp_path, turns=1)
    data = path.read_bytes()
    start, end = header_bounds(data)
    mgr = SessionManager(model, tokenizer)
    mgr.chat("other", [LONG_SYSTEM, user_message(3)], max_new_tokens=MAX_NEW)
    mgr.wait_settled()
    other = (mgr.info("other"), mgr.messages("other"))
    good = SessionManager(model, tokenizer)
    good.load(path, session_id="s")
    expected = (good.info("s"), good.messages("s"))
    bad = tmp_path / "bad.safetensors"
    outcomes = {"refused": 0, "harmless": 0}
    # Every byte of the length prefix and header, each flipped in its lowest bit.
    for position in range(end):
        mutated = bytearray(data)
        mutated[position] ^= 0x01
        bad.write_bytes(bytes(mutated))
        try:
            mgr.load(bad, session_id="s")
        except SessionFileError as error:
            assert str(bad) in str(error)
            outcomes["refused"] += 1
        else:
            # Nothing the file means changed (padding, say): what loaded is the original.
            assert (mgr.info("s"), mgr.messages("s")) == expected, position
            outcomes["harmless"] += 1
            mgr.remove("s")
    assert "s" not in mgr.sessions()
    assert (mgr.info("other"), mgr.messages("other")) == other
    assert outcomes["refused"] >= end - 16, outcomes  # at most the padding is harmless
    # And the manager still works: a new turn is plain generate's, token for token.
    turn = messages + [user_message(4)]
    reply = mgr.chat("after", turn, max_new_tokens=MAX_NEW, do_sample=False)
    text, _, ids = reference_turn(model, tokenizer, turn)
    assert (reply, tuple(mgr.last_turn("after").output_ids)) == (text, ids)
