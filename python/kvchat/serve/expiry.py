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
    """Removes sessions unused for ``ttl`` seconds. A session with a request in
    progress (in its turn, or its reply still being sent to a slow reader) is
    never removed; it is seen as used when its last request ends.

    The table holds only sessions that exist (and those with a request in
    progress): a refused request, or a session deleted, leaves nothing behind."""

    def __init__(self, manager, router, ttl: float):
        self._mgr, self._router, self.ttl = manager, router, ttl
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # session -> when it was last used
        self._busy: dict[str, int] = {}  # session -> its requests in progress

    def begin(self, session: str) -> None:
        """A request on ``session`` starts: it cannot expire until end()."""
        with self._lock:
            self._busy[session] = self._busy.get(session, 0) + 1

    def end(self, session: str) -> None:
        """The request begun on ``session`` is done (answered, refused or gone)."""
        exists = self._exists(session)
        with self._lock:
            left = self._busy.get(session, 1) - 1
            if left > 0:
                self._busy[session] = left
            else:
                self._busy.pop(session, None)
            if exists and self.ttl > 0:
                self._last[session] = time.monotonic()
            elif left <= 0:
                self._last.pop(session, None)

    def forget(self, session: str) -> None:
        """``session`` was deleted."""
        with self._lock:
            self._last.pop(session, None)

    def tracked(self) -> set[str]:
        """The sessions the table holds (for tests and metrics)."""
        with self._lock:
            return set(self._last) | set(self._busy)

    def _exists(self, session: str) -> bool:
        try:
            self._mgr.info(session)
        except KeyError:
            return False
        return True

    def sweep(self) -> int:
        """Removes what has been idle too long; returns how many."""
        now, expired = time.monotonic(), 0
        sessions = self._mgr.sessions()
        for session in sessions:
            # Checked and removed under the lock: a request that begins on it
            # meanwhile either keeps it or finds it gone, never half of each.
            with self._lock:
                if self._busy.get(session):
                    continue
                seen = self._last.setdefault(session, now)  # first seen now
                if now - seen < self.ttl:
                    continue
                try:
                    # Idle here says nothing of other replicas: a shared store keeps it.
                    self._mgr.remove(session, local_only=True)
                except (SessionBusy, KeyError):  # in a turn, or already gone
                    continue
                self._last.pop(session, None)
            self._router.forget(session)
            expired += 1
        with self._lock:  # sessions removed otherwise (deleted, say) leave the table
            for session in set(self._last).difference(sessions, self._busy):
                del self._last[session]
        if expired:
            logger.info("kvchat serve: %d idle sessions expired", expired)
        return expired

    async def run(self, on_expired) -> None:
        """Sweeps every quarter of the TTL (at most once a minute) until cancelled."""
        while True:
            await asyncio.sleep(min(self.ttl / 4, 60.0))
            on_expired(await run_in_threadpool(self.sweep))
