"""kvchat: multi-turn KV-cache reuse for HuggingFace transformers.

from kvchat import SessionManager
mgr = SessionManager(model, tokenizer)
reply = mgr.chat("alice", messages)
"""

import logging


def _check_torch_matches_build() -> None:
    # Checked before _C loads: a mismatched libtorch fails there with an
    # unreadable undefined-symbol error instead.
    import torch

    try:
        from ._build_info import TORCH_VERSION
    except ImportError as error:
        raise ImportError(
            "kvchat's C++ extension is not built; install with "
            "'pip install --no-build-isolation .' from the kvchat source tree"
        ) from error
    if torch.__version__ != TORCH_VERSION:
        raise ImportError(
            f"kvchat was built against torch {TORCH_VERSION} but torch {torch.__version__} "
            "is installed; rebuild it: pip install --no-build-isolation --force-reinstall ."
        )


_check_torch_matches_build()

from . import _C  # noqa: E402
from .arguments import ContextLengthError  # noqa: E402
from .bridge.layout import LayerKind, ModelLayout  # noqa: E402
from .manager import SessionManager  # noqa: E402
from .report import ManagerStats, SessionInfo, TurnReport  # noqa: E402
from .tiers import SessionFileError, SharedTier, StoreUnavailable, Tier  # noqa: E402
from .tiers.redis import RedisTier  # noqa: E402

UnknownSessionError = _C.UnknownSessionError
# A KeyError's str() is the repr of its key; this one's is a sentence, shown as it is.
UnknownSessionError.__str__ = Exception.__str__
SessionBusy = _C.SessionBusy

logging.getLogger("kvchat").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "ContextLengthError",
    "LayerKind",
    "ManagerStats",
    "ModelLayout",
    "SessionBusy",
    "SessionFileError",
    "SessionInfo",
    "RedisTier",
    "SessionManager",
    "SharedTier",
    "StoreUnavailable",
    "Tier",
    "TurnReport",
    "UnknownSessionError",
]
