"""Which sessions this process holds a copy of, and whether another process
deleted one since its copy here began: held marks and tombstones.

- **Held marks** (``Keys.held``, for ``ttl``, and a set of the processes per
  session): each process marks the sessions it holds a copy of when the copy
  begins a turn, keeps the marks alive while the copies last (the writer
  thread refreshes them every ``ttl / 4``, but not one of a copy deleted since
  it began: that copy is remembered as deleted, so its next turn drops it even
  once the tombstone has expired) and removes its mark when its copy ends
  without a delete (``released``, also on the writer thread: a caller never
  waits on Redis for it). A mark holds its copy's token: a refresh never
  overwrites a newer copy's mark, and a removal removes only its own copy's.
  A copy that begins while Redis cannot say which tombstone it began under is
  marked once Redis is back, and any tombstone found later counts as its
  delete. So a delete on a process that holds nothing of a session still
  reaches every process that does, even with no snapshot stored.
- **Tombstones** (``Keys.tombstone``, a random token, for ``ttl``): each
  process remembers the tombstone it saw when a session's copy here began (its
  *epoch*); a turn (or ``kvchat serve``'s GET or listing) that finds another
  one drops the copy here first, and a snapshot or route written for an older
  copy is never published (the scripts compare epochs).

Fields are guarded by the tier's condition ``cond``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

logger = logging.getLogger("kvchat")

_TOMBSTONE_BATCH = 512  # tombstones per MGET when a listing asks after many sessions

# A copy here whose session was deleted elsewhere, seen by the marks' refresh:
# its next turn drops it even after the tombstone has expired.
GONE = object()
# A copy here that began while Redis could not say which tombstone it began
# under: any tombstone found later counts as a delete of it. So a session
# deleted, then used again under the same id while Redis could not answer, is
# taken for deleted once Redis is back: its copy here is dropped (GET and
# listings no longer show it, its history here goes; the next turn prefills
# the whole conversation its client sends), and no snapshot of it is stored
# until the old tombstone expires. Safer than serving a deleted session.
UNKNOWN = object()


def epoch_arg(epoch) -> bytes:
    """An epoch as the Lua scripts compare it: '' for none; for a copy begun
    unknown, a value no tombstone ever equals."""
    if epoch is None:
        return b""
    return b"~unknown" if epoch is UNKNOWN else epoch


class Copies:
    """The copies this process holds, their epochs and held marks."""

    def __init__(self, conn, keys, ttl: int, cond: threading.Condition):
        self._conn, self._keys, self._ttl, self._cond = conn, keys, ttl, cond
        # Per session held here: the tombstone its copy here began under (None:
        # none). Entries go when the copy here ends (forget, released), so it
        # holds no more than this process's sessions, whatever is deleted.
        self.epochs: dict[str, bytes | None] = {}
        self._turn_epoch = threading.local()  # what this thread's turn saw
        # This process's mark on the sessions it holds: per copy here, the
        # token its mark holds (a copy begun anew marks it anew); and per copy
        # that ended, the token of the mark to remove (the writer removes them:
        # the caller may hold a lock the event loop waits on).
        self.marks: dict[str, bytes] = {}
        self.releasing: dict[str, bytes] = {}
        self.next_refresh = time.monotonic() + self.refresh_every()

    def refresh_every(self) -> float:
        return min(max(self._ttl / 4, 0.25), 3600.0)

    def epoch_of(self, session_id: str, this_turn: bool = False):
        """The epoch of the session's copy here; ``this_turn``: the one this
        thread's turn began under, if it saw one (a delete since refuses what
        the turn writes)."""
        seen = getattr(self._turn_epoch, "seen", None) if this_turn else None
        if seen is not None and seen[0] == session_id:
            return seen[1]
        with self._cond:
            return self.epochs.get(session_id)

    def drop(self, session_id: str) -> None:
        """Under the lock: the session was deleted here; a copy begins anew, if
        ever, and the delete removed every mark."""
        self.epochs.pop(session_id, None)
        self.marks.pop(session_id, None)
        self.releasing.pop(session_id, None)

    def deleted_since(self, session_id: str, update: bool = True) -> bool:
        """Whether the session was deleted (on any replica) since its copy here
        began: the store holds a tombstone other than the one this process saw
        then, or the marks' refresh saw one (that may have expired since).
        ``update``: the copy here is dropped (or begins) now; remember the
        tombstone. When Redis cannot say, only what the refresh saw counts
        (and with ``update`` the copy here then begins unknown); never raises."""
        token = None
        if update:
            self._turn_epoch.seen = None  # nothing an earlier turn on this thread saw
            with self._cond:  # one token per copy: a copy's mark is the same all along
                token = self.marks.get(session_id) or secrets.token_hex(8).encode()
        found = self._tombstones([session_id], held=(session_id, token) if update else None)
        if found is None:
            with self._cond:
                gone = self.epochs.get(session_id, None) is GONE
                if update:
                    if gone:  # dropped now: a new copy begins; no mark of the old is left
                        self.marks.pop(session_id, None)
                        token = secrets.token_hex(8).encode()
                    if gone or session_id not in self.epochs:
                        # Begun unknown: the refresh marks it once Redis is back,
                        # and any tombstone found later is a delete of it.
                        self.epochs[session_id] = UNKNOWN
                        self.marks[session_id] = token
                        self.next_refresh = min(self.next_refresh, time.monotonic())
                        self._cond.notify_all()
            return gone
        (found,) = found
        with self._cond:
            deleted = self.deleted(session_id, found)
            if update:
                if not self.epochs:  # the writer may sleep with no mark to refresh
                    self._cond.notify_all()
                self.epochs[session_id] = found
                self.marks[session_id] = token
        if update:
            self._turn_epoch.seen = (session_id, found)
        return deleted

    def deleted_among(self, session_ids: list[str]) -> set[str]:
        found = self._tombstones(session_ids)
        if found is None:  # only what the marks' refresh saw
            with self._cond:
                return {s for s in session_ids if self.epochs.get(s, None) is GONE}
        with self._cond:
            return {s for s, f in zip(session_ids, found, strict=True) if self.deleted(s, f)}

    def deleted(self, session_id: str, found: bytes | None) -> bool:
        """Under the lock: whether tombstone ``found`` is newer than the copy
        here, or the refresh saw one that has expired since."""
        if session_id not in self.epochs:
            return False
        epoch = self.epochs[session_id]
        return epoch is GONE or (found is not None and (epoch is UNKNOWN or epoch != found))

    def _tombstones(
        self, session_ids: list[str], held: tuple[str, bytes] | None = None
    ) -> list[bytes | None] | None:
        """The sessions' tombstones (None: none), or None when Redis cannot say.
        ``held``: (a session whose copy here begins a turn, its mark token);
        its held mark is set in the same round trip."""
        if not self._conn.available():
            return None
        found = []
        try:
            if held is not None:
                pipe = self._conn.client.pipeline(transaction=False)
                pipe.mget([self._keys.tombstone(s) for s in session_ids])
                session_id, token = held
                holders = self._keys.holders(session_id)
                pipe.set(self._keys.held(session_id), token, ex=self._ttl)
                pipe.sadd(holders, self._keys.holder)
                pipe.expire(holders, self._ttl)
                return pipe.execute()[0]
            for start in range(0, len(session_ids), _TOMBSTONE_BATCH):
                batch = session_ids[start : start + _TOMBSTONE_BATCH]
                found += self._conn.client.mget([self._keys.tombstone(s) for s in batch])
        except self._conn.errors as error:
            self._conn.failed("tombstone read", error)
            return None
        except Exception:  # never into a turn
            logger.exception("kvchat: tombstone read failed")
            return None
        return found

    def refresh(self) -> None:
        """On the writer thread: keeps the held marks of the copies here alive,
        but not of those deleted elsewhere since they began: each of those is
        remembered as deleted (its tombstone may expire before its next turn,
        which must still drop it). A copy that ends meanwhile has its mark
        removed after this (by token), on this thread."""
        with self._cond:
            held = [
                (s, e, self.marks[s])
                for s, e in self.epochs.items()
                if e is not GONE and s in self.marks
            ]
        try:
            for start in range(0, len(held), _TOMBSTONE_BATCH):
                batch = held[start : start + _TOMBSTONE_BATCH]
                keys, args = [], [self._ttl, self._keys.holder]
                for session_id, epoch, token in batch:
                    keys += [
                        self._keys.held(session_id),
                        self._keys.holders(session_id),
                        self._keys.tombstone(session_id),
                    ]
                    args += [epoch_arg(epoch), token]
                deleted = self._conn.refresh(keys=keys, args=args)
                with self._cond:
                    for i in deleted:
                        session_id, epoch, _ = batch[int(i) - 1]
                        if self.epochs.get(session_id, GONE) == epoch:
                            self.epochs[session_id] = GONE
        except self._conn.errors as error:
            self._conn.failed("held marks' refresh", error)
            with self._cond:  # tried again once the rest ends, not a ttl / 4 later
                self.next_refresh = min(self.next_refresh, self._conn.down_until)

    def released(self, session_id: str) -> None:
        """The copy here ended: its mark goes (on the writer thread, so the
        caller never waits on Redis), and a delete of it elsewhere is a 404
        if no copy is left."""
        with self._cond:
            self.epochs.pop(session_id, None)
            token = self.marks.pop(session_id, None)
            if token is not None:
                self.releasing[session_id] = token
                self._cond.notify_all()

    def release_marks(self) -> None:
        """On the writer thread: removes the marks of the copies that ended
        here, each only if it is still that copy's (compared in Redis: a copy
        begun here since marked it anew); what fails is tried again."""
        with self._cond:
            ending, self.releasing = self.releasing, {}
        keys, args = [], [self._keys.holder]
        for session_id, token in ending.items():
            keys += [self._keys.held(session_id), self._keys.holders(session_id)]
            args.append(token)
        try:
            self._conn.release(keys=keys, args=args)
        except self._conn.errors as error:
            self._conn.failed("held marks' removal", error)
            with self._cond:
                for session_id, token in ending.items():
                    self.releasing.setdefault(session_id, token)
