"""Idle sessions expire: a server's sessions would otherwise keep their
histories forever (the manager bounds caches, not histories)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from starlette.concurrency import run_in_threadpool

from .._C import SessionBusy

logger = logging.getLogger("kvchat.serve")


class IdleExpiry:
    """Removes sessions unused for ``ttl`` seconds; a session in a turn is never
    removed (the manager refuses), and is seen as used when its turn ends."""

    def __init__(self, manager, router, ttl: float):
        self._mgr, self._router, self.ttl = manager, router, ttl
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}

    def touch(self, session: str) -> None:
        with self._lock:
            self._last[session] = time.monotonic()

    def sweep(self) -> int:
        """Removes what has been idle too long; returns how many."""
        now, expired = time.monotonic(), 0
        for session in self._mgr.sessions():
            with self._lock:
                seen = self._last.setdefault(session, now)  # first seen now
            if now - seen < self.ttl:
                continue
            try:
                # Idle here says nothing of other replicas: a shared store keeps it.
                self._mgr.remove(session, local_only=True)
            except (SessionBusy, KeyError):  # in a turn, or already gone
                continue
            with self._lock:
                self._last.pop(session, None)
            self._router.forget(session)
            expired += 1
        if expired:
            logger.info("kvchat serve: %d idle sessions expired", expired)
        return expired

    async def run(self, on_expired) -> None:
        """Sweeps every quarter of the TTL (at most once a minute) until cancelled."""
        while True:
            await asyncio.sleep(min(self.ttl / 4, 60.0))
            on_expired(await run_in_threadpool(self.sweep))
