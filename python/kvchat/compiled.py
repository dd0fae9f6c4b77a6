"""Whether a turn's decode runs compiled, and with which ``CompileConfig``.

``generate`` compiles its decode step over a cache that can be compiled
(``Cache.is_compileable``), on CUDA and other accelerators by itself and on
the CPU only when ``compile_config._compile_all_devices`` says so. A compiled
turn decodes in a ``StaticCache`` from the bridge's pool (see
``bridge/static_cache.py``); any other turn decodes in kvchat's growable
buffers, eagerly.

``SessionManager(compile=...)``:

- ``None`` (the default): as transformers does with a ``StaticCache``:
  compiled on an accelerator, eager on the CPU;
- ``True``: compiled on every device (on the CPU too);
- a ``transformers.CompileConfig``: compiled on every device, with it;
- ``False``: never.

A turn that passes ``disable_compile=True`` decodes eagerly; one that passes
``compile_config`` compiles with it wherever this manager compiles.
"""

from __future__ import annotations

import copy
import logging

from transformers import CompileConfig

from .bridge.static_cache import bucket

logger = logging.getLogger("kvchat")

ACCELERATORS = ("cuda", "xpu")


class CompiledDecode:
    """One manager's compile setting, applied to each turn."""

    def __init__(self, setting, device, static_problem: str | None):
        if not (setting is None or isinstance(setting, (bool, CompileConfig))):
            raise TypeError(
                f"compile must be None, True, False or a transformers.CompileConfig, "
                f"got {setting!r}"
            )
        self._config = setting if isinstance(setting, CompileConfig) else None
        wanted = setting is True or self._config is not None
        self.enabled = setting is not False and (wanted or device.type in ACCELERATORS)
        self._all_devices = wanted
        self.problem = static_problem
        self.turns = 0  # turns that decoded compiled
        if self.enabled and static_problem is not None:
            if wanted:
                logger.warning(
                    "kvchat: compile=%r, but this model's decode cannot compile (%s); "
                    "it decodes eagerly",
                    setting,
                    static_problem,
                )
            self.enabled = False

    def config_for(self, kwargs: dict) -> CompileConfig | None:
        """The turn's ``CompileConfig``, or None for an eager decode."""
        if not self.enabled or kwargs.get("disable_compile"):
            return None
        generation_config = kwargs.get("generation_config")
        if generation_config is not None and generation_config.disable_compile:
            return None
        config = kwargs.get("compile_config") or self._config
        if config is None and generation_config is not None:
            config = generation_config.compile_config
        # A shallow copy: the backend may be an object the caller keeps (a counter).
        config = copy.copy(config) if config is not None else CompileConfig()
        if self._all_devices:
            config._compile_all_devices = True
        return config

    def counters(self, pool) -> dict:
        return dict(
            compiled_turns=self.turns,
            static_caches_built=pool.built,
            static_cache_bytes=pool.nbytes(),
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
