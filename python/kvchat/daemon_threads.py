"""kvchat's daemon threads (the engine's, the settler's, a stream's
worker): the interpreter's exit waits until each has ended.

Why: once the interpreter finalizes, Python ends a daemon thread the next
time that thread takes the GIL, by ``pthread_exit``, whose unwinding aborts
the process ("terminate called without an active exception") when it
crosses a C++ frame that must not throw. torch's tensor deallocator is one,
and it gives up the GIL while it frees a tensor. So a daemon thread must not
be freeing tensors as the interpreter finalizes, and one of ours can be: an
engine whose manager was dropped without ``close()`` ends its thread, which
holds the model's last reference and frees it as it ends (``Thread.run``
deletes its target), while the main thread goes on to exit; the atexit hook
that closes live engines no longer sees that one (its loop is being freed).
A stream's worker whose consumer left may still be ending its turn (its
lease's release gives up the GIL too).

So our threads start here, and ``_join_all``, run at exit after the owners'
own hooks told their threads to end (a stream's turn fails once its engine
is closed), waits for each to end, frees included.
An owner imports this module before it registers its hook: atexit runs the
hooks in reverse order, so the owners' run first.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

_lock = threading.Lock()
_threads: set[threading.Thread] = set()
_joining = False  # _join_all began: no thread of ours starts again


def start(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """Runs ``target(*args)`` on a new daemon thread that the interpreter's
    exit waits for; its owner makes it end at exit. RuntimeError once exit
    is waiting for them."""
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    with _lock:
        if _joining:
            raise RuntimeError(f"the interpreter is exiting: no {name} thread starts")
        _threads.difference_update([t for t in _threads if not t.is_alive()])
        _threads.add(thread)
        thread.start()  # under the lock: the pruning above never takes one not yet started
    return thread


@atexit.register
def _join_all() -> None:
    global _joining
    with _lock:
        _joining = True
        threads = list(_threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
