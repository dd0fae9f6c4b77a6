"""The Redis tier's one background thread: it writes snapshots, off the turns'
critical path, and does what else must not make a caller wait on Redis (owed
route changes, the held marks' refresh and removal).

Per session only the newest pending snapshot is kept: an older one not yet
written is dropped, as the newer one supersedes it. A snapshot's chunks are
uploaded first (only those Redis lacks), then its manifest is published by one
script that refreshes every chunk's TTL and publishes nothing if a chunk is
gone or the session was deleted since its copy here began, so a reader never
sees a manifest whose chunks were not all there, nor a deleted session back.

This thread runs no torch op that starts an OpenMP team: a second team's idle
workers slow every op of the turns (60% per token). The snapshot it gets is a
description made on the turn's thread (``encode_state``), cut with numpy.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

from .chunks import encode_snapshot
from .copies import epoch_arg

logger = logging.getLogger("kvchat")

FETCH_BATCH = 64  # keys per MGET (and chunk reads): 256 MiB at the default chunk_bytes


class Unpublished(Exception):
    """A snapshot whose chunks kept disappearing (maxmemory): not published."""


class Writer:
    def __init__(self, tier, cond: threading.Condition):
        self._tier, self._cond = tier, cond
        self._conn, self._keys = tier.conn, tier.keys
        self._copies, self._routes = tier.copies, tier.routes
        # Per session, the newest snapshot not yet written.
        self.pending: OrderedDict[str, tuple] = OrderedDict()
        self.writing: str | None = None  # the session being written now
        self.closed = False
        self.write_errors = self.chunks_written = self.bytes_written = 0
        self.thread = threading.Thread(target=self._loop, name="kvchat-store", daemon=True)
        self.thread.start()

    def enqueue(self, session_id: str, job: tuple) -> None:
        """``job``: (layout, tensors, messages, epoch), as ``encode_state`` and
        ``Copies.epoch_of`` give them."""
        with self._cond:
            if self.closed:
                return
            self.pending.pop(session_id, None)  # superseded: only the newest is written
            self.pending[session_id] = job
            self._cond.notify_all()

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits until every snapshot queued so far (or ``session_id``'s) is
        written or failed. Returns False if ``timeout`` seconds passed first."""

        def done() -> bool:
            if session_id is None:
                return not self.pending and self.writing is None
            return session_id not in self.pending and self.writing != session_id

        with self._cond:
            return self._cond.wait_for(done, timeout)

    def close(self, timeout: float | None) -> None:
        """Writes what is queued, makes the route changes and mark removals
        owed (waiting, within ``timeout``, for a store that rests after a
        failure), then stops the thread."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        def settled() -> bool:
            return not (self._routes.owed or self._copies.releasing)

        self.flush(left())
        with self._cond:
            if not settled():
                # Until the rest ends, and a second for the writer's round trip;
                # leaving the writer one call's time to end within the timeout.
                wait = max(self._conn.down_until - time.monotonic(), 0.0) + 1.0
                if deadline is not None:
                    wait = min(wait, max(left() - self._conn.call_timeout, 0.0))
                self._cond.wait_for(settled, wait)
            self.closed = True
            self._cond.notify_all()
        self.thread.join(left())

    def _next_work(self) -> str:
        """Under the lock: waits for the next work, the most urgent first:
        owed route changes once the store is back ("owed"), marks of copies
        that ended ("release"), the time to refresh the held marks
        ("refresh"), a snapshot to write ("write"), or close ("close"). So a
        steady stream of snapshots never starves the others."""
        copies, owed = self._copies, self._routes.owed
        while True:
            now = time.monotonic()
            back = now >= self._conn.down_until
            if owed and back:
                return "owed"
            if copies.releasing and back:
                return "release"
            if copies.epochs and now >= copies.next_refresh:
                return "refresh"
            if self.pending:
                return "write"
            if self.closed:
                return "close"
            deadline = copies.next_refresh if copies.epochs else None
            if owed or copies.releasing:
                deadline = min(deadline or self._conn.down_until, self._conn.down_until)
            self._cond.wait(None if deadline is None else max(deadline - now, 0.01))

    def _loop(self) -> None:
        while True:
            with self._cond:
                work = self._next_work()
                if work == "close":
                    return
                if work == "write":
                    session_id, job = self.pending.popitem(last=False)
                    self.writing = session_id
            if work == "owed":
                with self._routes.lock:
                    self._routes.pay_owed()
            elif work == "release":
                self._copies.release_marks()
            elif work == "refresh":
                copies = self._copies
                if self._conn.available():
                    copies.next_refresh = time.monotonic() + copies.refresh_every()
                    copies.refresh()
                else:  # once the store is back
                    copies.next_refresh = max(self._conn.down_until, time.monotonic() + 0.01)
                continue
            else:
                self._write_one(session_id, job)
                del job  # the tensors go here, outside any lock
            with self._cond:
                if work == "write":
                    self.writing = None
                self._cond.notify_all()  # close() and flush() may wait for it

    def _write_one(self, session_id: str, job: tuple) -> None:
        try:
            if not self._conn.available():
                self.write_errors += 1  # Redis is resting: this snapshot is lost
            elif job[0] is not None:
                self.write(session_id, *job)
        except self._conn.errors as error:
            self.write_errors += 1
            self._conn.failed(f"write of session {session_id!r}", error)
        except Unpublished as error:
            self.write_errors += 1
            logger.warning("kvchat: session %r not stored: %s", session_id, error)
        except Exception:  # a bug here must not kill the writer
            self.write_errors += 1
            logger.exception("kvchat: storing session %r failed", session_id)

    def write(self, session_id: str, layout: dict, tensors: dict, messages: list, epoch) -> None:
        """Uploads the snapshot's missing chunks, then publishes its manifest."""
        tier, keys = self._tier, self._keys
        manifest, chunks = encode_snapshot(
            layout,
            tensors,
            session_id=session_id,
            model=keys.model,
            fingerprint=tier.fingerprint,
            messages=messages,
            block_tokens=tier.block_tokens,
            chunk_bytes=tier.chunk_bytes,
        )
        client = self._conn.client
        chunk_keys = [keys.chunk(d, session_id) for d in chunks]
        # Upload only the chunks Redis lacks (a prefix's blocks are there already).
        with client.pipeline(transaction=False) as pipe:
            for key in chunk_keys:
                pipe.exists(key)
            present = pipe.execute()
        missing = [d for d, there in zip(chunks, present, strict=True) if not there]
        head = [
            keys.manifest(session_id),
            keys.tombstone(session_id),
            keys.index(session_id),
            keys.chunks_of(session_id),
        ]
        args = [json.dumps(manifest), tier.ttl, epoch_arg(epoch), manifest["written_at"]]
        for _attempt in range(2):
            with client.pipeline(transaction=False) as pipe:
                for digest in missing:
                    pipe.set(keys.chunk(digest, session_id), chunks[digest], ex=tier.ttl)
                pipe.execute()
            self.chunks_written += len(missing)
            self.bytes_written += sum(len(chunks[d]) for d in missing)
            gone = self._conn.publish(keys=[*head, *chunk_keys], args=args)
            if gone == -1:  # deleted since this copy began: never brought back
                logger.info("kvchat: session %r was deleted; its snapshot is dropped", session_id)
                self.collect(session_id, chunks)
                return
            if not gone:
                tier.writes += 1
                return
            # Evicted between upload and publish (maxmemory): upload those again, once.
            missing = [list(chunks)[int(i) - 1] for i in gone]
        raise Unpublished(f"{len(missing)} chunks were evicted while publishing")

    def collect(self, session_id: str, digests) -> None:
        """Deletes those of ``digests`` (chunks of the session's scope) that no
        live manifest of the scope lists. Atomic against publishes (WATCH on the
        scope's index, which every publish writes): a snapshot published in
        between is seen, or the deletion is tried again."""
        index = self._keys.index(session_id)
        for _attempt in range(3):
            try:
                with self._conn.client.pipeline(transaction=True) as pipe:
                    pipe.watch(index)
                    names = pipe.hkeys(index)
                    used, stale = set(), []
                    for i in range(0, len(names), FETCH_BATCH):
                        batch = names[i : i + FETCH_BATCH]
                        for name, raw in zip(batch, pipe.mget(batch), strict=True):
                            if raw is None:
                                stale.append(name)  # expired or evicted
                                continue
                            entries = json.loads(raw)["tensors"].values()
                            used.update(d for e in entries for d in e["chunks"])
                    doomed = [self._keys.chunk(d, session_id) for d in digests if d not in used]
                    pipe.multi()
                    for i in range(0, len(doomed), 1024):
                        pipe.delete(*doomed[i : i + 1024])
                    if stale:
                        pipe.hdel(index, *stale)
                    pipe.execute()
                    return
            except self._conn.watch_error:
                continue
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                logger.warning(
                    "kvchat: chunks of session %r left to expire: a manifest of its scope "
                    "is unreadable (%s)",
                    session_id,
                    error,
                )
                return
            except self._conn.errors as error:
                self._conn.failed(f"chunk deletion of session {session_id!r}", error)
                return
        logger.info("kvchat: chunks of session %r left to expire (busy scope)", session_id)
