"""A process that drops a manager (or a stream) without ``close()`` exits
cleanly.

Its engine's thread then ends on its own and frees the model as it ends; a
dropped stream's worker ends its turn. The interpreter's exit must wait for
them (daemon_threads.py), else Python ends such a thread by ``pthread_exit``
inside native code that gives up the GIL (torch's tensor deallocator, the
core's lease release) and the process aborts: "terminate called without an
active exception", rc 134 (``make demo`` did, in about half its runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import SYSTEM, user_message
from kvchat import SessionManager, daemon_threads


def test_every_thread_kvchat_starts_is_one_the_exit_waits_for(llama, tokenizer):
    manager = SessionManager(llama, tokenizer)
    stream = manager.stream_chat("s", [SYSTEM, user_message(0)], max_new_tokens=4)
    assert "".join(stream)
    manager.chat("t", [SYSTEM, user_message(1)], max_new_tokens=4)  # then settles "t"
    settle_thread = manager._settler._thread or manager._settler._retired
    engine_thread = manager._engine._loop.thread
    assert {engine_thread.name, settle_thread.name, stream._worker.name} == {
        "kvchat-engine",
        "kvchat-settle",
        "kvchat-stream-s",
    }
    assert {engine_thread, settle_thread, stream._worker} <= daemon_threads._threads
    manager.close()


# The model gets many small tensors, so that freeing it takes a while, each
# giving up the GIL and taking it back; the main thread exits as soon as the
# engine's thread has begun to free it. Before the fix this aborted 10 runs
# of 10.
ENGINE_FREES_THE_MODEL = """
import threading
import weakref

import torch
from kvchat import SessionManager
from kvchat.tiny import tiny_model, tiny_tokenizer

tokenizer = tiny_tokenizer()
model = tiny_model("llama", "tiny", dtype=torch.float32, tokenizer=tokenizer)
model.many = [torch.zeros(1) for _ in range(200_000)]
manager = SessionManager(model, tokenizer)
manager.chat("a", [{"role": "user", "content": "hello"}], max_new_tokens=4, do_sample=False)
manager.wait_settled()
engine_thread = manager._engine._loop.thread
freeing, freed_on = threading.Event(), []


def begins(_):  # called as the model's freeing begins
    freed_on.append(threading.current_thread())
    freeing.set()


watch = weakref.ref(model, begins)
del model, manager  # no close(): the engine's thread ends, holding the model's last reference
freeing.wait()
assert freed_on == [engine_thread], freed_on
"""

# A client that leaves mid-stream, and the process exits: the stream's
# worker stops within a token and commits (the core's lease released, the
# GIL given up) as the interpreter finalizes. Before the worker was one the
# exit waits for, this aborted in about half the runs.
STREAM_LEFT_MID_TURN = """
import torch
from kvchat import SessionManager
from kvchat.tiny import tiny_model, tiny_tokenizer

tokenizer = tiny_tokenizer()
model = tiny_model("llama", "small", dtype=torch.float32, tokenizer=tokenizer)
manager = SessionManager(model, tokenizer)
manager.chat("a", [{"role": "user", "content": "hi"}], max_new_tokens=3)
messages = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "x"},
    {"role": "user", "content": "more"},
]
stream = manager.stream_chat("a", messages, max_new_tokens=50)
next(stream)
del stream, manager, model
"""


@pytest.mark.slow  # a fresh interpreter per run, about 7 s each on 2 cores
@pytest.mark.parametrize(
    "script",
    [ENGINE_FREES_THE_MODEL, ENGINE_FREES_THE_MODEL, STREAM_LEFT_MID_TURN, STREAM_LEFT_MID_TURN],
    ids=["engine-1", "engine-2", "stream-1", "stream-2"],
)
def test_a_process_that_never_closes_exits_cleanly(script):
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
