"""Whether a turn's decode runs compiled, and with which ``CompileConfig``.

A manager that compiles decodes its turns in the engine's batch, whose
buffers are then static and whose step is compiled (``batch_forward``,
engine/batch.py): one ``torch.compile`` for every shape. A turn that brings
its own ``compile_config`` or asks for generate's returned dict decodes
alone in a ``StaticCache`` from the bridge's pool (``bridge/static_cache.py``),
which ``generate`` compiles: it compiles over a cache that can be compiled
(``Cache.is_compileable``), on CUDA and other accelerators by itself and on
the CPU only when ``compile_config._compile_all_devices`` says so, which
kvchat sets. Any other turn decodes in the batch, eagerly.

``SessionManager(compile=...)``:

- ``False`` (the default): never; decoding runs in kvchat's growable buffers;
- ``True``: compiled on every device (the CPU too), with transformers'
  default ``CompileConfig`` (on a GPU, CUDA graphs);
- a ``transformers.CompileConfig``: compiled on every device, with it.

Why not compiled by default on a GPU, as transformers does for a StaticCache:
no GPU has run this path yet (docs/compiled-decode.md, "Open").

A turn that passes ``disable_compile=True`` decodes eagerly (alone, beside a
compiled batch); one that passes ``compile_config`` compiles with it, alone,
wherever this manager compiles.
"""

from __future__ import annotations

import copy
import logging
import threading
import types
from collections.abc import Iterable

import torch
from transformers import CompileConfig
from transformers.cache_utils import StaticSlidingWindowLayer

from .bridge.static_cache import bucket
from .compile_watch import CompileWatch

logger = logging.getLogger("kvchat")

# A warm-up decodes this many tokens after a prompt of as many: the first
# decode step compiles, the next ones show that nothing compiles again.
WARM_UP_TOKENS = 4


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
        self.requested = self.enabled  # enabled turns False if the model cannot compile
        self.turns = 0  # turns that decoded compiled
        self._turns_lock = threading.Lock()
        # What torch.compile did in compiled turns and warm-ups (compile_watch.py).
        self._compiled = dict(compiles=0, recompiles=0, compile_ms=0.0, cuda_graph_records=0)
        self._capacities: set = set()  # those a turn or a warm-up decoded in
        # The decode batch's compiled forward (``batch_forward``), built at its first use.
        self._batch_forward = None
        self._warming = (
            False  # a warm-up runs: batch steps compiling are not turns' (engine thread)
        )
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

    @property
    def batch_compiles(self) -> bool:
        """Whether the engine's decode batch compiles its steps: the manager
        compiles and the model's own generation config does not turn that
        off (``disable_compile``: every turn then decodes in the batch
        eagerly, as with ``compile=False``)."""
        return self.config_for({}) is not None

    def batches(self, kwargs: dict) -> bool:
        """Whether this turn decodes in the engine's compiled batch: the
        manager compiles, and the turn neither turns it off nor brings its
        own ``CompileConfig`` (that one decodes alone, in a pooled
        ``StaticCache``, as generate would), nor asks for generate's returned
        dict (a cache returned with it is the pool's)."""
        return (
            self.batch_compiles
            and self.config_for(kwargs) is not None
            and kwargs.get("compile_config") is None
            and not kwargs.get("return_dict_in_generate")
        )

    def batch_forward(self, model, kwargs: dict, shape: tuple[int, int]):
        """The decode batch's step (engine/batch.py, a static batch of
        ``shape``, rows by columns): ``model(**kwargs)`` compiled with the
        manager's config, what it compiled counted as a turn's is. One
        ``torch.compile`` for every shape, in two graphs: one row and several
        rows compile apart (dynamo specializes sizes of 1), the columns (and
        several rows) dynamic sizes from the first compile (the batch marks
        them: ``DecodeBatch._mark_static``); no later shape compiles again."""
        if self._batch_forward is None:
            forward = _own_forward()
            self._batch_forward = torch.compile(forward, **self.config_for({}).to_dict())
        label = f"{shape[0]} rows x {shape[1]} columns"
        return self.watched(
            shape, lambda: self._batch_forward(model, kwargs), self._warming, label
        )()

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

    def check_warm_up(self, lengths, max_context: int | None) -> list[int]:
        """The capacities ``warm_up(lengths)`` decodes in, smallest first; a
        clear error for a manager that does not compile or a bad length."""
        if not self.requested:
            raise ValueError(
                "warm_up compiles the decode, but this manager was made with compile=False"
            )
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            lengths = [lengths]
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
            raise TypeError(f"lengths must be an int or a list of ints, got {lengths!r}")
        lengths = list(lengths)
        if not lengths:
            raise ValueError("lengths is empty: name at least one length to warm up")
        for length in lengths:
            if not isinstance(length, int) or isinstance(length, bool) or length < 1:
                raise ValueError(f"lengths must be positive ints, got {length!r}")
            if max_context is not None and length > max_context:
                raise ValueError(
                    f"lengths: {length} positions exceed max_context_length={max_context}"
                )
        if max_context is not None and max_context < 2 * WARM_UP_TOKENS:
            raise ValueError(f"max_context_length={max_context} is too short to warm up")
        return sorted({self.capacity(n, max_context) for n in lengths})

    def warm_up(self, model, bridge, engine, capacities: list[int]) -> list[int]:
        """Compiles the decode for each of ``capacities`` (``check_warm_up``'s),
        on the engine's thread; the capacities it decoded in. Nothing (and
        []) if the model cannot compile.

        Where turns decode in the engine's batch: its step, for one row and
        for two (the graph of every larger row count) in each capacity's
        columns, and in the next bucket up when one capacity is named
        (``_warm_up_batch``). Where they cannot (a
        length-dependent rope: each turn alone): short generates in a pooled
        cache of each capacity, as a turn does (a pooled cache up to twice as
        large serves a smaller one, as it does for a turn). A sliding-window
        layer of a pooled cache branches on whether its window is full, on a
        Python int that dynamo specializes on, so its decode has a graph for
        each: a model with such layers also decodes once past its window."""
        config = self.config_for({})
        if config is None:
            logger.warning("kvchat: warm_up: this manager decodes eagerly; nothing to compile")
            return []
        if engine.model_problem is None:  # turns decode in the engine's batch
            return self._warm_up_batch(engine, capacities, bridge.static_pool)
        token = ordinary_token(model)
        done = []
        for capacity in capacities:
            prompts = [WARM_UP_TOKENS] + [
                window
                for window in _windows(bridge, capacity)
                if window + WARM_UP_TOKENS <= capacity
            ]
            for prompt in prompts:
                ids = torch.full((1, prompt), token, device=model.device)
                cache = bridge.to_static_cache([], capacity)

                def decode(cache=cache, ids=ids):
                    model.generate(
                        ids,
                        **{bridge.cache_argument: cache},
                        max_new_tokens=WARM_UP_TOKENS,
                        min_new_tokens=WARM_UP_TOKENS,
                        do_sample=False,
                        compile_config=config,
                    )

                try:
                    engine.run(
                        self.watched(cache.layers_capacity, decode, warming=True), why="warm-up"
                    )
                except torch._dynamo.exc.TorchDynamoException:
                    self.failed(bridge.static_pool)  # as a turn whose compile fails
                    raise
                finally:
                    if self.enabled:
                        bridge.give_back(cache)
            done.append(cache.layers_capacity)
        return done

    def _warm_up_batch(self, engine, capacities: list[int], pool) -> list[int]:
        """``warm_up`` for a manager whose turns decode in the engine's batch:
        its step for one row and for two, in each of ``capacities`` columns
        and in two at least (the next bucket up, which compiles nothing but
        on a GPU records its CUDA graphs): no later shape compiles."""
        if len(capacities) == 1:
            capacities = [capacities[0], bucket(capacities[0] + 1)]
        done = []
        self._warming = True
        try:
            for capacity in capacities:
                engine.warm_up_batch(self, capacity, WARM_UP_TOKENS, WARM_UP_TOKENS)
                done.append(capacity)
        except torch._dynamo.exc.TorchDynamoException:
            self.failed(pool)  # as a turn whose compile fails
            raise
        finally:
            self._warming = False
        return done

    def watched(self, capacity, fn, warming: bool = False, label: str | None = None):
        """``fn`` (a compiled decode in a cache of ``capacity``, or a batch
        step of a shape), counting what it compiles on the thread that runs
        it: into ``stats()``, and a log line when it compiled (a warning if
        this capacity had run before, unless ``warming``: a warm-up's)."""

        def run():
            with CompileWatch() as watch:
                try:
                    return fn()
                finally:
                    self._record(capacity, watch, warming, label or f"capacity {capacity}")

        return run

    def _record(self, capacity, watch: CompileWatch, warming: bool, label: str) -> None:
        with self._turns_lock:
            seen = capacity in self._capacities and not warming
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
                "kvchat: compiled the decode again for %s, which had run before, "
                "in %.1f s (%d graphs, %d recompiles; TORCH_LOGS=recompiles says why)",
                label,
                watch.seconds,
                watch.compiles,
                watch.recompiles,
            )
        else:
            logger.info(
                "kvchat: compiled the decode for %s in %.1f s (%d graphs, %d recompiles)",
                label,
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


def _forward(model, kwargs: dict):
    """What the decode batch compiles: its own function, so that its graphs
    and recompile limit are not those of ``model.__call__`` that generate
    compiles for a turn decoding alone."""
    return model(**kwargs)


def _own_forward():
    """``_forward`` with a code object of its own, one per manager: dynamo
    keeps graphs and counts its recompile limit (8) per code object, which
    the managers of one process would otherwise share (the fifth found it
    spent and decoded eagerly); freed with the manager."""
    return types.FunctionType(_forward.__code__.replace(), _forward.__globals__, "_forward")


def _windows(bridge, capacity: int) -> set[int]:
    """The sliding-window layers' windows in a cache of ``capacity``."""
    cache = bridge.to_static_cache([], capacity)
    try:
        return {
            layer.max_cache_len
            for layer in cache.layers
            if isinstance(layer, StaticSlidingWindowLayer)
        }
    finally:
        bridge.give_back(cache)


def ordinary_token(model) -> int:
    """A token id that is no special token of the model (no padding, which
    generate would mask, and no end of sequence)."""
    config = model.generation_config
    special = set()
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    return next(i for i in range(3, 3 + len(special) + 1) if i not in special)
