"""Peak memory during a call: CUDA allocator stats, or sampled RSS on CPU."""

from __future__ import annotations

import os
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def tensor_bytes(tensors) -> int:
    """Distinct storage bytes behind ``tensors`` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakMemory:
    """``with PeakMemory(device) as peak: ...``; then ``peak.extra_bytes`` is the
    most memory the block used above what was in use when it started."""

    def __init__(self, device: torch.device, interval_s: float = 0.001):
        self._cuda = torch.device(device).type == "cuda"
        self._interval = interval_s
        self.extra_bytes = 0

    def __enter__(self):
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        self._start = self._peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, rss_bytes())

    def __exit__(self, *exc):
        if self._cuda:
            torch.cuda.synchronize()
            self.extra_bytes = torch.cuda.max_memory_allocated() - self._start
            return False
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes())
        self.extra_bytes = self._peak - self._start
        return False
