"""What a caller's thread has that the engine's thread must be given
(autocast), and what it must not hand over (inference tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def with_callers_autocast(run: Callable[[], object]) -> Callable[[], object]:
    """``run`` under the autocast that is on in this (the caller's) thread.
    Autocast is per thread, so without this work handed to another thread
    (a stream's worker, the engine's) would run without it, unlike the same
    work run where the caller called."""
    on = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                on.append((device, torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError):  # a device type this torch does not know
            continue
    if not on:
        return run

    def under_autocast():
        with contextlib.ExitStack() as stack:
            for device, dtype in on:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            return run()

    return under_autocast


@contextlib.contextmanager
def normal_tensors():
    """Within: tensors made on this thread are normal ones, even under the
    caller's ``torch.inference_mode()``. The caches and checkpoints a turn
    builds here are updated in place on the engine's thread, which is not in
    inference mode, and an inference tensor refuses that."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield
