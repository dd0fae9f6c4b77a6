"""``kvchat serve``'s stored responses in Redis, so that every replica reads
and continues any of them: ``Responses`` (serve/store.py) with each API key
bounded in count and bytes by one script per change (scripts.py), so a key
evicts only its own oldest records and replicas never race on a key's bounds."""

from __future__ import annotations

from ..shared import StoreUnavailable


class RedisResponses:
    """Records per namespace (an API key), at most ``per_key`` of them and
    ``bytes_per_key`` bytes, each for ``ttl`` seconds (None: until evicted)."""

    def __init__(self, conn, keys, per_key: int, bytes_per_key: int, ttl: float | None):
        self._conn, self._keys = conn, keys
        self._per_key, self._bytes = per_key, bytes_per_key
        self._ttl_ms = "" if ttl is None else max(1, round(ttl * 1000))

    def _of(self, ns: str, rid: str) -> list[str]:
        """The record's key, its namespace's index and sizes."""
        record = self._keys.record
        return [
            record("response", f"{ns}/{rid}"),
            record("responses-of", ns),
            record("response-sizes", ns),
        ]

    def put(self, ns: str, rid: str, data: bytes) -> int:
        keys = [*self._of(ns, rid), self._keys.record("responses", "")]
        args = [data, self._ttl_ms, self._per_key, self._bytes]
        return int(self._call("store of a response", self._conn.put_response, keys=keys, args=args))

    def get(self, ns: str, rid: str) -> bytes | None:
        record = self._of(ns, rid)[0]
        return self._call("read of a response", self._conn.client.get, record)

    def delete(self, ns: str, rid: str) -> bool:
        deleted = self._call("delete of a response", self._conn.delete_response, self._of(ns, rid))
        return bool(deleted)

    def totals(self) -> tuple[int, int]:
        keys = [self._keys.record("responses", "")]
        records, nbytes = self._call("count of responses", self._conn.response_totals, keys)
        return int(records), int(nbytes)

    def _call(self, what: str, method, *args, **kwargs):
        conn = self._conn
        if not conn.available():
            raise StoreUnavailable("the Redis store is resting after a failure")
        try:
            return method(*args, **kwargs)
        except conn.errors as error:
            conn.failed(what, error)
            raise StoreUnavailable(f"Redis failed: {type(error).__name__}") from None
