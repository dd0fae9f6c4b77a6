"""Counting what torch.compile does for kvchat's compiled decode.

torch calls its compilation callbacks (``torch._dynamo.callback_handler``)
on the thread that compiles, at the start and end of each frame dynamo
compiles and of each CUDA graph recorded. A ``CompileWatch`` registers
callbacks for as long as it is entered and counts only what its own thread
compiles, so a compiled turn, which runs alone on the engine's thread,
learns exactly what it compiled: the user's own compiles on other threads
are not counted. Registered per turn rather than once: ``torch._dynamo.reset()``
clears every callback.

What is counted: ``compiles``, the frames dynamo compiled (graph breaks make
more than one per forward); ``recompiles``, those of a function dynamo had
compiled before (a guard failed: a shape, a dtype, an attribute changed);
``seconds`` spent compiling; ``cuda_graph_records``, CUDA graphs recorded
(on a GPU with ``mode="reduce-overhead"``).

torch runs only the outermost of overlapping compilations' callbacks: while
another thread compiles, a compile on this one can go uncounted.
"""

from __future__ import annotations

import threading
import time

try:
    from torch._dynamo.callback import CallbackTrigger, callback_handler
except ImportError:  # a torch without the callbacks: nothing is counted
    CallbackTrigger = callback_handler = None


class CompileWatch:
    """While entered, counts the compiles of the thread that entered it."""

    def __init__(self):
        self.compiles = 0
        self.recompiles = 0
        self.seconds = 0.0
        self.cuda_graph_records = 0
        self._thread: int | None = None
        self._started: float | None = None

    def __enter__(self) -> CompileWatch:
        self._thread = threading.get_ident()
        if callback_handler is not None:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc) -> None:
        if callback_handler is None:
            return
        for remove, callback in (
            (callback_handler.remove_start_callback, self._start),
            (callback_handler.remove_end_callback, self._end),
        ):
            try:
                remove(callback)
            except ValueError:  # torch._dynamo.reset() cleared it
                pass

    def _start(self, args) -> None:
        if threading.get_ident() == self._thread:
            self._started = time.perf_counter()

    def _end(self, args) -> None:
        if threading.get_ident() != self._thread or self._started is None:
            return
        elapsed, self._started = time.perf_counter() - self._started, None
        if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            self.cuda_graph_records += 1
            return
        if args.callback_trigger != CallbackTrigger.DYNAMO:
            return
        self.compiles += 1
        self.recompiles += _frame_compile(args.compile_id) > 0
        self.seconds += elapsed


def _frame_compile(compile_id: str) -> int:
    """How many times dynamo had compiled this frame before ("3/1": frame 3,
    compiled once before); 0 if the id reads otherwise."""
    try:
        return int(str(compile_id).rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return 0
