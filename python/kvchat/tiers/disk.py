"""Disk spill: evicted sessions' caches go to files, and come back when reading
them is cheaper than prefilling again.

The choice uses two measured rates, updated as the manager runs: prefill time
per token (from turns) and load time per byte (from loads). A file is read only
for the tokens it shares with the new prompt, and is never deleted by reading:
it stays until the session is evicted again (replaced), cleared or removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import torch

from . import _C
from .persist import SessionFileError, read_metadata, read_session, write_session
from .tier import Tier

logger = logging.getLogger("kvchat")

# Before any load is measured: 1 GB/s, a conservative disk read.
_DEFAULT_MS_PER_BYTE = 1e-6
_SMOOTHING = 0.3  # weight of the newest measurement in each running rate


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new


class Spill(Tier):
    """The disk tier: one safetensors session file per evicted session."""

    keeps_evicted = True

    def __init__(self, directory):
        super().__init__()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one reader or writer of the folder at a time
        self._prefill_ms_per_token: float | None = None
        self._load_ms_per_byte = _DEFAULT_MS_PER_BYTE

    def path_for(self, session_id: str) -> Path:
        # Any string is a valid session id; a digest is always a valid file name.
        return self.directory / (
            hashlib.sha256(session_id.encode()).hexdigest()[:32] + ".safetensors"
        )

    def observe_prefill(self, tokens: int, ms: float) -> None:
        if tokens >= 16:  # shorter prefills are dominated by fixed costs
            self._prefill_ms_per_token = _blend(self._prefill_ms_per_token, ms / tokens)

    def put(self, session_id: str, state: _C.CachedState) -> None:
        try:
            with self._lock:
                path = self.path_for(session_id)
                write_session(path, session_id, [], state, self.fingerprint, self.bridge.slots)
                self.writes += 1
        except OSError as error:  # a full disk costs a prefill later, not correctness
            logger.warning("kvchat: could not spill session %r: %s", session_id, error)

    def forget(self, session_id: str, held_here: bool = True) -> bool:
        with self._lock:
            path = self.path_for(session_id)
            held = path.exists()
            path.unlink(missing_ok=True)
            return held

    def find_if_cheaper(
        self, session_id: str, prompt: torch.Tensor, have: int = 0
    ) -> _C.CachedState | None:
        """The session's spilled cache, when reading it beats prefilling what it
        shares with ``prompt``; None otherwise."""
        path = self.path_for(session_id)
        with self._lock:
            if not path.exists():
                return None
            try:
                layout = json.loads(read_metadata(path)["cache"])
                if layout is None:
                    return None
                ids = torch.tensor(layout["ids"], dtype=torch.long)
                shared = _C.common_prefix_length(ids, prompt)
                nbytes = path.stat().st_size
                if self._prefill_ms_per_token is not None and (
                    nbytes * self._load_ms_per_byte >= shared * self._prefill_ms_per_token
                ):
                    return None
                started = time.perf_counter()
                saved = read_session(path, self.fingerprint, self.device, self.bridge)
            except (SessionFileError, OSError, ValueError, KeyError, TypeError) as error:
                # A spill file is only ever a shortcut: whatever is wrong with it is a miss.
                logger.warning("kvchat: ignoring spill file %s: %s", path, error)
                return None
            ms = (time.perf_counter() - started) * 1e3
            self._load_ms_per_byte = _blend(self._load_ms_per_byte, ms / max(nbytes, 1))
            self.loads += 1
            return saved.state
