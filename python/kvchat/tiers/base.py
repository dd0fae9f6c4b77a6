"""Storage tiers: where an evicted session's cache goes, and where that
session's next turn may find it again.

Three calls make a tier (every other has a default that keeps nothing), so a
new one plugs in without touching the turn code:

- ``put(session_id, state)``: eviction dropped this session's cache from memory;
- ``find_if_cheaper(session_id, prompt, have, local)``: a turn on ``prompt``
  begins; return a cache (a ``CachedState``) when loading it beats prefilling
  what it adds to the ``have`` tokens the session holds here (``local``, its
  resident ``CachedState``, or None), else None. ``self.reload_cost`` (a
  ``ReloadCost``) answers that from rates the manager reports;
- ``forget(session_id)``: the session was cleared or removed (True if the
  tier held it); a shared tier that cannot reach its store raises
  ``StoreUnavailable``, so a delete is never reported done when it was not.

A tier that is not ``shared`` is asked only for sessions that hold nothing
here, as ``find_if_cheaper(session_id, prompt)``; set ``keeps_evicted`` for
``put`` to be called at all. A tier that other processes share (the
Redis one) is asked at every turn, and may take every turn's result
(``writes_turns``, ``turn_finished``). It is asked at each turn's start,
under the session's lease, whether the session was deleted on another process
since its copy here began (``deleted_since``): the manager then drops the copy
here. The ``*_route`` calls keep ``kvchat serve``'s map from conversations to
sessions where every replica sees it. ``isolate_namespaces`` (set by the
manager) says whether sessions ``"namespace/name"`` may share stored data only
within their namespace.

The manager restores what ``find_if_cheaper`` returns through the core, which
checks it whole, and the turn then reuses only what is a true token prefix of
the prompt: a tier can cost time, never correctness. ``bind`` hands the tier
the model's fingerprint and ``ModelLayout`` once, for checking what it reads.
A tier serves one manager and guards itself: its calls come from any thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import _C
from .cost import ReloadCost

if TYPE_CHECKING:
    from ..bridge import ModelLayout


class StoreUnavailable(RuntimeError):
    """A shared store could not be reached to carry out a delete: the message
    says what was done (here) and what was not (there); calling again is safe."""


class Tier:
    """The interface, and the tier that keeps nothing (the default)."""

    # Whether the core should queue evicted caches for put() (False: they are dropped).
    keeps_evicted = False
    # Whether turn_finished() wants every turn's result (a tier other replicas read).
    writes_turns = False
    # Whether other processes write it, so it may hold more than a resident session.
    shared = False
    # The turn reason (TurnReport.reason) when a turn starts from this tier's cache.
    reload_reason = "spill_reload"
    # Set by the manager: sessions share stored data only within their namespace.
    isolate_namespaces = False
    # What a load is assumed to cost until one is measured.
    default_ms_per_byte = 1e-6

    def __init__(self):
        self.writes = 0  # caches put
        self.loads = 0  # caches found and handed back

    @property
    def reload_cost(self) -> ReloadCost:
        """This tier's load-versus-prefill rates, made on first use: a subclass
        that skips ``super().__init__()``, or keeps a ``cost`` of its own,
        still works."""
        cost = self.__dict__.get("_kvchat_reload_cost")
        if cost is None:
            cost = self.__dict__["_kvchat_reload_cost"] = ReloadCost(self.default_ms_per_byte)
        return cost

    def bind(self, fingerprint: dict, layout: ModelLayout, device: torch.device) -> None:
        """The model this tier serves: what a stored cache must match."""
        self.fingerprint, self.layout, self.device = fingerprint, layout, device

    def put(self, session_id: str, state: _C.CachedState) -> None:
        pass

    def turn_finished(self, session_id: str, state: _C.CachedState, messages: list) -> None:
        """A turn left the session holding ``state`` (only if ``writes_turns``)."""

    def find_if_cheaper(
        self, session_id: str, prompt: torch.Tensor, have: int = 0, local=None
    ) -> _C.CachedState | None:
        """``have``: prompt tokens the session already holds here, in ``local``
        (its ``CachedState``); 0 and None unless ``shared``."""
        return None

    def forget(self, session_id: str, held_here: bool = True) -> bool:
        """The session was cleared or removed (``held_here``: it existed in this
        process): drop what is stored of it. Returns whether the tier held
        anything of it; raises ``StoreUnavailable`` if a shared store cannot
        be reached."""
        return False

    def available(self) -> bool:
        """Whether the tier's store is believed reachable now."""
        return True

    def released(self, session_id: str) -> None:
        """The copy here ended without a delete (removed here only)."""

    def deleted_among(self, session_ids: list[str]) -> set[str]:
        """Of ``session_ids`` (held here), those another process deleted since
        their copy here began."""
        return set()

    def deleted_since(self, session_id: str, update: bool = True) -> bool:
        """A shared tier: whether another process deleted the session since its
        copy here began (``update``: remember that the copy here begins now)."""
        return False

    def observe_prefill(self, tokens: int, ms: float) -> None:
        """A turn prefilled ``tokens`` in ``ms``: the rate a load must beat."""
        self.reload_cost.observe_prefill(tokens, ms)

    def remember_route(self, namespace: str, conversation: str, session_id: str) -> None:
        """A shared tier may keep ``kvchat serve``'s map from a conversation (a
        digest of its messages) to its session, for the other replicas (its
        one route: older ones go). A store that cannot be reached takes it
        once it can, unless a newer change of the session's route came first."""

    def take_session_route(self, session_id: str) -> tuple[bool, str | None]:
        """A turn on the session by its id begins: takes its route out of the
        map (so no other replica, nor a fork of the conversation it held,
        continues it meanwhile). Returns whether the session ever had a route
        (it is ``kvchat serve``'s automatic session), and the conversation of
        the route it took (None if none). A shared store that cannot be
        reached takes it once it can, and says (False, None) now."""
        return False, None

    def take_route(self, namespace: str, conversations: list[str]) -> tuple[str, str] | None:
        """Takes the first of ``conversations`` the map knows out of the map (so
        no other replica continues that session while this one does) and
        returns (its session, that conversation); None if the map knows none.
        Raises ``StoreUnavailable`` if the map cannot be read."""
        return None

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits for writes in flight (of ``session_id`` only, if given); True
        once none is left."""
        return True

    def close(self) -> None:
        """Finishes pending writes and lets go of resources."""

    def counters(self) -> dict[str, int]:
        """The tier's counters, as ``ManagerStats`` fields."""
        return {"spill_writes": self.writes, "spill_loads": self.loads}
