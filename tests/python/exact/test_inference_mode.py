"""A caller inside ``torch.inference_mode()``, as many inference scripts are:
the caches and checkpoints a turn builds on the caller's thread would be
inference tensors, which the engine's thread (not in inference mode) cannot
update in place. Every turn after the first failed so (engine/threads.py
``normal_tensors``)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import SYSTEM, exact_turns, model_for, user_message
from kvchat import SessionManager
from kvchat.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("family", ["llama", "lfm2", "gemma3"])
def test_turns_under_inference_mode_stay_exact(family, tokenizer):
    model = model_for(family)  # float64; lfm2: conv checkpoints; gemma3: sliding windows
    manager = SessionManager(model, tokenizer)
    with torch.inference_mode():
        messages, reports = exact_turns(manager, "s", [SYSTEM], model, tokenizer, 3)
        assert all(r.reused_tokens > 0 for r in reports[1:]), reports
        # A streamed turn, and one after the session went through a file.
        messages.append(user_message(7))
        streamed = "".join(manager.stream_chat("s", messages, max_new_tokens=6))
        assert streamed == manager.chat("copy", messages, max_new_tokens=6)
    manager.close()


def test_a_loaded_session_and_turns_decoding_together_under_inference_mode(tokenizer, tmp_path):
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    with torch.inference_mode():
        messages, _ = exact_turns(manager, "saved", [SYSTEM], model, tokenizer, 1)
        manager.save("saved", tmp_path / "s.safetensors")
        manager.load(tmp_path / "s.safetensors", "loaded")
        messages.append(user_message(4))
        exact_turns(manager, "loaded", messages, model, tokenizer, 1, start=5)
    errors = []

    def converse(k):
        try:
            with torch.inference_mode():  # per thread, as each request's would be
                exact_turns(manager, f"t{k}", [SYSTEM], model, tokenizer, 2, start=k)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=converse, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert manager.stats().max_batch_rows >= 2
    manager.close()
