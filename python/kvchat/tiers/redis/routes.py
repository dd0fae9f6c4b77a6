"""``kvchat serve``'s map from a conversation to the session holding it,
shared through Redis so that any replica continues any conversation.

A route (``Keys.route``) is keyed by a conversation (a digest of its
messages) and holds a session id. A session has one route, its latest
conversation (a hash per session, ``Keys.routes_of``, lists it), and a
replica that continues it, found by its conversation or by its id, takes the
route out of the map for the turn, so no other replica (nor a fork of an
older point) continues the same session at once. A route change Redis could
not take (it was down) is owed, the newest per session, and made by the
writer thread once Redis is back, but only if no other process changed that
session's routes meanwhile (the hash counts changes): the other's route is
the newer and stands. An owed take (a turn that began while Redis was down)
is always made: removing a route late costs at most a prefill, while a stale
one would let a fork take the session over. A route found by its conversation
counts as a change too.

Lock order: ``lock`` (one route change at a time, in order), then the tier's
condition ``cond`` (which guards ``owed`` and ``gens``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ..shared import StoreUnavailable
from .copies import GONE, epoch_arg

logger = logging.getLogger("kvchat")

_GENERATIONS_KEPT = 1 << 16  # sessions whose route generation a process remembers


class Routes:
    """The route map as one process changes it."""

    def __init__(self, conn, keys, copies, ttl: int, cond: threading.Condition):
        self._conn, self._keys, self._copies, self._ttl = conn, keys, copies, ttl
        self._cond = cond
        self.lock = threading.Lock()
        # Route changes the store could not take (it was down), per session, the
        # newest only: paid by the writer thread once the store is back, so a
        # route written before the outage never outlives the session's moving on.
        self.owed: dict[str, tuple] = {}
        # Per session, the generation of its routes after this process's last
        # change: an owed change is made only if the store still has it.
        self.gens: OrderedDict[str, int] = OrderedDict()

    def remember(self, namespace: str, conversation: str, session_id: str) -> None:
        self._change(session_id, ("route", namespace, conversation))

    def take_session(self, session_id: str) -> tuple[bool, str | None]:
        return self._change(session_id, ("take",)) or (False, None)

    def _change(self, session_id: str, change: tuple):
        """Makes ``change`` to the session's routes now; if the store cannot
        take it, owes it (superseding any older change owed)."""
        with self.lock:
            with self._cond:
                self.owed.pop(session_id, None)  # this one is newer
            if self._conn.available():
                try:
                    return self._make(session_id, change)[1]
                except self._conn.errors as error:
                    self._conn.failed("route write", error)
            with self._cond:  # with what this process knew of the session's routes
                self.owed[session_id] = (change, self.gens.get(session_id, 0))
                self._cond.notify_all()  # the writer pays it once the store is back
        return None

    def _make(self, session_id: str, change: tuple, gen: int | None = None):
        """Under the route lock: a route write ("route", namespace,
        conversation), never for a session deleted since its copy here began;
        or ("take",): the session's routes leave the map. ``gen``: made only
        if the session's routes are at that generation. Returns (whether it
        was made, and for a take: (whether the session ever had a route, the
        conversation of the route it removed, or None))."""
        if change[0] == "take":
            made, held, routed = self._conn.take_session(
                keys=[self._keys.routes_of(session_id)],
                args=[session_id, "" if gen is None else gen],
            )
            held = (bool(routed), held.decode() if held else None)
        else:
            _, namespace, conversation = change
            epoch = self._copies.epoch_of(session_id)
            if epoch is GONE:  # deleted since its copy here began: no route
                return False, None
            keys = [
                self._keys.route(namespace, conversation),
                self._keys.routes_of(session_id),  # so that deleting the session deletes its routes
                self._keys.tombstone(session_id),
            ]
            args = [session_id, self._ttl, epoch_arg(epoch), conversation]
            args.append("" if gen is None else gen)
            made, held = self._conn.route(keys=keys, args=args), None
        made = int(made)
        if made >= 0:
            with self._cond:
                self.gens[session_id] = made
                self.gens.move_to_end(session_id)
                while len(self.gens) > _GENERATIONS_KEPT:
                    self.gens.popitem(last=False)
        return made >= 0, held

    def pay_owed(self) -> None:
        """Under the route lock, the store being back: makes the owed route
        changes, oldest first; what fails stays owed. A route write is made
        only if no other process changed that session's routes since this one
        last did: the other's change is the newer, and it removed the routes
        written before it. A take is always made, whatever this process knew
        of the session: no route of a session continued here may stand (a
        fork would find it), and a route taken too many costs only a prefill."""
        with self._cond:  # each stays owed until made (owed_count() counts it till then)
            owed = list(self.owed.items())
        for session_id, entry in owed:
            change, gen = entry
            try:
                if not self._conn.available():
                    continue  # stays owed
                made, _ = self._make(session_id, change, None if change[0] == "take" else gen)
                if not made:
                    logger.info("kvchat: route change of session %r superseded", session_id)
            except self._conn.errors as error:
                self._conn.failed("route write", error)
                continue  # stays owed
            except Exception:  # a bug must not kill the writer, nor loop
                logger.exception("kvchat: route change of session %r failed", session_id)
            with self._cond:  # paid (unless a newer change replaced it meanwhile)
                if self.owed.get(session_id) is entry:
                    del self.owed[session_id]

    def forget_gen(self, session_id: str) -> None:
        """The session's route generation, once nothing here needs it: no
        copy here, no change owed."""
        with self._cond:
            if session_id not in self._copies.epochs and session_id not in self.owed:
                self.gens.pop(session_id, None)

    def drop(self, session_id: str) -> None:
        """Under the condition: the session was deleted; its routes go with it."""
        self.owed.pop(session_id, None)
        self.gens.pop(session_id, None)

    def owed_count(self) -> int:
        """Route changes waiting for the store to be back."""
        with self._cond:
            return len(self.owed)

    def take(self, namespace: str, conversations: list[str]) -> tuple[str, str] | None:
        """Takes the first of ``conversations`` the map knows out of the map;
        (its session, that conversation), or None; ``StoreUnavailable`` if the
        map cannot be read."""
        if not conversations:
            return None
        if not self._conn.available():
            raise StoreUnavailable("the Redis store is resting after a failure")
        keys = [self._keys.route(namespace, c) for c in conversations]
        with self.lock:  # after any route change made before it
            self.pay_owed()  # a stale route must not be found first
            if not self._conn.available():  # it failed while this call waited, or as it paid
                raise StoreUnavailable("the Redis store is resting after a failure")
            try:
                found = self._conn.take(keys=keys, args=[f"{namespace}/"])
            except self._conn.errors as error:
                self._conn.failed("route lookup", error)
                raise StoreUnavailable(f"route lookup failed: {type(error).__name__}") from None
            if not found:
                return None
            position, session = found
            session = session.decode("utf-8", errors="replace")
            with self._cond:
                self.owed.pop(session, None)  # this take is newer
            try:  # counted as a change of its routes: what this process owes later is checked
                self._make(session, ("take",))
            except self._conn.errors as error:  # taken all the same; a late change of it is refused
                self._conn.failed("route lookup", error)
        return session, conversations[int(position) - 1]
