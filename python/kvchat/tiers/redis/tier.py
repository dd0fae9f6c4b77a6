"""The Redis tier: session snapshots every replica of a server can read.

What is stored, per session, is what ``save()`` writes (layers, checkpoints,
token ids, cached text, messages), as immutable snapshots:

- **Chunks**, keyed by the SHA-256 of their bytes within the session's scope
  (``<prefix>:<model>:chunk:<scope>:<sha256>``): with ``isolate_namespaces``
  (which ``kvchat serve`` sets) a scope is a namespace (an API key), else one
  scope holds every session, so no upload ever finds another namespace's chunk
  (and its time says nothing of what another tenant stored). A 4-D tensor
  (keys and values: [1, heads, tokens, dim]) is cut along its token axis into
  blocks of a fixed number of tokens, so the blocks of a prefix are the same
  bytes turn after turn and across sessions of a scope that share it: a turn
  uploads only the blocks that are new. Other tensors are cut by bytes. No
  chunk is over ``chunk_bytes`` (default 4 MiB, far under Redis's 512 MB).
- **A manifest** per model and session (``<prefix>:<model>:session:<id>``):
  the format, the model fingerprint, the session id, the token ids, the layout
  of every state, and each tensor's chunk list. It is published last, by one
  Lua script that first refreshes every chunk's TTL and publishes nothing if a
  chunk is gone, so a reader never sees a manifest whose chunks were not all
  there when it was written. Two writers of one session each publish a whole
  snapshot; the last one published wins. An index per scope lists its
  manifests (``<prefix>:<model>:index:<scope>``).
- **Routes** (``<prefix>:<model>:route:<namespace, conversation>``):
  ``kvchat serve``'s map from a conversation to the session holding it. A
  session has one route, its latest conversation (a hash per session,
  ``route-of``, lists it), and a replica that continues it, found by its
  conversation or by its id, takes the route out of the map for the turn, so
  no other replica (nor a fork of an older point) continues the same session
  at once. A route change Redis could not take (it was down) is owed, the
  newest per session, and made by the writer thread once Redis is back, but
  only if no other process changed that session's routes meanwhile (the hash
  counts changes): the other's route is the newer and stands. An owed take
  (a turn that began while Redis was down) is always made: removing a route
  late costs at most a prefill, while a stale one would let a fork take the
  session over. A route found by its conversation counts as a change too.
- **Held marks** (``<prefix>:<model>:held:<id>:<process>``, for ``ttl``, and
  a set of the processes per session): each process marks the sessions it
  holds a copy of when the copy begins a turn, keeps the marks alive while
  the copies last (the writer thread refreshes them every ``ttl / 4``, but
  not one of a copy deleted since it began: that copy is remembered as
  deleted, so its next turn drops it even once the tombstone has expired)
  and removes its mark when its copy ends without a delete (``released``,
  also on the writer thread: a caller never waits on Redis for it). A mark
  holds its copy's token: a refresh never overwrites a newer copy's mark, and
  a removal removes only its own copy's. A copy that begins while Redis
  cannot say which tombstone it began under is marked once Redis is back,
  and any tombstone found later counts as its delete. So a delete on a
  process that holds nothing of a session still reaches every process that
  does, even with no snapshot stored (``write="evict"``, one still queued,
  or one expired), and one of a session nobody holds any more is a
  ``KeyError`` (once the writer of the process that let it go has removed
  its mark; a delete just before leaves a tombstone of what nobody holds).
- **A tombstone** per deleted session (``<prefix>:<model>:deleted:<id>``, a
  random token, for ``ttl`` seconds): ``forget`` (``SessionManager.remove``)
  sets it, removes the manifest, the session's routes and every chunk of it no
  live manifest of the scope lists. A delete of what exists nowhere (neither
  in the store nor in the deleting process) leaves no tombstone. Each process
  remembers the tombstone it saw when a session's copy here began; a turn (or
  ``kvchat serve``'s GET or listing) that finds another one drops the copy
  here first, and a snapshot written for an older copy is never published
  (the Lua script checks), so a write queued before the delete cannot bring
  the session back. A delete that cannot reach Redis raises
  ``StoreUnavailable``: it is never reported done when it was not.

Reading checks everything and treats any problem as a miss (logged, counted,
the turn prefills instead): no manifest (never written, or expired), another
format, another model's fingerprint or another session, token ids sharing
nothing with the prompt, a missing chunk (evicted), a chunk whose bytes do not
hash to its name, a layout that does not fit the model, or Redis down or slow
(every call is bounded by ``timeout``; after a failure the tier rests for
``retry_after`` seconds, then tries again). The core then reuses only what is
a true token prefix of the prompt. So the tier can cost time, never
correctness, and never raises into a turn.

Writes run on one background thread, off the turn's critical path. Per session
only the newest pending snapshot is kept: an older one not yet written is
dropped, as the newer one supersedes it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import secrets
import threading
import time
import warnings
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch

from . import _C
from .persist import decode_state, encode_state
from .tier import StoreUnavailable, Tier

logger = logging.getLogger("kvchat")

FORMAT = "kvchat-store-2"
WRITE_POLICIES = ("turn", "evict")
_FETCH_BATCH = 64  # chunks per MGET: at most 256 MiB, usually a few MiB

# Before any load is measured: 200 MB/s, a cautious Redis read over a network.
_DEFAULT_MS_PER_BYTE = 5e-6
_SMOOTHING = 0.3

_TOMBSTONE_BATCH = 512  # tombstones per MGET when a listing asks after many sessions
_GENERATIONS_KEPT = 1 << 16  # sessions whose route generation a process remembers

# KEYS: manifest, tombstone, index, the session's chunk set, chunks...; ARGV:
# manifest, ttl, the tombstone the snapshot's copy began under ('' for none),
# written_at. Publishes nothing (returns -1) if the session was deleted since;
# else refreshes every chunk's TTL and publishes only if all are there, adding
# them to the set of every chunk the session's snapshots listed (what deleting
# it deletes). Returns the (1-based) positions of missing chunks, empty when
# published.
_PUBLISH = """
local deleted = redis.call('GET', KEYS[2])
if deleted and deleted ~= ARGV[3] then return -1 end
local missing = {}
for i = 5, #KEYS do
  if redis.call('EXPIRE', KEYS[i], ARGV[2]) == 0 then missing[#missing + 1] = i - 4 end
end
if #missing == 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  redis.call('HSET', KEYS[3], KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[2])
  for i = 5, #KEYS, 1000 do
    redis.call('SADD', KEYS[4], unpack(KEYS, i, math.min(i + 999, #KEYS)))
  end
  redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return missing
"""

# KEYS: manifest, tombstone, index, the session's routes, its chunk set, the
# set of processes that marked it held; ARGV: tombstone, ttl, session id, '1'
# if the deleting process holds it, the prefix of its held markers. Returns
# whether the store knew the session (a snapshot, a route, or a live held
# marker), and the chunk keys its snapshots listed (to delete those unused).
# Of a session that exists nowhere it leaves no tombstone: deletes of junk
# ids cost the store nothing.
_DELETE = """
local known = redis.call('EXISTS', KEYS[1], KEYS[4], KEYS[5])
for _, holder in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  known = known + redis.call('DEL', ARGV[5] .. ':' .. holder)
end
redis.call('DEL', KEYS[6])
if ARGV[4] ~= '1' and known == 0 then
  return {0, {}}
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
for _, route in ipairs(redis.call('HKEYS', KEYS[4])) do
  if route ~= '~gen' and redis.call('GET', route) == ARGV[3] then redis.call('DEL', route) end
end
redis.call('DEL', KEYS[4])
local chunks = redis.call('SMEMBERS', KEYS[5])
redis.call('DEL', KEYS[5])
return {known, chunks}
"""

# The session's routes (a hash: route key -> conversation) also count its
# route changes ('~gen'), so a change made late (owed while Redis was down)
# is made only if no other process changed the session's routes since.

# KEYS: route, the session's routes, tombstone; ARGV: session id, ttl, the
# tombstone the session's copy here began under ('' for none), the
# conversation, the generation it must find ('' for any). The session's older
# routes go: it holds only its latest conversation, and a fork of an older one
# must start a session of its own, never take this one over. Returns the new
# generation, or -1 if refused.
_ROUTE = """
local deleted = redis.call('GET', KEYS[3])
if deleted and deleted ~= ARGV[3] then return -1 end
local gen = tonumber(redis.call('HGET', KEYS[2], '~gen') or '0')
if ARGV[5] ~= '' and gen ~= tonumber(ARGV[5]) then return -1 end
for _, route in ipairs(redis.call('HKEYS', KEYS[2])) do
  if route ~= '~gen' and route ~= KEYS[1] and redis.call('GET', route) == ARGV[1] then
    redis.call('DEL', route)
  end
end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('HSET', KEYS[2], KEYS[1], ARGV[4], '~gen', gen + 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return gen + 1
"""

# KEYS: the session's routes; ARGV: session id, the generation it must find
# ('' for any). Takes every route of the session out of the map (a turn on it
# by its id begins). Returns {the new generation (-1: refused), the
# conversation of the route it held ('' for none), 1 if the session ever had
# a route (it is an automatic session) else 0}.
_TAKE_SESSION = """
local gen = tonumber(redis.call('HGET', KEYS[1], '~gen') or '0')
if ARGV[2] ~= '' and gen ~= tonumber(ARGV[2]) then return {-1, '', 0} end
local held = ''
local routes = redis.call('HGETALL', KEYS[1])
for i = 1, #routes, 2 do
  if routes[i] ~= '~gen' and redis.call('GET', routes[i]) == ARGV[1] then
    redis.call('DEL', routes[i])
    held = routes[i + 1]
  end
end
if #routes > 0 then
  gen = gen + 1
  redis.call('HSET', KEYS[1], '~gen', gen)
end
return {gen, held, #routes > 0 and 1 or 0}
"""

# KEYS: per session held here, its held mark, its set of holders and its
# tombstone; ARGV: ttl, this process's name, then per session the tombstone
# its copy here began under ('' for none) and the copy's mark token. Keeps the
# marks of the copies here alive, but not of one deleted since it began (a
# tombstone other than its own; its own having expired is no delete), nor a
# mark another copy here set since (a newer token): returns the deleted
# (1-based).
_REFRESH = """
local deleted = {}
for i = 1, #KEYS / 3 do
  local found = redis.call('GET', KEYS[3 * i]) or ''
  local mark = redis.call('GET', KEYS[3 * i - 2])
  if found ~= '' and found ~= ARGV[1 + 2 * i] then
    deleted[#deleted + 1] = i
  elseif not mark or mark == ARGV[2 + 2 * i] then
    redis.call('SET', KEYS[3 * i - 2], ARGV[2 + 2 * i], 'EX', ARGV[1])
    redis.call('SADD', KEYS[3 * i - 1], ARGV[2])
    redis.call('EXPIRE', KEYS[3 * i - 1], ARGV[1])
  end
end
return deleted
"""

# KEYS: per ended copy here, its held mark and its set of holders; ARGV: this
# process's name, then per copy its mark token. Removes each mark only if it
# is still that copy's: a copy begun here since has marked it anew.
_RELEASE = """
for i = 1, #KEYS / 2 do
  if redis.call('GET', KEYS[2 * i - 1]) == ARGV[1 + i] then
    redis.call('DEL', KEYS[2 * i - 1])
    redis.call('SREM', KEYS[2 * i], ARGV[1])
  end
end
return 0
"""

# KEYS: routes, longest conversation first; ARGV: the namespace's session
# prefix. Takes the first route of the namespace out of the map and returns
# {its position (1-based), its session}, or {} if there is none.
_TAKE = """
for i = 1, #KEYS do
  local session = redis.call('GET', KEYS[i])
  if session and string.sub(session, 1, #ARGV[1]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    return {i, session}
  end
end
return {}
"""


# A copy here whose session was deleted elsewhere, seen by the marks' refresh:
# its next turn drops it even after the tombstone has expired.
_GONE = object()
# A copy here that began while Redis could not say which tombstone it began
# under: any tombstone found later counts as a delete of it. So a session
# deleted, then used again under the same id while Redis could not answer, is
# taken for deleted once Redis is back: its copy here is dropped (GET and
# listings no longer show it, its history here goes; the next turn prefills
# the whole conversation its client sends), and no snapshot of it is stored
# until the old tombstone expires. Safer than serving a deleted session.
_UNKNOWN = object()


def _epoch_arg(epoch) -> bytes:
    """An epoch as the Lua scripts compare it: '' for none; for a copy begun
    unknown, a value no tombstone ever equals."""
    if epoch is None:
        return b""
    return b"~unknown" if epoch is _UNKNOWN else epoch


class StoreMiss(Exception):
    """Why a stored snapshot was not used (a reason label and a message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _Unpublished(Exception):
    """A snapshot whose chunks kept disappearing (maxmemory): not published."""


def _digest(data) -> str:
    return hashlib.sha256(data).hexdigest()


_EXPECTED = "redis://[[user]:password@]host[:port][/db] (or rediss://, unix://)"


def _location(url: str) -> str | None:
    """What of ``url`` (after its scheme) a message may show, credentials as
    ``***``; None where it does not parse cleanly, since then any piece of it
    may be part of a password (one holding '#', '/' or '?' not percent-encoded,
    a ':' typed for '@')."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if "#" in url or "@" in parts.path or "@" in parts.query:
        return None
    if parts.scheme == "unix":
        return parts.path or None
    host = parts.hostname
    if not host or not re.fullmatch(r"(/\d*)?", parts.path):
        return None
    location = f"[{host}]" if ":" in host else host
    if port is not None:
        location += f":{port}"
    credentials = "***@" if "@" in parts.netloc else ""
    return f"{credentials}{location}{parts.path}{'?***' if parts.query else ''}"


def redact_url(url) -> str:
    """The URL as a message may show it: scheme, host, port and database,
    never a credential; its scheme alone where it does not parse cleanly."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    scheme, sep, _ = url.partition("://")
    if not sep:  # a host name alone may show; "user:password@host" may not
        return url if re.fullmatch(r"[A-Za-z0-9.-]*", url) else "***"
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return "***"
    return f"{scheme}://{_location(url) or '***'}"


def _secrets(url: str) -> list[str]:
    """What of ``url`` no message may show (its credentials, as written and decoded)."""
    from urllib.parse import parse_qsl, unquote

    found = []
    rest = url.partition("://")[2] or url
    if "@" in rest:
        userinfo = rest.rsplit("@", 1)[0]
        found += [userinfo, *userinfo.split(":")]
    for name, value in parse_qsl(rest.partition("?")[2], keep_blank_values=True):
        if name.lower() in ("password", "username", "user", "pass"):
            found.append(value)
    found += [unquote(f) for f in found]
    # Shorter ones would garble the message (and are no secret).
    return sorted({f for f in found if len(f) >= 3}, key=len, reverse=True)


def _scrub(text: str, secrets_: list[str]) -> str:
    """``text`` with every one of ``secrets_`` replaced by ``***``."""
    for secret in secrets_:
        text = text.replace(secret, "***")
    return text


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StoreMiss("malformed", f"unknown dtype {name!r}")
    return dtype


class RedisTier(Tier):
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

    reload_reason = "store_reload"
    shared = True  # other processes write it: consulted even for resident sessions

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
        try:
            import redis  # the optional dependency, needed only here
        except ImportError:
            raise ImportError(
                "the Redis store needs the redis client: pip install 'kvchat[redis]'"
            ) from None

        if not isinstance(url, str) or "://" not in url:
            raise ValueError(
                f"store must be a redis:// URL, as {_EXPECTED}, got {redact_url(url)!r}"
            )
        if _location(url) is None:  # never the client's own message: it may quote a password
            raise ValueError(
                f"store URL {redact_url(url)!r} is not a Redis URL: expected {_EXPECTED}, "
                "with any '@', ':', '/', '?' or '#' in a user name or password percent-encoded"
            )
        if write not in WRITE_POLICIES:
            raise ValueError(f"write must be one of {WRITE_POLICIES}, got {write!r}")
        for name, value in (("ttl", ttl), ("timeout", timeout), ("retry_after", retry_after)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value in (("block_tokens", block_tokens), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        try:
            self._redis = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError as error:  # its text may quote the URL's parts: never shown
            raise ValueError(
                f"store URL {redact_url(url)!r} is not a Redis URL the client takes "
                f"({type(error).__name__}): expected {_EXPECTED}"
            ) from None
        self._errors = (redis.RedisError, OSError)
        self._watch_error = redis.WatchError
        self._publish = self._redis.register_script(_PUBLISH)
        self._delete = self._redis.register_script(_DELETE)
        self._route = self._redis.register_script(_ROUTE)
        self._take = self._redis.register_script(_TAKE)
        self._take_session = self._redis.register_script(_TAKE_SESSION)
        self._refresh = self._redis.register_script(_REFRESH)
        self._release = self._redis.register_script(_RELEASE)
        # Never the password: the URL as messages may show it.
        self.url, self.ttl, self.write_policy = redact_url(url), int(max(1, round(ttl))), write
        self._secrets = _secrets(url)  # scrubbed from the client's error texts
        self.keeps_evicted = write == "evict"
        self.writes_turns = write == "turn"
        self._retry_after, self._prefix, self._call_timeout = retry_after, prefix, timeout
        self._block_tokens, self._chunk_bytes = block_tokens, chunk_bytes
        self._down_until = 0.0
        self._prefill_ms_per_token: float | None = None
        self._load_ms_per_byte = _DEFAULT_MS_PER_BYTE
        self.misses: Counter[str] = Counter()  # reason -> count
        self.write_errors = 0
        self.chunks_written = 0
        self.bytes_written = 0
        # The background writer: per session, the newest snapshot not yet written.
        self._pending: OrderedDict[str, tuple] = OrderedDict()
        self._writing: str | None = None  # the session being written now
        # Per session held here: the tombstone its copy here began under (None:
        # none). Entries go when the copy here ends (forget, released), so it
        # holds no more than this process's sessions, whatever is deleted.
        self._epochs: dict[str, bytes | None] = {}
        self._turn_epoch = threading.local()  # what this thread's turn saw
        # Route changes the store could not take (it was down), per session, the
        # newest only: paid by the writer thread once the store is back, so a
        # route written before the outage never outlives the session's moving on.
        self._owed: dict[str, tuple] = {}
        self._route_lock = threading.Lock()  # one route change at a time, in order
        # Per session, the generation of its routes after this process's last
        # change: an owed change is made only if the store still has it.
        self._gens: OrderedDict[str, int] = OrderedDict()
        # This process's mark on the sessions it holds (see held_key): per copy
        # here, the token its mark holds (a copy begun anew marks it anew); and
        # per copy that ended, the token of the mark to remove (the writer
        # removes them: the caller may hold a lock the event loop waits on).
        self._holder = secrets.token_hex(8)
        self._marks: dict[str, bytes] = {}
        self._releasing: dict[str, bytes] = {}
        self._next_refresh = time.monotonic() + self._refresh_every()
        self._closed = False
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="kvchat-store", daemon=True)
        # Network reads only (never a torch op, which would start an OpenMP team there).
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvchat-store-fetch")
        self._writer.start()

    # ------------------------------------------------------------ naming
    def bind(self, fingerprint, bridge, device) -> None:
        super().bind(fingerprint, bridge, device)
        self._model_key = _digest(json.dumps(fingerprint, sort_keys=True).encode())[:24]

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}:{self._model_key}:{kind}:{_digest(name.encode())[:32]}"

    def manifest_key(self, session_id: str) -> str:
        return self._key("session", session_id)

    def tombstone_key(self, session_id: str) -> str:
        return self._key("deleted", session_id)

    def _routes_key(self, session_id: str) -> str:
        """The hash of the session's routes (route key -> conversation)."""
        return self._key("route-of", session_id)

    def held_key(self, session_id: str, holder: str | None = None) -> str:
        """This process's (or ``holder``'s) mark that it holds a copy of the
        session: set when the copy begins a turn, kept alive (``ttl``) while
        the copy lasts, removed when it goes. A delete on a process that holds
        nothing of the session still reaches every one that does, even when
        no snapshot is stored."""
        return f"{self._key('held', session_id)}:{holder or self._holder}"

    def _holders_key(self, session_id: str) -> str:
        """The set of processes that marked the session held."""
        return self._key("holders", session_id)

    def _refresh_every(self) -> float:
        return min(max(self.ttl / 4, 0.25), 3600.0)

    def _chunks_key(self, session_id: str) -> str:
        """The set of every chunk key the session's snapshots listed."""
        return self._key("chunks", session_id)

    def _scope(self, session_id: str) -> str:
        """Where the session's chunks are shared: its namespace (as the core
        isolates them) with ``isolate_namespaces``, else everywhere."""
        if not self.isolate_namespaces:
            return ""
        name, slash, _ = session_id.partition("/")
        return f"{name}/" if slash else f"{session_id}/"

    def index_key(self, session_id: str) -> str:
        """The hash listing the manifests of the session's scope."""
        return self._key("index", self._scope(session_id))

    def chunk_key(self, digest: str, session_id: str) -> str:
        """A chunk of ``session_id``'s scope (chunks are never shared across scopes)."""
        return f"{self._key('chunk', self._scope(session_id))}:{digest}"

    # ------------------------------------------------------------ routes
    # kvchat serve's map from a conversation (a digest of its messages) to the
    # session holding it, shared so that any replica continues any conversation.
    def route_key(self, namespace: str, conversation: str) -> str:
        name = _digest(f"{namespace}\0{conversation}".encode())[:32]
        return f"{self._prefix}:{self._model_key}:route:{name}"

    def remember_route(self, namespace: str, conversation: str, session_id: str) -> None:
        self._change_route(session_id, ("route", namespace, conversation))

    def take_session_route(self, session_id: str) -> tuple[bool, str | None]:
        return self._change_route(session_id, ("take",)) or (False, None)

    def _change_route(self, session_id: str, change: tuple):
        """Makes ``change`` to the session's routes now; if the store cannot
        take it, owes it (superseding any older change owed)."""
        with self._route_lock:
            with self._cond:
                self._owed.pop(session_id, None)  # this one is newer
            if self._available():
                try:
                    return self._route_change(session_id, change)[1]
                except self._errors as error:
                    self._failed("route write", error)
            with self._cond:  # with what this process knew of the session's routes
                self._owed[session_id] = (change, self._gens.get(session_id, 0))
                self._cond.notify_all()  # the writer pays it once the store is back
        return None

    def _route_change(self, session_id: str, change: tuple, gen: int | None = None):
        """Under the route lock: a route write ("route", namespace,
        conversation), never for a session deleted since its copy here began;
        or ("take",): the session's routes leave the map. ``gen``: made only
        if the session's routes are at that generation. Returns (whether it
        was made, and for a take: (whether the session ever had a route, the
        conversation of the route it removed, or None))."""
        if change[0] == "take":
            made, held, routed = self._take_session(
                keys=[self._routes_key(session_id)], args=[session_id, "" if gen is None else gen]
            )
            held = (bool(routed), held.decode() if held else None)
        else:
            _, namespace, conversation = change
            with self._cond:
                epoch = self._epochs.get(session_id)
            if epoch is _GONE:  # deleted since its copy here began: no route
                return False, None
            keys = [
                self.route_key(namespace, conversation),
                self._routes_key(session_id),  # so that deleting the session deletes its routes
                self.tombstone_key(session_id),
            ]
            args = [session_id, self.ttl, _epoch_arg(epoch), conversation]
            args.append("" if gen is None else gen)
            made, held = self._route(keys=keys, args=args), None
        made = int(made)
        if made >= 0:
            with self._cond:
                self._gens[session_id] = made
                self._gens.move_to_end(session_id)
                while len(self._gens) > _GENERATIONS_KEPT:
                    self._gens.popitem(last=False)
        return made >= 0, held

    def _pay_owed(self) -> None:
        """Under the route lock, the store being back: makes the owed route
        changes, oldest first; what fails stays owed. A route write is made
        only if no other process changed that session's routes since this one
        last did: the other's change is the newer, and it removed the routes
        written before it. A take is always made, whatever this process knew
        of the session: no route of a session continued here may stand (a
        fork would find it), and a route taken too many costs only a prefill."""
        with self._cond:  # each stays owed until made (owed_routes() counts it till then)
            owed = list(self._owed.items())
        for session_id, entry in owed:
            change, gen = entry
            try:
                if not self._available():
                    continue  # stays owed
                made, _ = self._route_change(
                    session_id, change, None if change[0] == "take" else gen
                )
                if not made:
                    logger.info("kvchat: route change of session %r superseded", session_id)
            except self._errors as error:
                self._failed("route write", error)
                continue  # stays owed
            except Exception:  # a bug must not kill the writer, nor loop
                logger.exception("kvchat: route change of session %r failed", session_id)
            with self._cond:  # paid (unless a newer change replaced it meanwhile)
                if self._owed.get(session_id) is entry:
                    del self._owed[session_id]

    def _forget_gen(self, session_id: str) -> None:
        """The session's route generation, once nothing here needs it: no
        copy here, no change owed."""
        with self._cond:
            if session_id not in self._epochs and session_id not in self._owed:
                self._gens.pop(session_id, None)

    def owed_routes(self) -> int:
        """Route changes waiting for the store to be back."""
        with self._cond:
            return len(self._owed)

    def take_route(self, namespace: str, conversations: list[str]) -> tuple[str, str] | None:
        if not conversations:
            return None
        if not self._available():
            raise StoreUnavailable("the Redis store is resting after a failure")
        keys = [self.route_key(namespace, c) for c in conversations]
        with self._route_lock:  # after any route change made before it
            self._pay_owed()  # a stale route must not be found first
            if not self._available():  # it failed while this call waited, or as it paid
                raise StoreUnavailable("the Redis store is resting after a failure")
            try:
                found = self._take(keys=keys, args=[f"{namespace}/"])
            except self._errors as error:
                self._failed("route lookup", error)
                raise StoreUnavailable(f"route lookup failed: {type(error).__name__}") from None
            if not found:
                return None
            position, session = found
            session = session.decode("utf-8", errors="replace")
            with self._cond:
                self._owed.pop(session, None)  # this take is newer
            try:  # counted as a change of its routes: what this process owes later is checked
                self._route_change(session, ("take",))
            except self._errors as error:  # taken all the same; a late change of it is refused
                self._failed("route lookup", error)
        return session, conversations[int(position) - 1]

    # ------------------------------------------------------------ health
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def available(self) -> bool:
        return self._available()

    def _failed(self, what: str, error: Exception) -> None:
        self._down_until = time.monotonic() + self._retry_after
        logger.warning(
            "kvchat: Redis store %s failed (%s: %s); going on without it for %g s",
            what,
            type(error).__name__,
            _scrub(str(error), self._secrets),
            self._retry_after,
        )

    def observe_prefill(self, tokens: int, ms: float) -> None:
        if tokens >= 16:  # shorter prefills are dominated by fixed costs
            self._prefill_ms_per_token = (
                ms / tokens
                if self._prefill_ms_per_token is None
                else (1 - _SMOOTHING) * self._prefill_ms_per_token + _SMOOTHING * ms / tokens
            )

    # ------------------------------------------------------------ writing
    # Both run on the caller's (the turn's) thread and only describe the state;
    # the writer thread then runs no torch op that starts an OpenMP team: a
    # second team's idle workers slow every op of the turns (60% per token).
    def put(self, session_id: str, state: _C.CachedState) -> None:
        """Eviction dropped this session (``write="evict"``): store what it held."""
        with self._cond:
            epoch = self._epochs.get(session_id)
        if epoch is not _GONE:  # else deleted since the copy began: never stored
            self._enqueue(session_id, (*encode_state(state, self.bridge.slots), [], epoch))

    def turn_finished(self, session_id: str, state: _C.CachedState, messages: list) -> None:
        """A turn finished (``write="turn"``): store the session as it now is."""
        # The tombstone this turn's copy began under (seen on this thread, under
        # the session's lease): a delete since then refuses the snapshot.
        seen = getattr(self._turn_epoch, "seen", None)
        if seen is not None and seen[0] == session_id:
            epoch = seen[1]
        else:
            with self._cond:
                epoch = self._epochs.get(session_id)
        if epoch is not _GONE:
            self._enqueue(session_id, (*encode_state(state, self.bridge.slots), messages, epoch))

    # ------------------------------------------------------------ deleting
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
                token = self._marks.get(session_id) or secrets.token_hex(8).encode()
        found = self._tombstones([session_id], held=(session_id, token) if update else None)
        if found is None:
            with self._cond:
                gone = self._epochs.get(session_id, None) is _GONE
                if update:
                    if gone:  # dropped now: a new copy begins; no mark of the old is left
                        self._marks.pop(session_id, None)
                        token = secrets.token_hex(8).encode()
                    if gone or session_id not in self._epochs:
                        # Begun unknown: the refresh marks it once Redis is back,
                        # and any tombstone found later is a delete of it.
                        self._epochs[session_id] = _UNKNOWN
                        self._marks[session_id] = token
                        self._next_refresh = min(self._next_refresh, time.monotonic())
                        self._cond.notify_all()
            return gone
        (found,) = found
        with self._cond:
            deleted = self._deleted(session_id, found)
            if update:
                if not self._epochs:  # the writer may sleep with no mark to refresh
                    self._cond.notify_all()
                self._epochs[session_id] = found
                self._marks[session_id] = token
        if update:
            self._turn_epoch.seen = (session_id, found)
        return deleted

    def deleted_among(self, session_ids: list[str]) -> set[str]:
        found = self._tombstones(session_ids)
        if found is None:  # only what the marks' refresh saw
            with self._cond:
                return {s for s in session_ids if self._epochs.get(s, None) is _GONE}
        with self._cond:
            return {s for s, f in zip(session_ids, found, strict=True) if self._deleted(s, f)}

    def _deleted(self, session_id: str, found: bytes | None) -> bool:
        """Under the lock: whether tombstone ``found`` is newer than the copy
        here, or the refresh saw one that has expired since."""
        if session_id not in self._epochs:
            return False
        epoch = self._epochs[session_id]
        return (
            epoch is _GONE
            or (found is not None and epoch is _UNKNOWN)
            or (found is not None and epoch != found)
        )

    def _tombstones(
        self, session_ids: list[str], held: tuple[str, bytes] | None = None
    ) -> list[bytes | None] | None:
        """The sessions' tombstones (None: none), or None when Redis cannot say.
        ``held``: (a session whose copy here begins a turn, its mark token);
        its held mark is set in the same round trip."""
        if not self._available():
            return None
        found = []
        try:
            if held is not None:
                pipe = self._redis.pipeline(transaction=False)
                pipe.mget([self.tombstone_key(s) for s in session_ids])
                self._mark_held(pipe, [held])
                return pipe.execute()[0]
            for start in range(0, len(session_ids), _TOMBSTONE_BATCH):
                batch = session_ids[start : start + _TOMBSTONE_BATCH]
                found += self._redis.mget([self.tombstone_key(s) for s in batch])
        except self._errors as error:
            self._failed("tombstone read", error)
            return None
        except Exception:  # never into a turn
            logger.exception("kvchat: tombstone read failed")
            return None
        return found

    def _mark_held(self, pipe, held) -> None:
        for session_id, token in held:
            pipe.set(self.held_key(session_id), token, ex=self.ttl)
            pipe.sadd(self._holders_key(session_id), self._holder)
            pipe.expire(self._holders_key(session_id), self.ttl)

    def _refresh_held(self) -> None:
        """On the writer thread: keeps the held marks of the copies here alive,
        but not of those deleted elsewhere since they began: each of those is
        remembered as deleted (its tombstone may expire before its next turn,
        which must still drop it). A copy that ends meanwhile has its mark
        removed after this (by token), on this thread."""
        with self._cond:
            held = [
                (s, e, self._marks[s])
                for s, e in self._epochs.items()
                if e is not _GONE and s in self._marks
            ]
        try:
            for start in range(0, len(held), _TOMBSTONE_BATCH):
                batch = held[start : start + _TOMBSTONE_BATCH]
                keys, args = [], [self.ttl, self._holder]
                for session_id, epoch, token in batch:
                    keys += [
                        self.held_key(session_id),
                        self._holders_key(session_id),
                        self.tombstone_key(session_id),
                    ]
                    args += [_epoch_arg(epoch), token]
                deleted = self._refresh(keys=keys, args=args)
                with self._cond:
                    for i in deleted:
                        session_id, epoch, _ = batch[int(i) - 1]
                        if self._epochs.get(session_id, _GONE) == epoch:
                            self._epochs[session_id] = _GONE
        except self._errors as error:
            self._failed("held marks' refresh", error)
            with self._cond:  # tried again once the rest ends, not a ttl / 4 later
                self._next_refresh = min(self._next_refresh, self._down_until)

    def released(self, session_id: str) -> None:
        """The copy here ended: its mark goes (on the writer thread, so the
        caller never waits on Redis), and a delete of it elsewhere is a 404
        if no copy is left."""
        with self._cond:
            self._epochs.pop(session_id, None)
            token = self._marks.pop(session_id, None)
            if token is not None:
                self._releasing[session_id] = token
                self._cond.notify_all()
        self._forget_gen(session_id)

    def _release_marks(self) -> None:
        """On the writer thread: removes the marks of the copies that ended
        here, each only if it is still that copy's (compared in Redis: a copy
        begun here since marked it anew); what fails is tried again."""
        with self._cond:
            ending, self._releasing = self._releasing, {}
        keys, args = [], [self._holder]
        for session_id, token in ending.items():
            keys += [self.held_key(session_id), self._holders_key(session_id)]
            args.append(token)
        try:
            self._release(keys=keys, args=args)
        except self._errors as error:
            self._failed("held marks' removal", error)
            with self._cond:
                for session_id, token in ending.items():
                    self._releasing.setdefault(session_id, token)

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
        with self._cond:
            self._pending.pop(session_id, None)  # never written now
            self._owed.pop(session_id, None)  # its routes go with it
            self._epochs.pop(session_id, None)  # a copy here begins anew, if ever
            self._marks.pop(session_id, None)  # the delete removes every mark
            self._releasing.pop(session_id, None)
            self._gens.pop(session_id, None)
            self._cond.notify_all()
        keys = [
            self.manifest_key(session_id),
            self.tombstone_key(session_id),
            self.index_key(session_id),
            self._routes_key(session_id),
            self._chunks_key(session_id),
            self._holders_key(session_id),
        ]
        args = [token, self.ttl, session_id, "1" if held_here else "0"]
        args.append(self._key("held", session_id))  # + ":" + holder: each process's mark
        try:
            existed, chunks = self._delete(keys=keys, args=args)
        except self._errors as error:
            self.write_errors += 1
            self._failed(f"delete of session {session_id!r}", error)
            raise StoreUnavailable(f"Redis failed: {type(error).__name__}") from None
        digests = {key.rsplit(b":", 1)[-1].decode() for key in chunks}
        if digests:
            self._collect(session_id, digests)
        return bool(existed)

    def _collect(self, session_id: str, digests) -> None:
        """Deletes those of ``digests`` (chunks of the session's scope) that no
        live manifest of the scope lists. Atomic against publishes (WATCH on the
        scope's index, which every publish writes): a snapshot published in
        between is seen, or the deletion is tried again."""
        index = self.index_key(session_id)
        for _attempt in range(3):
            try:
                with self._redis.pipeline(transaction=True) as pipe:
                    pipe.watch(index)
                    names = pipe.hkeys(index)
                    used, stale = set(), []
                    for i in range(0, len(names), _FETCH_BATCH):
                        batch = names[i : i + _FETCH_BATCH]
                        for name, raw in zip(batch, pipe.mget(batch), strict=True):
                            if raw is None:
                                stale.append(name)  # expired or evicted
                                continue
                            entries = json.loads(raw)["tensors"].values()
                            used.update(d for e in entries for d in e["chunks"])
                    doomed = [self.chunk_key(d, session_id) for d in digests if d not in used]
                    pipe.multi()
                    for i in range(0, len(doomed), 1024):
                        pipe.delete(*doomed[i : i + 1024])
                    if stale:
                        pipe.hdel(index, *stale)
                    pipe.execute()
                    return
            except self._watch_error:
                continue
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                logger.warning(
                    "kvchat: chunks of session %r left to expire: a manifest of its scope "
                    "is unreadable (%s)",
                    session_id,
                    error,
                )
                return
            except self._errors as error:
                self._failed(f"chunk deletion of session {session_id!r}", error)
                return
        logger.info("kvchat: chunks of session %r left to expire (busy scope)", session_id)

    def _enqueue(self, session_id: str, job: tuple) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending.pop(session_id, None)  # superseded: only the newest is written
            self._pending[session_id] = job
            self._cond.notify_all()

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits until every snapshot queued so far (or ``session_id``'s) is
        written or failed. Returns False if ``timeout`` seconds passed first."""

        def done() -> bool:
            if session_id is None:
                return not self._pending and self._writing is None
            return session_id not in self._pending and self._writing != session_id

        with self._cond:
            return self._cond.wait_for(done, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Writes what is queued, makes the route changes and mark removals
        owed (waiting, within ``timeout``, for a store that rests after a
        failure), then stops the writer."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        self.flush(left())
        with self._cond:
            if self._owed or self._releasing:
                # Until the rest ends, and a second for the writer's round trip;
                # leaving the writer one call's time to end within the timeout.
                wait = max(self._down_until - time.monotonic(), 0.0) + 1.0
                if deadline is not None:
                    wait = min(wait, max(left() - self._call_timeout, 0.0))
                self._cond.wait_for(lambda: not (self._owed or self._releasing), wait)
            self._closed = True
            self._cond.notify_all()
        self._writer.join(left())
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    def _wait_for_work(self) -> str:
        """Under the lock: waits for the next work, the most urgent first:
        owed route changes once the store is back ("owed"), marks of copies
        that ended ("release"), the time to refresh the held marks
        ("refresh"), a snapshot to write ("write"), or close ("close"). So a
        steady stream of snapshots never starves the others."""
        while True:
            now = time.monotonic()
            back = now >= self._down_until
            if self._owed and back:
                return "owed"
            if self._releasing and back:
                return "release"
            if self._epochs and now >= self._next_refresh:
                return "refresh"
            if self._pending:
                return "write"
            if self._closed:
                return "close"
            deadline = self._next_refresh if self._epochs else None
            if self._owed or self._releasing:
                deadline = min(deadline or self._down_until, self._down_until)
            self._cond.wait(None if deadline is None else max(deadline - now, 0.01))

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                work = self._wait_for_work()
                if work == "close":
                    return
                if work == "write":
                    session_id, (layout, tensors, messages, epoch) = self._pending.popitem(
                        last=False
                    )
                    self._writing = session_id
            if work == "owed":
                with self._route_lock:
                    self._pay_owed()
                with self._cond:
                    self._cond.notify_all()  # close() may wait for it
                continue
            if work == "release":
                self._release_marks()
                with self._cond:
                    self._cond.notify_all()
                continue
            if work == "refresh":
                if self._available():
                    self._next_refresh = time.monotonic() + self._refresh_every()
                    self._refresh_held()
                else:  # once the store is back
                    self._next_refresh = max(self._down_until, time.monotonic() + 0.01)
                continue
            try:
                if not self._available():
                    self.write_errors += 1  # Redis is resting: this snapshot is lost
                elif layout is not None:
                    self._write(session_id, layout, tensors, messages, epoch)
            except self._errors as error:
                self.write_errors += 1
                self._failed(f"write of session {session_id!r}", error)
            except _Unpublished as error:
                self.write_errors += 1
                logger.warning("kvchat: session %r not stored: %s", session_id, error)
            except Exception:  # a bug here must not kill the writer
                self.write_errors += 1
                logger.exception("kvchat: storing session %r failed", session_id)
            finally:
                del tensors  # the tensors go here, outside any lock
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _pieces(self, tensor: torch.Tensor, by_tokens: bool) -> tuple[str, list[bytes]]:
        """The tensor cut into chunks: a full-attention layer's keys or values
        ([1, heads, tokens, dim]) along the token axis, so whole blocks of a
        prefix keep their bytes as it grows; any other by bytes."""
        array = _bytes_view(tensor)  # numpy, so no torch op runs on this thread
        if by_tokens and tensor.dim() == 4 and tensor.shape[2] > 0:
            per_token = max(1, tensor[:, :, :1].numel() * tensor.element_size())
            block = max(1, min(self._block_tokens, self._chunk_bytes // per_token))
            return "tokens", [
                array[:, :, a : a + block].tobytes() for a in range(0, tensor.shape[2], block)
            ]
        raw = array.tobytes()
        step = self._chunk_bytes
        return "bytes", [raw[a : a + step] for a in range(0, len(raw), step)] or [b""]

    def _write(
        self, session_id: str, layout: dict, tensors: dict, messages: list, epoch: bytes | None
    ) -> None:
        chunks: dict[str, bytes] = {}
        entries = {}
        attention = _attention_tensors(layout)
        for name, tensor in tensors.items():
            split, pieces = self._pieces(tensor, name in attention)
            digests = []
            for piece in pieces:
                digest = _digest(piece)
                chunks[digest] = piece
                digests.append(digest)
            entries[name] = {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "split": split,
                "chunks": digests,
                "bytes": [len(p) for p in pieces],
            }
        layout = dict(layout)
        ids = numpy.asarray(layout.pop("ids"), dtype="<i8")
        manifest = {
            "format": FORMAT,
            "model": self._model_key,
            "fingerprint": self.fingerprint,
            "session_id": session_id,
            "ids": base64.b64encode(ids.tobytes()).decode(),
            "layout": layout,
            "messages": messages,
            "tensors": entries,
            "written_at": time.time(),
        }
        keys = [self.chunk_key(d, session_id) for d in chunks]
        # Upload only the chunks Redis lacks (a prefix's blocks are there already).
        with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            present = pipe.execute()
        missing = [d for d, there in zip(chunks, present, strict=True) if not there]
        for _attempt in range(2):
            with self._redis.pipeline(transaction=False) as pipe:
                for digest in missing:
                    pipe.set(self.chunk_key(digest, session_id), chunks[digest], ex=self.ttl)
                pipe.execute()
            self.chunks_written += len(missing)
            self.bytes_written += sum(len(chunks[d]) for d in missing)
            head = [
                self.manifest_key(session_id),
                self.tombstone_key(session_id),
                self.index_key(session_id),
                self._chunks_key(session_id),
            ]
            gone = self._publish(
                keys=[*head, *keys],
                args=[json.dumps(manifest), self.ttl, _epoch_arg(epoch), manifest["written_at"]],
            )
            if gone == -1:  # deleted since this copy began: never brought back
                logger.info("kvchat: session %r was deleted; its snapshot is dropped", session_id)
                self._collect(session_id, chunks)
                return
            if not gone:
                self.writes += 1
                return
            # Evicted between upload and publish (maxmemory): upload those again, once.
            missing = [list(chunks)[int(i) - 1] for i in gone]
        raise _Unpublished(f"{len(missing)} chunks were evicted while publishing")

    # ------------------------------------------------------------ reading
    def find_if_cheaper(
        self, session_id: str, prompt: torch.Tensor, have: int = 0, local=None
    ) -> _C.CachedState | None:
        """The stored snapshot of the session, when it covers more of ``prompt``
        than the ``have`` tokens held here (in ``local``, the session's
        ``CachedState``) and loading it beats prefilling the difference; None
        otherwise (a miss is logged and counted).

        Only what is not held here is fetched: full-attention keys and values
        for the ``have`` tokens come from ``local`` (they are keys and values
        of the same tokens), the blocks past them and every other state from
        Redis."""
        if self._closed or not self._available():
            self.misses["unavailable"] += 1
            return None
        try:
            return self._find(session_id, prompt, have, local)
        except StoreMiss as miss:
            self.misses[miss.reason] += 1
            log = logger.info if miss.reason in ("absent", "diverged") else logger.warning
            log("kvchat: store miss for session %r (%s): %s", session_id, miss.reason, miss)
        except self._errors as error:
            self.misses["unavailable"] += 1
            self._failed(f"read of session {session_id!r}", error)
        except Exception:  # whatever a snapshot holds, the turn goes on without it
            self.misses["malformed"] += 1
            logger.exception("kvchat: store miss for session %r (malformed)", session_id)
        return None

    def _find(self, session_id, prompt, have, local):
        raw = self._redis.get(self.manifest_key(session_id))
        scope = self.chunk_key("", session_id)
        if raw is None:
            raise StoreMiss("absent", "no snapshot (never written, expired or evicted)")
        try:
            manifest = json.loads(raw)
            fmt = manifest.get("format")
        except (ValueError, AttributeError) as error:
            raise StoreMiss("malformed", f"manifest is not a JSON object: {error}") from None
        if fmt != FORMAT:
            raise StoreMiss("format", f"format {fmt!r}, this kvchat reads {FORMAT!r}")
        if manifest.get("fingerprint") != self.fingerprint:
            raise StoreMiss("fingerprint", "the snapshot was written by a different model")
        if manifest.get("session_id") != session_id:
            raise StoreMiss("session", f"the snapshot is of session {manifest.get('session_id')!r}")
        try:
            ids = torch.frombuffer(bytearray(base64.b64decode(manifest["ids"])), dtype=torch.int64)
        except (KeyError, TypeError, ValueError) as error:
            raise StoreMiss("malformed", f"manifest token ids: {error}") from None
        shared = _C.common_prefix_length(ids, prompt)
        if shared <= have:
            if shared == 0:
                raise StoreMiss("diverged", "its token ids share nothing with the prompt")
            return None  # what is held here covers as much: no miss, nothing to do
        try:
            layout = dict(manifest["layout"], ids=ids.tolist())
            held = _held_here(manifest["tensors"], _attention_tensors(layout), local, have)
            # What this load fetches: the chunks past those held here.
            nbytes = sum(
                b
                for name, e in manifest["tensors"].items()
                for i, b in enumerate(e["bytes"])
                if i >= held.get(name, (0, None))[0]
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise StoreMiss("malformed", f"manifest tensors: {error}") from None
        if self._prefill_ms_per_token is not None and (
            nbytes * self._load_ms_per_byte >= (shared - have) * self._prefill_ms_per_token
        ):
            return None  # prefilling the difference is cheaper
        started = time.perf_counter()
        tensors = self._fetch(manifest["tensors"], held, scope)
        try:
            state = decode_state(layout, tensors, self.bridge, self.device)
        except (KeyError, TypeError, ValueError) as error:
            raise StoreMiss("malformed", f"does not fit this model: {error}") from None
        ms = (time.perf_counter() - started) * 1e3
        self._load_ms_per_byte = (1 - _SMOOTHING) * self._load_ms_per_byte + _SMOOTHING * ms / max(
            nbytes, 1
        )
        self.loads += 1
        return state

    def _fetch(self, entries: dict, held: dict, scope: str) -> dict[str, torch.Tensor]:
        """Every tensor a manifest lists, each chunk fetched checked against its
        name; ``held[name] = (blocks, tensor)``: its first blocks are here;
        ``scope``: the session's chunk keys' prefix."""
        try:
            order = [
                (name, d)
                for name, e in entries.items()
                for d in e["chunks"][held.get(name, (0, None))[0] :]
            ]
        except (AttributeError, KeyError, TypeError) as error:
            raise StoreMiss("malformed", f"manifest tensors: {error}") from None
        # Fetched in batches on the fetcher thread while this one checks the
        # last batch: receiving and hashing both run outside the GIL.
        batches = [order[i : i + _FETCH_BATCH] for i in range(0, len(order), _FETCH_BATCH)]
        keys = [[scope + d for _, d in batch] for batch in batches]
        pending = [self._fetcher.submit(self._redis.mget, k) for k in keys]
        data: dict[str, bytes] = {}
        try:
            for batch, future in zip(batches, pending, strict=True):
                for (name, digest), value in zip(batch, future.result(), strict=True):
                    if value is None:
                        raise StoreMiss("chunk_missing", f"chunk {digest[:12]} of {name} is gone")
                    if _digest(value) != digest:
                        raise StoreMiss("checksum", f"chunk {digest[:12]} of {name} does not match")
                    data[digest] = value
        finally:
            for future in pending:
                future.cancel()
        try:
            return {
                name: _assemble(e, data, *held.get(name, (0, None))) for name, e in entries.items()
            }
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise StoreMiss("malformed", f"a tensor does not assemble: {error}") from None

    def counters(self) -> dict:
        return {
            "store_writes": self.writes,
            "store_loads": self.loads,
            "store_misses": sum(self.misses.values()),
            "store_write_errors": self.write_errors,
            "store_miss_reasons": dict(self.misses),
        }


def _bytes_view(tensor: torch.Tensor) -> numpy.ndarray:
    """The tensor's bytes as a numpy uint8 array of the same shape (the last
    axis in bytes): a view, copied only off a GPU or where the last axis is
    strided, and then one device copy, not a CPU-parallel op."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    return tensor.view(torch.uint8).numpy()


def _attention_tensors(layout: dict) -> set[str]:
    """Names of the full-attention keys and values among a layout's layers
    (checkpoints hold none): the tensors cut by tokens."""
    names = set()
    for i, meta in enumerate(layout.get("layers") or []):
        if not isinstance(meta, dict):
            continue
        first = meta if meta.get("kind") == "attention" else (meta.get("parts") or [{}])[0]
        if isinstance(first, dict) and first.get("kind") == "attention":
            names.update((f"layer.{i}.0", f"layer.{i}.1"))
    return names


def _held_here(entries: dict, attention: set[str], local, have: int) -> dict:
    """For each full-attention tensor: (blocks, local tensor) where its first
    ``blocks`` token blocks lie within the ``have`` tokens ``local`` holds."""
    if local is None or have <= 0:
        return {}
    local_layout, local_tensors = encode_state(local, None)
    if local_layout is None or _attention_tensors(local_layout) != attention:
        return {}
    held = {}
    for name in attention:
        entry, mine = entries[name], local_tensors[name]
        shape = [int(s) for s in entry["shape"]]
        if entry["split"] != "tokens" or str(mine.dtype).removeprefix("torch.") != entry["dtype"]:
            continue
        if mine.dim() != 4 or [*mine.shape[:2], mine.shape[3]] != [*shape[:2], shape[3]]:
            continue
        per_token = shape[0] * shape[1] * shape[3] * mine.element_size()
        blocks, tokens = 0, 0
        for size in entry["bytes"]:
            if tokens + size // per_token > min(have, mine.shape[2]):
                break
            blocks, tokens = blocks + 1, tokens + size // per_token
        if blocks:
            held[name] = (blocks, mine)
    return held


def _assemble(entry: dict, data: dict[str, bytes], held: int = 0, local=None) -> torch.Tensor:
    """The tensor from its chunks; with ``held``, its first ``held`` blocks
    are the leading tokens of ``local`` (a tensor on the model's device)."""
    dtype = _dtype(entry["dtype"])
    shape = [int(s) for s in entry["shape"]]
    pieces = [data[d] for d in entry["chunks"][held:]]
    if len(entry["bytes"]) != len(entry["chunks"]) or entry["bytes"][held:] != [
        len(p) for p in pieces
    ]:
        raise ValueError("the chunk sizes the manifest lists are not the chunks' sizes")
    if entry["split"] == "bytes":
        flat = bytearray(b"".join(pieces))
        if not flat:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(flat, dtype=torch.uint8).view(dtype).reshape(shape)
    if entry["split"] != "tokens" or len(shape) != 4:
        raise ValueError(f"split {entry['split']!r} of a {len(shape)}-D tensor")
    with warnings.catch_warnings():
        # Read-only bytes, read once: torch.cat below copies them out.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        blocks = [
            torch.frombuffer(piece, dtype=torch.uint8)
            .view(dtype)
            .reshape(shape[0], shape[1], -1, shape[3])
            for piece in pieces
        ]
    tensor = torch.cat(blocks, dim=2) if blocks else None
    if held:  # joined on the model's device: what is held here never leaves it
        per_token = shape[0] * shape[1] * shape[3] * local.element_size()
        mine = local[:, :, : sum(entry["bytes"][:held]) // per_token]
        tensor = mine.clone() if tensor is None else torch.cat([mine, tensor.to(mine.device)], 2)
    if list(tensor.shape) != shape:
        raise ValueError(f"blocks make {list(tensor.shape)}, the manifest says {shape}")
    return tensor
