"""Stored responses, for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``: each is the response body and the conversation it ended
with, kept per API key (a namespace) for as long as sessions are.

With a shared store (``--store``) they live in Redis, so a response made on one
replica is continued on any other (whose session then comes from the store
too); else in this process, the newest ``max_records``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

from ..tiers import StoreUnavailable


class ResponseStore:
    def __init__(self, tier, ttl: float, max_records: int = 10_000):
        self._ttl = ttl if ttl > 0 else None  # seconds; None: for ever
        self._redis = tier if getattr(tier, "shared", False) and hasattr(tier, "conn") else None
        self._max = max_records
        self._lock = threading.Lock()
        self._local: OrderedDict[str, tuple[float | None, bytes]] = OrderedDict()

    def put(
        self, ns: str, rid: str, response: dict, conversation: list[dict], session_key=None
    ) -> None:
        """``session_key``: the prompt_cache_key or user the turn ran under, if any."""
        record = {"response": response, "conversation": conversation, "session_key": session_key}
        data = json.dumps(record).encode()
        if self._redis is not None:
            self._call(
                "store of a response",
                self._redis.conn.client.set,
                self._key(ns, rid),
                data,
                ex=None if self._ttl is None else int(self._ttl),
            )
            return
        with self._lock:
            expires = None if self._ttl is None else time.monotonic() + self._ttl
            self._local[f"{ns}/{rid}"] = (expires, data)
            self._local.move_to_end(f"{ns}/{rid}")
            while len(self._local) > self._max:
                self._local.popitem(last=False)

    def get(self, ns: str, rid: str) -> dict | None:
        """{"response", "conversation", "session_key"}, or None for an id this key
        never stored."""
        if self._redis is not None:
            data = self._call("read of a response", self._redis.conn.client.get, self._key(ns, rid))
        else:
            with self._lock:
                expires, data = self._local.get(f"{ns}/{rid}", (None, None))
                if data is not None and expires is not None and time.monotonic() > expires:
                    del self._local[f"{ns}/{rid}"]
                    data = None
        return None if data is None else json.loads(data)

    def delete(self, ns: str, rid: str) -> bool:
        if self._redis is not None:
            return bool(
                self._call(
                    "delete of a response", self._redis.conn.client.delete, self._key(ns, rid)
                )
            )
        with self._lock:
            return self._local.pop(f"{ns}/{rid}", None) is not None

    def _key(self, ns: str, rid: str) -> str:
        return self._redis.keys.record("response", f"{ns}/{rid}")

    def _call(self, what: str, method, *args, **kwargs):
        conn = self._redis.conn
        if not conn.available():
            raise StoreUnavailable("the Redis store is resting after a failure")
        try:
            return method(*args, **kwargs)
        except conn.errors as error:
            conn.failed(what, error)
            raise StoreUnavailable(f"Redis failed: {type(error).__name__}") from None
