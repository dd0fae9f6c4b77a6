"""A process that drops a manager without ``close()`` exits cleanly.

Its engine's thread then ends on its own and frees the model as it ends;
the interpreter's exit must wait for that (daemon_threads.py), else Python
ends the thread by ``pthread_exit`` inside torch's tensor deallocator and
the process aborts: "terminate called without an active exception", rc 134
(``make demo`` did, in about half its runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per run, about 7 s each on 2 cores

# The model gets many small tensors, so that freeing it takes a while, each
# giving up the GIL and taking it back; the main thread exits as soon as the
# engine's thread has begun to free it. Before the fix this aborted 10 runs
# of 10.
SCRIPT = """
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


@pytest.mark.parametrize("run", range(2))
def test_exit_waits_for_an_engine_thread_freeing_the_model(run):
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
