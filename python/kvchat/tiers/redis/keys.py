"""Where everything the Redis tier stores lives: one name per kind of key.

Every key begins ``<prefix>:<model>:<kind>:<digest of a name>`` (chunks and
held marks add a last part: the chunk's digest, the process): the model part
(a digest of the fingerprint) keeps two models' snapshots apart on one Redis,
the prefix two deployments, and digests keep any session id a valid key.
"""

from __future__ import annotations

import hashlib
import json


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Keys:
    """The key names of one tier: ``prefix``; ``holder``, this process's name in
    held marks; the model's fingerprint (``bind``); ``isolate_namespaces``
    (chunks shared only within a session's namespace)."""

    def __init__(self, prefix: str, holder: str):
        self.prefix, self.holder = prefix, holder
        self.isolate_namespaces = False

    def bind(self, fingerprint: dict) -> None:
        self.model = digest(json.dumps(fingerprint, sort_keys=True).encode())[:24]

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:{self.model}:{kind}:{digest(name.encode())[:32]}"

    def record(self, kind: str, name: str) -> str:
        """A small JSON record another part keeps in the store (a server's
        responses, by namespace and id)."""
        return self._key(kind, name)

    def manifest(self, session_id: str) -> str:
        return self._key("session", session_id)

    def tombstone(self, session_id: str) -> str:
        return self._key("deleted", session_id)

    def routes_of(self, session_id: str) -> str:
        """The hash of the session's routes (route key -> conversation)."""
        return self._key("route-of", session_id)

    def held_prefix(self, session_id: str) -> str:
        """What every process's held mark of the session begins with."""
        return self._key("held", session_id)

    def held(self, session_id: str, holder: str | None = None) -> str:
        """This process's (or ``holder``'s) mark that it holds a copy of the
        session: set when the copy begins a turn, kept alive (``ttl``) while
        the copy lasts, removed when it goes. A delete on a process that holds
        nothing of the session still reaches every one that does, even when
        no snapshot is stored."""
        return f"{self.held_prefix(session_id)}:{holder or self.holder}"

    def holders(self, session_id: str) -> str:
        """The set of processes that marked the session held."""
        return self._key("holders", session_id)

    def chunks_of(self, session_id: str) -> str:
        """The set of every chunk key the session's snapshots listed."""
        return self._key("chunks", session_id)

    def scope(self, session_id: str) -> str:
        """Where the session's chunks are shared: its namespace (as the core
        isolates them) with ``isolate_namespaces``, else everywhere."""
        if not self.isolate_namespaces:
            return ""
        name, slash, _ = session_id.partition("/")
        return f"{name}/" if slash else f"{session_id}/"

    def index(self, session_id: str) -> str:
        """The hash listing the manifests of the session's scope."""
        return self._key("index", self.scope(session_id))

    def chunk(self, chunk_digest: str, session_id: str) -> str:
        """A chunk of ``session_id``'s scope (chunks are never shared across scopes)."""
        return f"{self._key('chunk', self.scope(session_id))}:{chunk_digest}"

    def route(self, namespace: str, conversation: str) -> str:
        """``kvchat serve``'s route of a conversation (a digest of its messages)."""
        name = digest(f"{namespace}\0{conversation}".encode())[:32]
        return f"{self.prefix}:{self.model}:route:{name}"
