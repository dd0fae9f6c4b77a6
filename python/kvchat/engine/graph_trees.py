"""torch.compile's CUDA graph trees on kvchat's threads.

With CUDA graphs (kvchat's compiled decode on a GPU), inductor keeps its
graph trees' state per thread: two objects (the tree managers, one per
device, and their locks) in a ``threading.local``
(``cudagraph_trees.local``), and the same two in torch's C++ thread-local
state (``torch._C._stash_obj_in_tls``, "the stash"), which autograd's
threads inherit. The module fills both for the thread that imports it. On
any other thread a compiled forward fails an assertion (torch 2.11), or
torch fills both there at its first ``get_obj`` (torch 2.13). kvchat
compiles and captures on the engine's thread, not the one that made the
manager.

In torch 2.11 (not 2.13) the stash takes no reference of its own (its
``SafePyObject`` steals the caller's), yet the thread's C++ state drops
one when the thread ends: once a thread that stashed has ended, the two
objects are a reference short and are freed while still in use. On an
H200 that showed as segmentation faults in the garbage collector and "bad
argument to internal function" errors, tests after tests, once engine
threads had come and gone. ``_stash_steals`` asks the torch at hand
whether its stash does that (once, with a probe).

What kvchat does:

- ``import_here``, from ``Engine()`` for a model on CUDA, on the caller's
  thread: imports the module there (so that thread, usually where the
  user's own compiled ``generate`` runs, has its state), and where the
  stash steals, adds the references it should have taken. That thread may
  end without harm: ``kvchat serve`` builds its manager on one that does;
- ``set_up_engine_thread``, first thing on every engine thread: once the
  module is imported, gives the thread its own two objects in the
  ``threading.local`` only, so torch never stashes there. The engine runs
  no backward, so no autograd thread needs the stash;
- ``before_engine_thread_ends``, last thing there: should torch have
  stashed on the thread all the same (the module first imported there, by
  a compile), adds the references that stash should have taken.
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
    yet, and where the stash steals, adds the references its import-time
    stash should have taken (a small, deliberate leak: the two objects live
    as long as the process)."""
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
    """Where the stash steals, adds a reference to what torch stashed on
    this thread, as its C++ state drops one when the thread ends (the
    module's docstring)."""
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
