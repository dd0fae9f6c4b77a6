"""What a ``SessionManager`` offers besides the turn: reading a session's
report, stats and messages; clearing and removing sessions (here and in a
shared store) and dropping copies another process deleted; flushing and
closing the tier; saving a session to a file and loading it back.

``SessionAdmin`` is a mixin of ``SessionManager`` (manager.py), kept apart so
each file holds one concept. It uses the manager's ``_core`` (the C++
sessions), ``_tier``, ``_settler``, ``_bridge``, ``_model``, ``_fingerprint``,
``_wait`` (busy="wait") and ``_owed_deletes``. Every change to a session
happens under the settler's hold (no settle runs beside it) and the core's lease.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from . import _C
from .arguments import check_path, check_session_id
from .bridge.layout import ModelLayout
from .conversation import as_dicts, core_messages
from .engine.threads import normal_tensors
from .prompting import validate_messages
from .report import ManagerStats, SessionInfo, TurnReport
from .tiers.session_file import SessionFileError, read_session, write_session
from .tiers.shared import StoreUnavailable

logger = logging.getLogger("kvchat")


class SessionAdmin:
    """The manager's sessions, outside a turn."""

    # ------------------------------------------------------------ inspection
    def last_turn(self, session_id: str) -> TurnReport | None:
        """What the session's last turn reused, prefilled and generated."""
        record = self._core.find(check_session_id(session_id)).last_turn()
        return None if record is None else TurnReport.from_core(record)

    def stats(self) -> ManagerStats:
        stats = ManagerStats.from_core(self._core.stats())
        return replace(
            stats,
            **self._tier.counters(),
            **self._settler.counters(),
            **self._compiled.counters(self._bridge.static_pool),
            **self._turns.counters(),
            **self._engine.counters(),
        )

    def info(self, session_id: str) -> SessionInfo:
        return SessionInfo.from_core(self._core.find(check_session_id(session_id)))

    def messages(self, session_id: str) -> list[dict[str, str]]:
        """The session's conversation so far (system prompt first), as chat() takes it."""
        session = self._core.find(check_session_id(session_id))
        return as_dicts(session.messages())

    def cached_ids(self, session_id: str) -> list[int]:
        """The token ids the session's cache holds in memory, in order. After a
        settle, the history as the template renders it. Empty once cleared,
        while evicted (a tier may still hold it) and while a turn runs on it."""
        return list(self._core.find(check_session_id(session_id)).cached_ids())

    @property
    def layout(self) -> ModelLayout:
        """What kvchat carries of this model's cache, layer by layer (read once,
        off a cache the model filled). ``layout.supported`` is False when every
        turn runs as plain generate, and ``layout.problem`` then says why."""
        return self._bridge.layout

    def sessions(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._core.session_ids())

    def clear(self, session_id: str) -> None:
        """Drops the session's cache and history; keeps its system prompt. With
        a shared store, its snapshot there too (``StoreUnavailable`` if the
        store cannot be reached: cleared here only; call again)."""
        check_session_id(session_id)
        if self._tier.shared and not self._tier.available():
            raise StoreUnavailable(
                f"session {session_id!r} was not cleared: the shared store is unreachable "
                f"(its snapshot there would outlive the clear); try again"
            )
        with self._settler.hold(session_id):
            self._core.clear(session_id)
        self._settler.forget(session_id)
        self._forget_stored(session_id, "cleared")

    def remove(self, session_id: str, local_only: bool = False) -> None:
        """Forgets the session entirely: here and, with a shared store, in the
        store and so on every process that uses it (each drops its copy before
        its next turn). A session only the shared store holds is removed there
        (``KeyError`` if neither holds it). ``local_only``: only in this
        process; a shared store keeps its snapshot for other processes (an idle
        timeout on one server replica wants this).

        With a shared store that cannot be reached, raises ``StoreUnavailable``
        rather than report a delete that other processes would not see: before
        removing anything when the store is known to be down, else after
        removing the copy here (calling again then deletes it there)."""
        check_session_id(session_id)
        everywhere = self._tier.shared and not local_only
        if everywhere and not self._tier.available():
            raise StoreUnavailable(
                f"session {session_id!r} was not removed: the shared store is unreachable "
                f"(other processes would keep serving it); try again"
            )
        try:
            with self._settler.hold(session_id):
                self._core.remove(session_id)
        except KeyError:
            if not everywhere:
                raise
            owed = session_id in self._owed_deletes
            try:
                held = self._tier.forget(session_id, held_here=owed)
            except StoreUnavailable as error:
                raise StoreUnavailable(
                    f"session {session_id!r} is not held here, and the shared store "
                    f"could not be asked to delete it ({error}); try again"
                ) from None
            self._owed_deletes.discard(session_id)
            if not (held or owed):
                raise
            return
        self._settler.forget(session_id)
        if everywhere or not self._tier.shared:
            self._forget_stored(session_id, "removed")
        else:
            self._tier.released(session_id)

    def _forget_stored(self, session_id: str, done: str) -> None:
        try:
            self._tier.forget(session_id)
        except StoreUnavailable as error:
            if done == "removed":
                self._owed_deletes.add(session_id)
            raise StoreUnavailable(
                f"session {session_id!r} was {done} here, but not in the shared store "
                f"({error}); other processes may still serve it: call again"
            ) from None
        self._owed_deletes.discard(session_id)

    def drop_if_deleted(self, session_id: str) -> bool:
        """With a shared store: whether the session was deleted (on any process)
        since its copy here began; if so, removes that copy here (unless a turn
        is running on it, which drops it itself first)."""
        return session_id in self.drop_deleted([check_session_id(session_id)])

    def drop_deleted(self, session_ids: list[str]) -> set[str]:
        """``drop_if_deleted`` for many sessions at once (one store round trip):
        the ids deleted elsewhere, whose copies here are dropped."""
        if not self._tier.shared or not session_ids:
            return set()
        deleted = self._tier.deleted_among(list(session_ids))
        for session_id in deleted:
            try:
                with self._settler.hold(session_id):
                    self._core.remove(session_id)
            except (KeyError, _C.SessionBusy):
                continue
            self._settler.forget(session_id)
            self._tier.released(session_id)
        return deleted

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits until the tier has written every snapshot queued so far (the
        Redis store writes in the background), or only ``session_id``'s.
        False if ``timeout`` ran out."""
        return self._tier.flush(timeout, session_id)

    def close(self) -> None:
        """Stops settling (a settle under way is dropped), writes what the
        tier has queued and stops its writer. The manager should not be used
        afterwards."""
        self._settler.close()
        self._engine.close()
        self._tier.close()

    # ------------------------------------------------------------ persistence
    def save(self, session_id: str, path: str | os.PathLike) -> None:
        """Writes the session (cache, token ids, messages) to a safetensors file.

        The file names the model it came from; ``load`` refuses it for another.
        The write is atomic: an existing file at ``path`` is replaced whole."""
        check_session_id(session_id)
        path = check_path(path)
        # A consistent snapshot under the lease (UnknownSessionError, creating
        # nothing, for an unknown id); stored states are never written in place,
        # so the file is written after it, without blocking the session.
        with (
            self._settler.hold(session_id),
            self._core.acquire(session_id, wait=self._wait, create=False) as session,
        ):
            messages = as_dicts(session.messages())
            state = session.cached_state()
            if not state.ids and messages:
                # Evicted by the byte budget: the tier's copy (a spill file),
                # read under the lease so that no turn replaces it meanwhile. A
                # cache of an earlier turn is still safe to save: a turn after
                # load reuses only what is a true prefix of its prompt.
                stored = self._tier.stored(session_id)
                if stored is not None and stored.ids:
                    state = stored
        if not state.ids and messages:  # evicted with no tier copy, or a turn left no cache
            logger.warning(
                "kvchat: session %r holds no cache in memory (evicted, or none yet); "
                "%s holds its messages only, so its next turn after load prefills them",
                session_id,
                path,
            )
        slots = self._bridge.layout.slots
        write_session(path, session_id, messages, state, self._fingerprint, slots)

    def load(self, path: str | os.PathLike, session_id: str | None = None) -> str:
        """Reads a file ``save`` wrote into session ``session_id`` (default: the
        saved id), replacing that session's cache and messages (and a cache
        spilled to disk of what it held before). Returns the id.

        The whole file is checked first (format, model fingerprint, checksum):
        a bad file raises ``SessionFileError`` and changes nothing."""
        if session_id is not None:
            check_session_id(session_id)
        path = check_path(path)
        if not path.is_file():
            raise FileNotFoundError(f"path {str(path)!r} is not a file")
        with normal_tensors():  # the engine updates them in place (engine/threads.py)
            saved = read_session(path, self._fingerprint, self._model.device, self._bridge.layout)
        try:
            messages = validate_messages(saved.messages) if saved.messages else []
            if saved.state is not None:
                # Checked on a scratch session, so a bad cache never creates or touches `target`.
                _C.ChatSession("load-check", self._bridge.num_layers).restore(saved.state)
        except (TypeError, ValueError, IndexError) as error:
            raise SessionFileError(
                f"path {str(path)!r} holds an invalid session: {error}"
            ) from error
        target = session_id or saved.session_id
        with self._settler.hold(target), self._core.acquire(target, wait=self._wait) as session:
            if saved.state is None:
                session.invalidate_cache()
            else:
                session.restore(saved.state)
            session.set_messages(core_messages(messages))
            if not self._tier.shared:
                # A spilled cache of what the session held before is no longer
                # its own: forgotten under the lease, before a turn waiting for
                # it could read it. (An eviction another thread flushes later
                # may still write the old cache back; a turn reuses only a
                # true prefix of what it reads.)
                self._tier.forget(target)
        self._flush_evicted()
        return target

    def _flush_evicted(self) -> None:
        """Hands what eviction queued to the tier (after a turn, a settle, a
        load), then lets it go."""
        evicted_to(self._core, self._tier)()


def evicted_to(core, tier):
    """A function that hands what ``core`` evicted to ``tier``: not a method
    of the manager, so what holds it (the settler, the turns) never keeps
    the manager alive."""

    def flush() -> None:
        for session_id, state in core.take_evicted():
            tier.put(session_id, state)

    return flush
