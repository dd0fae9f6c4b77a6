"""The Redis tier: session snapshots every replica of a server can read.

What is stored, per session, is what ``save()`` writes (layers, checkpoints,
token ids, cached text, messages), as immutable snapshots, and beside them
what lets replicas agree on a session's life. One file per part:

- ``chunks``: the codec. Tensors cut into content-addressed chunks
  (``<prefix>:<model>:chunk:<scope>:<sha256>``; with ``isolate_namespaces``,
  which ``kvchat serve`` sets, a scope is a namespace, so no upload ever finds
  another namespace's chunk), and a **manifest** per model and session that
  lists them. An index per scope lists its manifests.
- ``writer``: the background thread that uploads chunks and publishes a
  manifest last, by one script, so a reader never sees a manifest whose
  chunks were not all there. Two writers of one session each publish a whole
  snapshot; the last one published wins.
- ``reader``: a turn's read, where every problem is a miss, never an error.
- ``copies``: **held marks** (which processes hold a copy of a session) and
  **tombstones** (a delete every replica sees before its next turn).
- ``routes``: ``kvchat serve``'s map from a conversation to its session.
- ``responses``: ``kvchat serve``'s stored responses, bounded per API key.
- ``keys``, ``connection``, ``scripts``, ``url``: names, the client and its
  health, the Lua scripts, and what a URL may show.

**Deleting** (``forget``, ``SessionManager.remove``) sets a tombstone, removes
the manifest, the session's routes and every chunk of it no live manifest of
the scope lists. A delete of what exists nowhere (neither in the store nor in
the deleting process) leaves no tombstone. A snapshot written for an older
copy is never published (the script checks), so a write queued before the
delete cannot bring the session back. A delete that cannot reach Redis raises
``StoreUnavailable``: it is never reported done when it was not.

Locks: ``Routes.lock`` before the tier's condition ``cond``, which guards the
writer's queue, the copies' epochs and marks, and the owed route changes.
"""

from __future__ import annotations

import secrets
import threading

import torch

from ... import _C
from ..session_file import encode_state
from ..shared import SharedTier, StoreUnavailable
from .connection import Connection
from .copies import GONE, Copies
from .keys import Keys
from .reader import Reader
from .responses import RedisResponses
from .routes import Routes
from .writer import Writer

WRITE_POLICIES = ("turn", "evict")


class RedisTier(SharedTier):
    """Session snapshots in Redis (or Valkey), shared by every manager that
    serves the same model with the same ``prefix``.

    url: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` too).
    ttl: seconds a snapshot lives after its last write.
    write: ``"turn"`` (default) writes after every turn, so another replica
        continues any conversation from its latest turn; ``"evict"`` writes
        only when eviction drops a session from memory (less traffic; other
        replicas see a session only once this one lets it go).
    timeout: seconds any one Redis call may take before it counts as down.
    retry_after: seconds the tier rests after Redis failed, before trying again.
    prefix: the keys' prefix (several deployments on one Redis).
    block_tokens, chunk_bytes: how keys and values, and other tensors, are cut.

    Writes are queued: call ``flush()`` to wait for them, ``close()`` (or the
    manager's) before exit, or the snapshots still queued are lost.
    """

    reload_reason = _C.ReuseReason.store_reload
    default_ms_per_byte = 5e-6  # before any load is measured: 200 MB/s, over a network

    def __init__(
        self,
        url: str,
        *,
        ttl: float = 24 * 3600,
        write: str = "turn",
        timeout: float = 0.5,
        retry_after: float = 5.0,
        prefix: str = "kvchat",
        block_tokens: int = 64,
        chunk_bytes: int = 4 << 20,
    ):
        super().__init__()
        Connection.check_url(url)
        if write not in WRITE_POLICIES:
            raise ValueError(f"write must be one of {WRITE_POLICIES}, got {write!r}")
        for name, value in (("ttl", ttl), ("timeout", timeout), ("retry_after", retry_after)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value in (("block_tokens", block_tokens), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.conn = Connection(url, timeout, retry_after)
        self.url, self.ttl, self.write_policy = self.conn.url, int(max(1, round(ttl))), write
        self.keeps_evicted = write == "evict"
        self.writes_turns = write == "turn"
        self.block_tokens, self.chunk_bytes = block_tokens, chunk_bytes
        self.cond = threading.Condition()
        self.keys = Keys(prefix, holder=secrets.token_hex(8))
        self.copies = Copies(self.conn, self.keys, self.ttl, self.cond)
        self.routes = Routes(self.conn, self.keys, self.copies, self.ttl, self.cond)
        self.reader = Reader(self)
        self.writer = Writer(self, self.cond)
        self.misses = self.reader.misses  # reason -> count, as counters() reports them

    @property
    def isolate_namespaces(self) -> bool:
        return self.keys.isolate_namespaces

    @isolate_namespaces.setter
    def isolate_namespaces(self, value: bool) -> None:
        self.keys.isolate_namespaces = value

    def bind(self, fingerprint, layout, device) -> None:
        super().bind(fingerprint, layout, device)
        self.keys.bind(fingerprint)

    def available(self) -> bool:
        return self.conn.available()

    # ------------------------------------------------------------ writing
    # Both run on the caller's (the turn's) thread and only describe the state
    # (encode_state): the writer thread runs no torch op.
    def put(self, session_id: str, state: _C.CachedState) -> None:
        """Eviction dropped this session (``write="evict"``): store what it held."""
        epoch = self.copies.epoch_of(session_id)
        if epoch is not GONE:  # else deleted since the copy began: never stored
            self.writer.enqueue(session_id, (*encode_state(state, self.layout.slots), [], epoch))

    def turn_finished(self, session_id: str, state: _C.CachedState, messages: list) -> None:
        """A turn finished (``write="turn"``): store the session as it now is,
        unless it was deleted since this turn's copy began."""
        epoch = self.copies.epoch_of(session_id, this_turn=True)
        if epoch is not GONE:
            job = (*encode_state(state, self.layout.slots), messages, epoch)
            self.writer.enqueue(session_id, job)

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        return self.writer.flush(timeout, session_id)

    def close(self, timeout: float | None = 10.0) -> None:
        """Writes what is queued, makes the route changes and mark removals
        owed (waiting, within ``timeout``, for a store that rests after a
        failure), then stops the writer."""
        self.writer.close(timeout)
        self.reader.close()

    # ------------------------------------------------------------ reading
    def find_if_cheaper(
        self, session_id: str, prompt: torch.Tensor, have: int = 0, local=None
    ) -> _C.CachedState | None:
        if self.writer.closed:
            self.reader.misses["unavailable"] += 1
            return None
        return self.reader.find(session_id, prompt, have, local)

    # ------------------------------------------------------------ copies and deletes
    def deleted_since(self, session_id: str, update: bool = True) -> bool:
        return self.copies.deleted_since(session_id, update)

    def deleted_among(self, session_ids: list[str]) -> set[str]:
        return self.copies.deleted_among(session_ids)

    def released(self, session_id: str) -> None:
        self.copies.released(session_id)
        self.routes.forget_gen(session_id)

    def forget(self, session_id: str, held_here: bool = True) -> bool:
        """Deletes the session from the store, now: its manifest, its routes and
        each of its chunks no other live manifest lists, and leaves a tombstone,
        so every replica drops its copy before its next turn, and no snapshot
        of an older copy (a write queued before) is ever published. Returns
        whether the store knew the session (a snapshot, a route, or a process
        whose copy began a turn within ``ttl``). ``held_here``: the session
        existed in this process (else one the store does not know leaves no
        tombstone).
        Raises ``StoreUnavailable`` if Redis cannot be reached."""
        token = secrets.token_hex(16).encode()
        keys = self.keys
        with self.cond:
            self.writer.pending.pop(session_id, None)  # never written now
            self.routes.drop(session_id)
            self.copies.drop(session_id)
            self.cond.notify_all()
        script_keys = [
            keys.manifest(session_id),
            keys.tombstone(session_id),
            keys.index(session_id),
            keys.routes_of(session_id),
            keys.chunks_of(session_id),
            keys.holders(session_id),
        ]
        # The last: each process's held mark is that + ":" + its name.
        args = [
            token,
            self.ttl,
            session_id,
            "1" if held_here else "0",
            keys.held_prefix(session_id),
        ]
        try:
            existed, chunks = self.conn.delete(keys=script_keys, args=args)
        except self.conn.errors as error:
            self.writer.write_errors += 1
            self.conn.failed(f"delete of session {session_id!r}", error)
            raise StoreUnavailable(f"Redis failed: {type(error).__name__}") from None
        digests = {key.rsplit(b":", 1)[-1].decode() for key in chunks}
        if digests:
            self.writer.collect(session_id, digests)
        return bool(existed)

    def responses(self, per_key: int, bytes_per_key: int, ttl: float | None) -> RedisResponses:
        return RedisResponses(self.conn, self.keys, per_key, bytes_per_key, ttl)

    def owed_routes(self) -> int:
        """Route changes waiting for the store to be back."""
        return self.routes.owed_count()

    def counters(self) -> dict:
        misses = self.reader.misses
        return {
            **super().counters(),
            "store_writes": self.writes,
            "store_loads": self.loads,
            "store_misses": sum(misses.values()),
            "store_write_errors": self.writer.write_errors,
            "store_miss_reasons": dict(misses),
        }
