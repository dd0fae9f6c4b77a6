"""The engine's thread and torch's CUDA graph trees (engine/graph_trees.py).

torch stashes the graph trees' per-thread objects in its C++ thread-local
state without a reference of its own, and drops one when that thread ends.
On a GPU an engine thread that imported the module (or stashed there) and
then ended left them one reference short: freed while in use, then
segmentation faults in the garbage collector, tests after tests. Each
check runs in a fresh interpreter, where the module is not yet imported
and a fault cannot take the test run down. No GPU is needed: the stash and
its drop are the same on a CPU build. torch 2.13's stash takes a reference
of its own; each check also runs with the stash as torch 2.11 has it (it
takes none), where the checks failed before graph_trees.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Each script prints the references left, at the end, on what the ended
# thread was given: 2 is sys.getrefcount's own and the script's.
_PRELUDE = """
import ctypes, sys, threading, time, torch
from kvchat.engine import graph_trees
kept = {}
native = torch._C._stash_obj_in_tls
probe = [None]
before = sys.getrefcount(probe)
native("test.probe", probe)
STEALS = sys.getrefcount(probe) == before
if STEALS:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))
if EMULATE_2_11 and not STEALS:
    def stealing(key, obj):  # as torch 2.11's: the stash owns no reference
        native(key, obj)
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(obj))
    torch._C._stash_obj_in_tls = stealing
def in_a_thread(body):
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    time.sleep(0.5)  # the thread's C++ state ends just after join returns
"""


STASHES = pytest.mark.parametrize("emulate", [False, True], ids=["this-torch", "torch-2.11"])


def _run(script: str, emulate: bool) -> str:
    code = f"EMULATE_2_11 = {emulate}\n" + _PRELUDE + textwrap.dedent(script)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@STASHES
def test_a_thread_that_imports_the_graph_trees_and_ends_leaves_them_whole(emulate):
    """``import_here`` on a thread that then ends (an engine made on a
    short-lived thread): the objects the import stashed stay alive."""
    out = _run(
        """
        def body():
            graph_trees.import_here()
            from torch._inductor import cudagraph_trees
            kept["containers"] = cudagraph_trees.local.tree_manager_containers
            kept["locks"] = cudagraph_trees.local.tree_manager_locks
            assert torch._C._is_key_in_tls("tree_manager_containers")  # torch stashed here
        in_a_thread(body)
        print(sys.getrefcount(kept["containers"]), sys.getrefcount(kept["locks"]))
        """,
        emulate,
    )
    assert out == "2 2", out


@STASHES
def test_the_engine_thread_gets_graph_trees_without_a_stash(emulate):
    """``set_up_engine_thread``: the thread gets its own objects in Python
    only, so torch never stashes there (its ``get_obj`` would otherwise)."""
    out = _run(
        """
        from torch._inductor import cudagraph_trees  # imported here, on the main thread
        def body():
            graph_trees.set_up_engine_thread()
            local = cudagraph_trees.local
            kept["containers"] = local.tree_manager_containers
            kept["stashed"] = torch._C._is_key_in_tls("tree_manager_containers")
            kept["same"] = cudagraph_trees.get_obj(local, "tree_manager_containers") is (
                kept["containers"]
            )
        in_a_thread(body)
        print(kept["stashed"], kept["same"], sys.getrefcount(kept["containers"]))
        """,
        emulate,
    )
    assert out == "False True 2", out


@STASHES
def test_a_stash_on_the_engine_thread_is_owned_before_it_ends(emulate):
    """``before_engine_thread_ends``: what torch stashed on the thread all the
    same (the module imported there by a compile) keeps its references
    when the thread ends. Without it the object lost one it never had."""
    out = _run(
        """
        def body(balance):
            obj = {"a": 1}
            torch._C._stash_obj_in_tls("tree_manager_containers", obj)  # as torch's import does
            kept[balance] = obj
            if balance:
                graph_trees.before_engine_thread_ends()
        in_a_thread(lambda: body(True))
        print(sys.getrefcount(kept[True]))
        """,
        emulate,
    )
    assert out == "2", out


@STASHES
def test_an_engine_thread_that_compiled_nothing_leaves_nothing_in_torchs_thread_state(emulate):
    """A CPU manager's engine thread, its turn done and the manager closed:
    nothing was stashed on it, so torch's C++ state has no Python object to
    free when the thread ends. Freeing one there takes the GIL; at the
    interpreter's exit (a script that never closes its manager, whose engine
    thread the exit ends) that aborted the process now and then ("terminate
    called without an active exception"). It stashed a probe
    (``_stash_steals``) there before."""
    out = _run(
        """
        from kvchat import SessionManager
        from kvchat.tiny import tiny_model, tiny_tokenizer
        stashed_on = []
        stash = torch._C._stash_obj_in_tls
        def recording(key, obj):
            stashed_on.append(threading.current_thread().name)
            stash(key, obj)
        torch._C._stash_obj_in_tls = recording
        manager = SessionManager(tiny_model("llama"), tiny_tokenizer(), settle=False)
        manager.chat("a", [{"role": "user", "content": "Hello"}], max_new_tokens=2)
        manager.close()
        print(stashed_on)
        """,
        emulate,
    )
    assert out == "[]", out
