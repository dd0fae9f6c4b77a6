"""A tier that several processes share (the Redis one): what it adds to
``Tier``.

Other processes write it, so it may hold more of a conversation than this
process does: it is asked at every turn, with ``have`` (the prompt tokens held
here) and ``local`` (the session's resident cache). It may take every turn's
result (``writes_turns``, ``turn_finished``). At each turn's start, under the
session's lease, it says whether another process deleted the session since
its copy here began (``deleted_since``): the manager then drops the copy
here. A delete that cannot reach the store raises ``StoreUnavailable``, so it
is never reported done when it was not.

``routes`` and ``responses``: where ``kvchat serve`` keeps its map from
conversations to sessions and its stored responses, so that every replica
sees them. They are the server's (serve/store.py); the tier only stores them.
``kvchat serve`` refuses a shared tier that keeps neither (the defaults), so a
response is never kept on one replica while its session is shared.
"""

from __future__ import annotations

from .. import _C
from .base import Tier


class StoreUnavailable(RuntimeError):
    """A shared store could not be reached to carry out a delete: the message
    says what was done (here) and what was not (there); calling again is safe."""


class SharedTier(Tier):
    """The interface of a tier other processes share, with defaults that
    know of no other process."""

    shared = True
    # Whether turn_finished() wants every turn's result (else only evictions, by put).
    writes_turns = True
    # An object with remember / take / take_session (tiers/redis/routes.py), or None.
    routes = None

    def responses(self, per_key: int, bytes_per_key: int, ttl: float | None):
        """Where ``kvchat serve`` stores its responses (``Responses`` in
        serve/store.py: put, get, delete, totals), each API key within
        ``per_key`` records and ``bytes_per_key`` bytes, for ``ttl`` seconds
        (None: until evicted); None if this tier keeps none."""
        return None

    def turn_finished(self, session_id: str, state: _C.CachedState, messages: list) -> None:
        """A turn left the session holding ``state`` (only if ``writes_turns``)."""

    def forget(self, session_id: str, held_here: bool = True) -> bool:
        """As ``Tier.forget``, everywhere; raises ``StoreUnavailable`` if the
        store cannot be reached."""
        return False

    def available(self) -> bool:
        """Whether the store is believed reachable now."""
        return True

    def released(self, session_id: str) -> None:
        """The copy here ended without a delete (removed here only)."""

    def deleted_among(self, session_ids: list[str]) -> set[str]:
        """Of ``session_ids`` (held here), those another process deleted since
        their copy here began."""
        return set()

    def deleted_since(self, session_id: str, update: bool = True) -> bool:
        """Whether another process deleted the session since its copy here
        began (``update``: remember that the copy here begins now)."""
        return False
