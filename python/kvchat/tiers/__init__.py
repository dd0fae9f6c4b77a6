"""Storage tiers: where a session's cache goes when memory lets it go, and
where its next turn finds it again. ``base`` is the interface (and the tier
that keeps nothing), ``shared`` what a tier several processes share adds,
``cost`` the load-versus-prefill model they share, ``disk`` the spill folder,
``redis`` the store replicas share, and ``session_file`` the format of
session files (``save()``/``load()``, the disk tier) and of the state the
Redis tier stores.
"""

from .base import Tier
from .cost import ReloadCost
from .disk import Spill
from .session_file import SessionFileError
from .shared import SharedTier, StoreUnavailable

__all__ = ["ReloadCost", "SessionFileError", "SharedTier", "Spill", "StoreUnavailable", "Tier"]
