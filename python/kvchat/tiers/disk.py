"""Disk spill: evicted sessions' caches go to files, and come back when reading
them is cheaper than prefilling again (``ReloadCost``, from measured rates).

A file is read only for the tokens it shares with the new prompt, and is never
deleted by reading: it stays until the session is evicted again (replaced),
cleared or removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import torch

from .. import _C
from .base import Tier
from .session_file import SessionFileError, read_metadata, read_session, write_session

logger = logging.getLogger("kvchat")


class Spill(Tier):
    """The disk tier: one safetensors session file per evicted session."""

    keeps_evicted = True
    default_ms_per_byte = 1e-6  # before any load is measured: 1 GB/s, a cautious disk read

    def __init__(self, directory):
        super().__init__()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one reader or writer of the folder at a time

    def path_for(self, session_id: str) -> Path:
        # Any string is a valid session id; a digest is always a valid file name.
        return self.directory / (
            hashlib.sha256(session_id.encode()).hexdigest()[:32] + ".safetensors"
        )

    def put(self, session_id: str, state: _C.CachedState) -> None:
        try:
            with self._lock:
                path = self.path_for(session_id)
                write_session(path, session_id, [], state, self.fingerprint, self.layout.slots)
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
        self, session_id: str, prompt: torch.Tensor, have: int = 0, local=None
    ) -> _C.CachedState | None:
        """The session's spilled cache, when reading it beats prefilling what it
        shares with ``prompt``; None otherwise."""

        def worth_it(path: Path) -> bool:
            layout = json.loads(read_metadata(path)["cache"])
            if layout is None:
                return False
            ids = torch.tensor(layout["ids"], dtype=torch.long)
            shared = _C.common_prefix_length(ids, prompt)
            return self.reload_cost.worth_loading(path.stat().st_size, shared)

        return self._read(session_id, worth_it, self.device, count=True)

    def stored(self, session_id: str) -> _C.CachedState | None:
        """The session's spilled cache, however long reading it takes, on the
        CPU: ``save`` only writes it out, and an accelerator's memory need not
        hold what the byte budget evicted."""
        return self._read(session_id, lambda path: True, torch.device("cpu"), count=False)

    def _read(self, session_id: str, wanted, device, count: bool) -> _C.CachedState | None:
        path = self.path_for(session_id)
        with self._lock:
            if not path.exists():
                return None
            try:
                if not wanted(path):
                    return None
                nbytes = path.stat().st_size
                started = time.perf_counter()
                saved = read_session(path, self.fingerprint, device, self.layout)
            except (SessionFileError, OSError, ValueError, KeyError, TypeError) as error:
                # A spill file is only ever a shortcut: whatever is wrong with it is a miss.
                logger.warning("kvchat: ignoring spill file %s: %s", path, error)
                return None
            if count:  # a turn's load: its rate and the counter
                self.reload_cost.observe_load(nbytes, (time.perf_counter() - started) * 1e3)
                self.loads += 1
            return saved.state

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "spill_writes": self.writes, "spill_loads": self.loads}
