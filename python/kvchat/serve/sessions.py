"""Which session a request belongs to, and whose sessions a caller may see.

First match wins: ``prompt_cache_key``, ``user``, the ``X-Session-ID`` header.
Otherwise the request continues the session whose whole conversation so far
(every message, and the reply kvchat returned) is a prefix of its messages; if
none is, it starts a new session, which the core starts from the longest
prefix any session holds. A session is claimed for the length of a turn, so a
second request that forks the same conversation gets a session of its own and
never takes over, and so destroys, another conversation's cache.

With API keys, every session id is namespaced by a hash of the key: a caller
can only list, read, delete or continue its own.

With a shared store (``--store``), the conversation-to-session map is shared
too: each turn's conversation digest is written to the store, so a replica
that has never seen a conversation continues the session another replica
started, and loads its snapshot. Keyless clients, an agent loop behind the
plain OpenAI SDK say, then get the store's reuse as keyed ones do. The store's
map is then the one consulted (this replica's may be stale: another replica
may have continued the session since), and a turn takes its session's route
out of it until the turn ends, whether it found the session by messages or by
its id on any replica, so two replicas never continue one session at once,
and a fork of an older point never takes it over. Only while the store cannot
be reached does the map here stand in; the store then owes the route changes
of those turns, and makes them once it answers again.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid

from ..tiers import StoreUnavailable

_KEPT = ("role", "content", "tool_calls", "tool_call_id", "name")


def conversation_digests(messages: list[dict]) -> list[str]:
    """digest[k]: of messages[:k], for every k; None-valued fields and fields a
    client adds on the way back (refusal, annotations) do not count."""
    h = hashlib.sha256()
    out = [h.hexdigest()]
    for message in messages:
        kept = {k: message[k] for k in _KEPT if message.get(k) is not None}
        h.update(json.dumps(kept, sort_keys=True, ensure_ascii=False).encode())
        out.append(h.hexdigest())
    return out


def namespace(api_key: str | None) -> str:
    if api_key is None:
        return "open"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class _Running:
    """The turns in progress on an automatic session."""

    __slots__ = ("turns", "key", "overlapped")

    def __init__(self, key):
        self.turns = 1
        self.key = key  # the conversation it held before (kept if every turn fails)
        self.overlapped = False  # two turns ran at once: which one it holds is unknown


class SessionRouter:
    """Maps requests to the manager's session ids (``<namespace>/<id>``).

    Only an idle automatic session is in the conversation map, under exactly
    the conversation it holds: a turn on it, by messages or by its id (the
    ``X-Session-ID`` a client was given), takes it out of the map until that
    turn ends and maps what it then holds. So a request that forks an older
    point of its conversation never finds it, and never takes it over."""

    def __init__(self, manager, routes=None):
        """``routes``: the map other replicas share (``ServerStore.routes``,
        serve/store.py), consulted first; None: the map here is the only one."""
        self._mgr = manager
        self._routes = routes
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], str] = {}  # (namespace, conversation) -> session
        self._key_of: dict[str, tuple[str, str]] = {}  # session -> its conversation key
        self._auto: set[str] = set()  # sessions made (or found) by automatic routing
        self._running: dict[str, _Running] = {}  # automatic session -> its turns now
        # Text completions: an idle automatic session -> (namespace, the text it holds).
        self._texts: dict[str, tuple[str, str]] = {}

    @property
    def shared(self) -> bool:
        """Whether claims and releases call a shared store (a network call)."""
        return self._routes is not None

    @staticmethod
    def internal(ns: str, session_id: str) -> str:
        return f"{ns}/{session_id}"

    @staticmethod
    def external(ns: str, internal_id: str) -> str | None:
        prefix = f"{ns}/"
        return internal_id[len(prefix) :] if internal_id.startswith(prefix) else None

    def _start(self, session: str, key: tuple[str, str] | None = None) -> None:
        """Under the lock: a turn on the automatic ``session`` begins; it leaves
        the map. ``key``: the conversation it holds, if the map here does not
        know it (found in the shared store)."""
        known = self._key_of.pop(session, None)
        if known is not None and self._open.get(known) == session:
            del self._open[known]
        running = self._running.get(session)
        if running is None:
            self._running[session] = _Running(key or known)
        else:
            running.turns += 1
            running.overlapped = True

    def claim(self, ns: str, explicit: str | None, messages: list[dict]) -> str:
        """The session (internal id) this request's turn runs on. Every claim
        is followed by one release() for it, whatever becomes of the request.
        It may ask the shared store: call it off the event loop."""
        if explicit is not None:
            return self._claim_by_id(ns, self.internal(ns, explicit))
        digests = conversation_digests(messages)
        if self._routes is not None:
            try:  # longest first, short of the last message
                found = self._routes.take(ns, digests[len(messages) - 1 : 0 : -1])
            except StoreUnavailable:
                pass  # the map here stands in while the store cannot be reached
            else:
                return self._claim_found(ns, found)
        session = None
        with self._lock:
            # The longest conversation a session holds, short of the last message.
            for k in range(len(messages) - 1, 0, -1):
                found_here = self._open.get((ns, digests[k]))
                if found_here is None:
                    continue
                if found_here in self._mgr.sessions():
                    self._start(found_here)
                    session = found_here
                    break
                self._drop(found_here)  # removed meanwhile: out of the map
        if session is None:
            return self._new(ns)
        if self._routes is not None:  # its route in the store goes once the store is back
            self._routes.take_session(session)
        return session

    def claim_text(self, ns: str, explicit: str | None, prompt: str) -> str:
        """claim() for a text completion: the idle session whose text (a
        prompt and its completion) the prompt starts with, the longest one,
        else a new session. Kept on this replica only."""
        if explicit is not None:
            return self._claim_by_id(ns, self.internal(ns, explicit))
        with self._lock:
            best = None
            for session, (owner, text) in self._texts.items():
                if owner == ns and prompt.startswith(text):
                    if best is None or len(text) > len(self._texts[best][1]):
                        best = session
            if best is not None and best in self._mgr.sessions():
                del self._texts[best]
                self._start(best)
                return best
        return self._new(ns)

    def remember_text(self, ns: str, session: str, text: str) -> None:
        """After a completion's turn (release() first): ``session`` holds ``text``."""
        with self._lock:
            if session in self._auto and session not in self._running:
                if session in self._mgr.sessions():
                    self._texts[session] = (ns, text)

    def _claim_by_id(self, ns: str, session: str) -> str:
        """A turn by the session's id. If it is an automatic session (this
        replica's, or one whose route the shared store held), it leaves the
        map for the turn, as when found by its conversation."""
        routed, held = (False, None)
        if self._routes is not None:
            routed, held = self._routes.take_session(session)
        with self._lock:
            if routed:  # routed by the store: release() writes its new route
                self._auto.add(session)
                self._start(session, None if held is None else (ns, held))
            elif session in self._auto:
                self._start(session)
        return session

    def _claim_found(self, ns: str, found: tuple[str, str] | None) -> str:
        """The session the shared store's map gave (taken out of it), or a new one."""
        if found is not None and found[0].startswith(f"{ns}/"):
            session, conversation = found
            with self._lock:
                if session not in self._running:  # else: a fork of a turn running here
                    self._auto.add(session)
                    self._start(session, (ns, conversation))
                    return session
        return self._new(ns)

    def _new(self, ns: str) -> str:
        session = self.internal(ns, f"auto-{uuid.uuid4().hex[:16]}")
        with self._lock:
            self._auto.add(session)
            self._start(session)
        return session

    def release(self, ns: str, session: str, conversation: list[dict] | None) -> None:
        """After a turn: ``conversation`` (its messages and the reply) is what the
        session now holds; None when the turn failed, and it holds what it held."""
        with self._lock:
            running = self._running.get(session)
            if running is None:  # not an automatic session (or forgotten meanwhile)
                return
            running.turns -= 1
            if conversation is not None:
                running.key = (ns, conversation_digests(conversation)[-1])
            if running.turns > 0:
                return
            del self._running[session]
            key = running.key
            held = session in self._mgr.sessions()
            if not held:  # a refused first turn here: nothing of it is kept here
                self._drop(session)
            if key is None or running.overlapped:
                return  # nothing held yet, or unknown which: out of the map
            if held:  # else another replica's session: only its route goes back to the store
                other = self._open.get(key)
                if other is not None and other != session:
                    self._key_of.pop(other, None)  # one conversation, one session
                self._open[key] = session
                self._key_of[session] = key
        if self._routes is not None:  # what it holds now (a failed turn: what it held)
            self._routes.remember(ns, key[1], session)

    def _drop(self, session: str) -> None:
        self._running.pop(session, None)
        self._texts.pop(session, None)
        self._auto.discard(session)
        key = self._key_of.pop(session, None)
        if key is not None and self._open.get(key) == session:
            del self._open[key]

    def tracked(self) -> set[str]:
        """Every session the router keeps anything of (for tests: no leak)."""
        with self._lock:
            return {
                *self._auto,
                *self._running,
                *self._key_of,
                *self._open.values(),
                *self._texts,
            }

    def forget(self, session: str) -> None:
        """``session`` was removed (deleted, or expired)."""
        with self._lock:
            self._drop(session)
