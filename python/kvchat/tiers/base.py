"""Storage tiers: where an evicted session's cache goes, and where that
session's next turn may find it again.

Three calls make a tier, so a new one plugs in without touching the turn code:

- ``put(session_id, state)``: eviction dropped this session's cache from memory
  (called only when ``keeps_evicted`` is set);
- ``find_if_cheaper(session_id, prompt, have, local)``: a turn on ``prompt``
  begins; return a cache (a ``CachedState``) when loading it beats prefilling
  what it adds to the ``have`` tokens the session holds here (``local``, its
  resident ``CachedState``, or None), else None. ``self.reload_cost`` (a
  ``ReloadCost``) answers that from rates the manager reports;
- ``forget(session_id)``: the session was cleared or removed (True if the
  tier held it).

And one optional: ``stored(session_id)``, the session's cache read whatever it
costs, which ``save`` writes for a session that holds none in memory.

A tier is asked only for sessions that hold nothing here, as
``find_if_cheaper(session_id, prompt)``. A tier that other processes share is
a ``SharedTier`` (shared.py): it is asked at every turn and has a few more
calls. ``bind`` hands a tier the model's fingerprint and ``ModelLayout``
once, for checking what it reads; ``isolate_namespaces`` (set by the manager)
says whether sessions ``"namespace/name"`` may share stored data only within
their namespace.

The manager restores what ``find_if_cheaper`` returns through the core, which
checks it whole, and the turn then reuses only what is a true token prefix of
the prompt: a tier can cost time, never correctness. A tier serves one
manager and guards itself: its calls come from any thread.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from .. import _C
from .cost import ReloadCost

if TYPE_CHECKING:
    from ..bridge import ModelLayout


class Tier:
    """The interface, and the tier that keeps nothing (the default)."""

    # Whether the core should queue evicted caches for put() (False: they are dropped).
    keeps_evicted = False
    # Whether other processes write it (a SharedTier), so it may hold more
    # than a resident session.
    shared = False
    # The reason (TurnReport.reason) of a turn that starts from this tier's
    # cache: "spill_reload", or "store_reload" (RedisTier's); the name or the
    # core's enum. Read once, when the manager is built.
    reload_reason = _C.ReuseReason.spill_reload
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

    @property
    def bridge(self) -> ModelLayout:
        """Deprecated: ``self.layout`` (what tiers were given before; it has the
        ``slots`` and ``templates`` they read)."""
        warnings.warn("Tier.bridge is Tier.layout now", DeprecationWarning, stacklevel=2)
        return self.layout

    def bind(self, fingerprint: dict, layout: ModelLayout, device: torch.device) -> None:
        """The model this tier serves: what a stored cache must match."""
        self.fingerprint, self.layout, self.device = fingerprint, layout, device

    def put(self, session_id: str, state: _C.CachedState) -> None:
        pass

    def find_if_cheaper(
        self, session_id: str, prompt: torch.Tensor, have: int = 0, local=None
    ) -> _C.CachedState | None:
        """``have``: prompt tokens the session already holds here, in ``local``
        (its ``CachedState``); 0 and None unless ``shared``."""
        return None

    def stored(self, session_id: str) -> _C.CachedState | None:
        """The session's cache as this tier holds it, read whatever it costs
        (``save`` of a session that holds none in memory), or None. Optional:
        a tier without it leaves such a file its messages only."""
        return None

    def forget(self, session_id: str, held_here: bool = True) -> bool:
        """The session was cleared, removed, or replaced by a ``load``
        (``held_here``: it existed in this process): drop what is stored of
        it. Returns whether the tier held anything of it."""
        return False

    def observe_prefill(self, tokens: int, ms: float) -> None:
        """A turn prefilled ``tokens`` in ``ms``: the rate a load must beat."""
        self.reload_cost.observe_prefill(tokens, ms)

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits for writes in flight (of ``session_id`` only, if given); True
        once none is left."""
        return True

    def close(self) -> None:
        """Finishes pending writes and lets go of resources."""

    def counters(self) -> dict[str, int]:
        """The tier's counters, as ``ManagerStats`` fields: ``writes`` and
        ``loads`` as ``tier_writes`` and ``tier_loads``; a tier adds its own."""
        return {"tier_writes": self.writes, "tier_loads": self.loads}
