"""Stored responses in this process (no shared store): per API key, the newest
records that fit its bounds in count and bytes, each for ``ttl`` seconds."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class _Key:
    """One key's records, oldest first: rid -> (expiry or None, data)."""

    __slots__ = ("records", "nbytes")

    def __init__(self):
        self.records: OrderedDict[str, tuple[float | None, bytes]] = OrderedDict()
        self.nbytes = 0

    def pop_oldest(self) -> None:
        _, (_, data) = self.records.popitem(last=False)
        self.nbytes -= len(data)

    def expire(self, now: float) -> None:
        """Drops the expired records: the oldest, since every one lives as long."""
        while self.records:
            expires, _ = next(iter(self.records.values()))
            if expires is None or expires > now:
                return
            self.pop_oldest()


class LocalResponses:
    """``Responses`` (serve/store.py) in this process's memory. ``limits``: a
    ``ResponseLimits``. A key's put evicts that key's oldest records until it
    is within its bounds again (never the record just put); other keys'
    records are never touched."""

    def __init__(self, limits):
        self._limits = limits
        self._lock = threading.Lock()
        self._keys: dict[str, _Key] = {}

    def put(self, ns: str, rid: str, data: bytes) -> int:
        ttl = self._limits.ttl
        now = time.monotonic()
        with self._lock:
            key = self._keys.setdefault(ns, _Key())
            key.expire(now)
            old = key.records.pop(rid, None)
            if old is not None:
                key.nbytes -= len(old[1])
            key.records[rid] = (None if ttl is None else now + ttl, data)
            key.nbytes += len(data)
            evicted = 0
            while len(key.records) > 1 and (
                len(key.records) > self._limits.per_key or key.nbytes > self._limits.bytes_per_key
            ):
                key.pop_oldest()
                evicted += 1
            return evicted

    def get(self, ns: str, rid: str) -> bytes | None:
        with self._lock:
            key = self._keys.get(ns)
            if key is None:
                return None
            key.expire(time.monotonic())
            found = key.records.get(rid)
            return None if found is None else found[1]

    def delete(self, ns: str, rid: str) -> bool:
        with self._lock:
            key = self._keys.get(ns)
            if key is not None:
                key.expire(time.monotonic())  # an expired response is a 404 here too
            found = None if key is None else key.records.pop(rid, None)
            if found is None:
                return False
            key.nbytes -= len(found[1])
            if not key.records:
                del self._keys[ns]
            return True

    def totals(self) -> tuple[int, int]:
        now = time.monotonic()
        with self._lock:
            for ns, key in list(self._keys.items()):
                key.expire(now)
                if not key.records:
                    del self._keys[ns]
            keys = self._keys.values()
            return sum(len(k.records) for k in keys), sum(k.nbytes for k in keys)
