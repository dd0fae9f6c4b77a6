"""Whether a turn's decode runs compiled, and with which ``CompileConfig``.

``generate`` compiles its decode step over a cache that can be compiled
(``Cache.is_compileable``), on CUDA and other accelerators by itself and on
the CPU only when ``compile_config._compile_all_devices`` says so, which
kvchat sets. A compiled
turn decodes in a ``StaticCache`` from the bridge's pool (see
``bridge/static_cache.py``); any other turn decodes in kvchat's growable
buffers, eagerly.

``SessionManager(compile=...)``:

- ``False`` (the default): never; decoding runs in kvchat's growable buffers;
- ``True``: compiled on every device (the CPU too), with transformers'
  default ``CompileConfig`` (on a GPU, CUDA graphs);
- a ``transformers.CompileConfig``: compiled on every device, with it.

Why not compiled by default on a GPU, as transformers does for a StaticCache:
no GPU has run this path yet (docs/compiled-decode.md, "Open").

A turn that passes ``disable_compile=True`` decodes eagerly; one that passes
``compile_config`` compiles with it wherever this manager compiles.
"""

from __future__ import annotations

import copy
import logging
import threading

from transformers import CompileConfig

from .bridge.static_cache import bucket
from .compile_watch import CompileWatch

logger = logging.getLogger("kvchat")


def compile_everywhere(config: CompileConfig | None = None) -> CompileConfig:
    """A copy of ``config`` (default: transformers' defaults) that ``generate``
    compiles with on every device, the CPU included. A shallow copy: the
    backend may be an object the caller keeps (a counter)."""
    config = copy.copy(config) if config is not None else CompileConfig()
    config._compile_all_devices = True
    return config


class CompiledDecode:
    """One manager's compile setting, applied to each turn."""

    def __init__(self, setting, static_problem: str | None, generation_config=None):
        if not isinstance(setting, (bool, CompileConfig)):
            raise TypeError(
                f"compile must be True, False or a transformers.CompileConfig, got {setting!r}"
            )
        self._config = setting if isinstance(setting, CompileConfig) else None
        self.enabled = setting is not False
        self.turns = 0  # turns that decoded compiled
        self._turns_lock = threading.Lock()
        # What torch.compile did in compiled turns and warm-ups (compile_watch.py).
        self._compiled = dict(compiles=0, recompiles=0, compile_ms=0.0, cuda_graph_records=0)
        self._capacities: set[int] = set()  # those a turn or a warm-up decoded in
        # The model's own (generation_config.json's): read at each turn, as generate does.
        self._model_generation_config = generation_config
        if self.enabled and static_problem is not None:
            logger.warning(
                "kvchat: compile=%r, but this model's decode cannot compile (%s); "
                "it decodes eagerly",
                setting,
                static_problem,
            )
            self.enabled = False

    def config_for(self, kwargs: dict) -> CompileConfig | None:
        """The turn's ``CompileConfig``, or None for an eager decode. As generate
        reads them: the turn's arguments over its ``generation_config``, or,
        without one, the model's; the manager's ``CompileConfig`` over both."""
        if not self.enabled:
            return None
        base = kwargs.get("generation_config") or self._model_generation_config
        disabled = kwargs.get("disable_compile")
        if disabled is None:
            disabled = bool(getattr(base, "disable_compile", False))
        if disabled:
            return None
        config = kwargs.get("compile_config") or self._config
        if config is None:
            config = getattr(base, "compile_config", None)
        return compile_everywhere(config)

    def record_turn(self) -> None:
        with self._turns_lock:
            self.turns += 1

    def failed(self, pool) -> None:
        """torch.compile failed in a turn (a backend this machine lacks, say):
        that turn aborted (the session keeps its history) and raised, since
        generate compiles the decode steps, after the first token; later
        turns decode eagerly rather than fail the same way, and the pool's
        caches are freed. A failure before the first token is no failure of
        this compile but of the model's own forward (``turn.py``)."""
        pool.clear()
        if self.enabled:
            logger.warning(
                "kvchat: compiling the decode failed; this manager decodes eagerly from now on"
            )
        self.enabled = False

    def watched(self, capacity: int, fn):
        """``fn`` (a compiled decode in a cache of ``capacity``), counting what
        it compiles on the thread that runs it: into ``stats()``, and a log
        line when it compiled (a warning if this capacity had run before)."""

        def run():
            with CompileWatch() as watch:
                try:
                    return fn()
                finally:
                    self._record(capacity, watch)

        return run

    def _record(self, capacity: int, watch: CompileWatch) -> None:
        with self._turns_lock:
            seen = capacity in self._capacities
            self._capacities.add(capacity)
            counts = self._compiled
            counts["compiles"] += watch.compiles
            counts["recompiles"] += watch.recompiles
            counts["compile_ms"] += watch.seconds * 1e3
            counts["cuda_graph_records"] += watch.cuda_graph_records
        if not watch.compiles:
            return
        if seen:  # a shape already run compiled again: what should never happen
            logger.warning(
                "kvchat: compiled the decode again for capacity %d, which had run before, "
                "in %.1f s (%d graphs, %d recompiles; TORCH_LOGS=recompiles says why)",
                capacity,
                watch.seconds,
                watch.compiles,
                watch.recompiles,
            )
        else:
            logger.info(
                "kvchat: compiled the decode for capacity %d in %.1f s (%d graphs, %d recompiles)",
                capacity,
                watch.seconds,
                watch.compiles,
                watch.recompiles,
            )

    def counters(self, pool) -> dict:
        with self._turns_lock:
            compiled = dict(self._compiled)
        return dict(
            compiled_turns=self.turns,
            static_caches_built=pool.built,
            static_cache_bytes=pool.nbytes(),
            **compiled,
        )

    @staticmethod
    def capacity(needed: int, max_context: int | None) -> int:
        """The positions a compiled turn that needs ``needed`` decodes in: a
        bucket, so turns and sessions share compiled graphs, but never more
        than the model's context (the context check keeps ``needed`` within it)."""
        capacity = bucket(needed)
        if max_context is not None and needed <= max_context < capacity:
            return max_context
        return capacity
