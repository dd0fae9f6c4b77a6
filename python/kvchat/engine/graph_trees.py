"""torch.compile's CUDA graph trees on kvchat's threads.

inductor keeps its CUDA graph trees' managers per thread: in a
``threading.local`` (``cudagraph_trees.local``), which the module fills for
the thread that imports it, and in torch's C++ thread-local state
(``torch._C._stash_obj_in_tls``), so that autograd's threads see them too.
A compiled forward on any other thread fails an assertion (torch 2.11) or
fills them there (later torch).

In torch 2.11 (not 2.13) the stash is unsafe on a thread that ends: it
hands C++ a pointer without a reference of its own (``SafePyObject`` steals
one), and the thread's C++ state drops that reference when the thread ends,
so the two objects lose a reference they never had and are freed while
still in use. On CUDA that showed as segmentation faults in the garbage
collector and "bad argument to internal function" errors, tests after
tests, once engine threads had come and gone. torch stashes on the
importing thread, and on any later thread its own ``get_obj`` meets first.
``_stash_steals`` asks the torch at hand which it does.

So, for a model on CUDA:

- ``import_here`` (on the thread that makes the engine, which outlives it
  in every ordinary program): imports the module there, before the
  engine's thread could, and gives the stash the references it took;
- ``set_up_engine_thread`` (first thing on the engine's thread): fills the
  thread-local attributes only, so torch never stashes there. The engine
  runs no backward, so no autograd thread needs the stash;
- ``before_engine_thread_ends`` (last thing there): should torch have
  stashed on it all the same (the module first imported there, by a
  compile), owns the references that stash took before the thread ends.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
import threading

_MODULE = "torch._inductor.cudagraph_trees"
_NAMES = ("tree_manager_containers", "tree_manager_locks")


def import_here() -> None:
    """Imports inductor's CUDA graph trees on this thread if no thread has
    yet, and owns the references its import-time stash took (a small,
    deliberate leak: they live as long as the process)."""
    if _MODULE in sys.modules:
        return
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:  # a torch without inductor compiles nothing
        return
    local = getattr(cudagraph_trees, "local", None)
    if not _stash_steals():
        return
    for name in _NAMES:
        value = getattr(local, name, None)
        if value is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(value))


def set_up_engine_thread() -> None:
    """Gives this thread its own graph-tree state, in Python only (no stash),
    if the module is imported and the thread has none."""
    module = sys.modules.get(_MODULE)
    local = getattr(module, "local", None)
    if local is None or hasattr(local, _NAMES[0]):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)


def before_engine_thread_ends() -> None:
    """Owns the references of what torch stashed on this thread, which its
    C++ state drops as the thread ends (the module's docstring)."""
    import torch

    stashed = [name for name in _NAMES if torch._C._is_key_in_tls(name)]
    # Asked only then: the probe would leave an object of its own here, which
    # the thread's end frees under the GIL (at the interpreter's exit that
    # aborted the process now and then).
    if not stashed or not _stash_steals():
        return
    for name in stashed:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(torch._C._get_obj_in_tls(name)))


@functools.cache
def _stash_steals() -> bool:
    """Whether this torch's ``_stash_obj_in_tls`` takes no reference of its
    own (torch 2.11). Asked once, by stashing a probe on this thread (given
    the reference the stash took, if it took one it did not own)."""
    import torch

    probe = [None]
    before = sys.getrefcount(probe)
    torch._C._stash_obj_in_tls("kvchat.stash_probe", probe)
    steals = sys.getrefcount(probe) == before
    if steals:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))
    return steals
