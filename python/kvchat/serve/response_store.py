"""Stored responses, for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``: each is a record of the response body and the
conversation it ended with, kept per API key (a namespace) for as long as
sessions are, within the key's bounds in count and bytes.

Where the records live is the backend's business (serve/store.py): this
process's memory, or the shared store every replica reads. A record larger
than a key's whole byte bound is not stored: the response says so
(``store: false``) and the server logs it, rather than let it evict every
other response of the key.
"""

from __future__ import annotations

import json
import logging
import threading

logger = logging.getLogger("kvchat.serve")


class ResponseStore:
    """Records as JSON over ``backend`` (a ``Responses``), within ``limits``
    (a ``ResponseLimits``). A backend that cannot reach its store raises
    ``StoreUnavailable``."""

    def __init__(self, backend, limits):
        self.backend, self.limits = backend, limits
        self._lock = threading.Lock()
        self.evicted = 0  # records this process's puts evicted to keep a key in its bounds

    def put(
        self, ns: str, rid: str, response: dict, conversation: list[dict], session_key=None
    ) -> bool:
        """Stores the record; False (logged) if it alone is over the key's byte
        bound. ``session_key``: the prompt_cache_key or user the turn ran under."""
        record = {"response": response, "conversation": conversation, "session_key": session_key}
        data = json.dumps(record, ensure_ascii=False).encode()
        if len(data) > self.limits.bytes_per_key:
            logger.warning(
                "kvchat serve: response %s not stored: its record is %d bytes, over the %d "
                "bytes each API key may store (--response-bytes-per-key)",
                rid,
                len(data),
                self.limits.bytes_per_key,
            )
            return False
        evicted = self.backend.put(ns, rid, data)
        with self._lock:
            self.evicted += evicted
        return True

    def get(self, ns: str, rid: str) -> dict | None:
        """{"response", "conversation", "session_key"}, or None for an id this key
        never stored (or no longer does)."""
        data = self.backend.get(ns, rid)
        return None if data is None else json.loads(data)

    def delete(self, ns: str, rid: str) -> bool:
        return self.backend.delete(ns, rid)

    def totals(self) -> tuple[int, int]:
        """(records, bytes) stored over every key: this process's, or the shared store's."""
        return self.backend.totals()
