"""What ``kvchat serve`` keeps beside its sessions, behind one interface of
its own: stored Responses-API records (``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``) and the map from conversations to sessions.

Without a shared tier both live in this process (``LocalResponses``, and the
router's own map). A shared tier (``SharedTier``, the Redis one with
``--store``) must keep both, so every replica sees them: it offers
``responses(...)`` and ``routes``. One that offers neither is refused at
start, never used to share sessions while responses stay on one replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .local_responses import LocalResponses
from .response_store import ResponseStore


class Responses(Protocol):
    """Stored records, as bytes, bounded per key (namespace) in count and bytes:
    a put evicts its own key's oldest records, never another key's."""

    def put(self, ns: str, rid: str, data: bytes) -> int:
        """Stores ``data``; returns how many of the key's records it evicted."""

    def get(self, ns: str, rid: str) -> bytes | None: ...

    def delete(self, ns: str, rid: str) -> bool: ...

    def totals(self) -> tuple[int, int]:
        """(records, bytes) stored, over every key."""


class Routes(Protocol):
    """The conversation map other replicas share (tiers/redis/routes.py)."""

    def take(self, namespace: str, conversations: list[str]) -> tuple[str, str] | None: ...

    def take_session(self, session_id: str) -> tuple[bool, str | None]: ...

    def remember(self, namespace: str, conversation: str, session_id: str) -> None: ...


@dataclass(frozen=True)
class ResponseLimits:
    """The bounds of each API key's stored responses, and how long one lives."""

    per_key: int = 1000
    bytes_per_key: int = 64 * 2**20
    ttl: float | None = 24 * 3600.0  # seconds; None: until evicted

    def __post_init__(self):
        for name in ("per_key", "bytes_per_key"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class ServerStore:
    """The server's stored responses, and the shared conversation map (None:
    the router keeps its map in this process)."""

    responses: ResponseStore
    routes: Routes | None
    where: str  # for the log at start: "memory", or the shared tier's class


def server_store(tier, limits: ResponseLimits) -> ServerStore:
    """The store for a manager's ``tier``: this process's memory for a tier
    that is not shared; else the tier's own, or ValueError if it keeps none."""
    if not tier.shared:
        return ServerStore(ResponseStore(LocalResponses(limits), limits), None, "memory")
    backend = tier.responses(limits.per_key, limits.bytes_per_key, limits.ttl)
    if backend is None or tier.routes is None:
        raise ValueError(
            f"the shared tier {type(tier).__name__} keeps no stored responses or conversation "
            "routes (SharedTier.responses, SharedTier.routes): kvchat serve would keep them on "
            "this replica only while other replicas share its sessions"
        )
    return ServerStore(ResponseStore(backend, limits), tier.routes, type(tier).__name__)
