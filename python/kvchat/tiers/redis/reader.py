"""Reading a session's snapshot back from Redis, at a turn's start.

Reading checks everything and treats any problem as a miss (logged, counted,
the turn prefills instead): no manifest (never written, or expired), another
format, another model's fingerprint or another session, token ids sharing
nothing with the prompt, a missing chunk (evicted), a chunk whose bytes do not
hash to its name, a layout that does not fit the model, or Redis down or slow.
The core then reuses only what is a true token prefix of the prompt. So a
read can cost time, never correctness, and never raises into a turn.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from ... import _C
from ..session_file import decode_state
from .chunks import StoreMiss, assemble, attention_tensors, decode_manifest, held_here
from .keys import digest
from .writer import FETCH_BATCH

logger = logging.getLogger("kvchat")


class Reader:
    def __init__(self, tier):
        self._tier, self._conn, self._keys = tier, tier.conn, tier.keys
        self.misses: Counter[str] = Counter()  # reason -> count
        # Network reads only (never a torch op, which would start an OpenMP team there).
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvchat-store-fetch")

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    def find(
        self, session_id: str, prompt: torch.Tensor, have: int, local
    ) -> _C.CachedState | None:
        """The stored snapshot of the session, when it covers more of ``prompt``
        than the ``have`` tokens held here (in ``local``, the session's
        ``CachedState``) and loading it beats prefilling the difference; None
        otherwise (a miss is logged and counted).

        Only what is not held here is fetched: full-attention keys and values
        for the ``have`` tokens come from ``local`` (they are keys and values
        of the same tokens), the blocks past them and every other state from
        Redis."""
        if not self._conn.available():
            self.misses["unavailable"] += 1
            return None
        try:
            return self._find(session_id, prompt, have, local)
        except StoreMiss as miss:
            self.misses[miss.reason] += 1
            log = logger.info if miss.reason in ("absent", "diverged") else logger.warning
            log("kvchat: store miss for session %r (%s): %s", session_id, miss.reason, miss)
        except self._conn.errors as error:
            self.misses["unavailable"] += 1
            self._conn.failed(f"read of session {session_id!r}", error)
        except Exception:  # whatever a snapshot holds, the turn goes on without it
            self.misses["malformed"] += 1
            logger.exception("kvchat: store miss for session %r (malformed)", session_id)
        return None

    def _find(self, session_id, prompt, have, local):
        tier = self._tier
        raw = self._conn.client.get(self._keys.manifest(session_id))
        if raw is None:
            raise StoreMiss("absent", "no snapshot (never written, expired or evicted)")
        manifest, ids = decode_manifest(raw, tier.fingerprint, session_id)
        shared = _C.common_prefix_length(ids, prompt)
        if shared <= have:
            if shared == 0:
                raise StoreMiss("diverged", "its token ids share nothing with the prompt")
            return None  # what is held here covers as much: no miss, nothing to do
        try:
            layout = dict(manifest["layout"], ids=ids.tolist())
            held = held_here(manifest["tensors"], attention_tensors(layout), local, have)
            # What this load fetches: the chunks past those held here.
            nbytes = sum(
                b
                for name, e in manifest["tensors"].items()
                for i, b in enumerate(e["bytes"])
                if i >= held.get(name, (0, None))[0]
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise StoreMiss("malformed", f"manifest tensors: {error}") from None
        if not tier.reload_cost.worth_loading(nbytes, shared - have):
            return None  # prefilling the difference is cheaper
        started = time.perf_counter()
        tensors = self._fetch(manifest["tensors"], held, self._keys.chunk("", session_id))
        try:
            state = decode_state(layout, tensors, tier.layout, tier.device)
        except (KeyError, TypeError, ValueError) as error:
            raise StoreMiss("malformed", f"does not fit this model: {error}") from None
        tier.reload_cost.observe_load(nbytes, (time.perf_counter() - started) * 1e3)
        tier.loads += 1
        return state

    def _fetch(self, entries: dict, held: dict, scope: str) -> dict[str, torch.Tensor]:
        """Every tensor a manifest lists, each chunk fetched checked against its
        name; ``held[name] = (blocks, tensor)``: its first blocks are here;
        ``scope``: the session's chunk keys' prefix."""
        try:
            order = [
                (name, d)
                for name, e in entries.items()
                for d in e["chunks"][held.get(name, (0, None))[0] :]
            ]
        except (AttributeError, KeyError, TypeError) as error:
            raise StoreMiss("malformed", f"manifest tensors: {error}") from None
        # Fetched in batches on the fetcher thread while this one checks the
        # last batch: receiving and hashing both run outside the GIL.
        batches = [order[i : i + FETCH_BATCH] for i in range(0, len(order), FETCH_BATCH)]
        keys = [[scope + d for _, d in batch] for batch in batches]
        pending = [self._fetcher.submit(self._conn.client.mget, k) for k in keys]
        data: dict[str, bytes] = {}
        try:
            for batch, future in zip(batches, pending, strict=True):
                for (name, chunk), value in zip(batch, future.result(), strict=True):
                    if value is None:
                        raise StoreMiss("chunk_missing", f"chunk {chunk[:12]} of {name} is gone")
                    if digest(value) != chunk:
                        raise StoreMiss("checksum", f"chunk {chunk[:12]} of {name} does not match")
                    data[chunk] = value
        finally:
            for future in pending:
                future.cancel()
        try:
            return {
                name: assemble(e, data, *held.get(name, (0, None))) for name, e in entries.items()
            }
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise StoreMiss("malformed", f"a tensor does not assemble: {error}") from None
