"""Plain, immutable views of the core's counters for Python users."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import _C

# The core names a dtype as c10 does ("Float"); users know torch's names.
_TORCH_NAMES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "Char": "int8",
    "Byte": "uint8",
    "Short": "int16",
    "Int": "int32",
    "Long": "int64",
}


def torch_dtype_name(core_name: str) -> str | None:
    """torch's name for a dtype without its ``torch.`` prefix ("float32",
    "bfloat16"; ``getattr(torch, name)`` is the dtype), from the core's c10
    name ("Float", "BFloat16"); None for an empty one (nothing cached)."""
    if not core_name:
        return None
    return _TORCH_NAMES.get(core_name, core_name.lower())  # BFloat16, Float8_e4m3fn, Bool


@dataclass(frozen=True)
class TurnReport:
    """What the last turn of a session did."""

    prompt_tokens: int
    reused_tokens: int  # taken from the cache
    prefilled_tokens: int  # run through the model before the first new token
    generated_tokens: int
    checkpoint_restored: int | None  # token position of a restored checkpoint
    prefill_ms: float  # time to first token
    total_ms: float
    reason: str  # why this much was reused: no_cache, extend, prompt_cached, ...
    output_ids: tuple[int, ...]  # the generated token ids

    @classmethod
    def from_core(cls, record: _C.TurnRecord) -> TurnReport:
        reason = record.reason.name
        return cls(
            prompt_tokens=record.prompt_tokens,
            reused_tokens=record.reused_tokens,
            prefilled_tokens=record.prefilled_tokens,
            generated_tokens=record.generated_tokens,
            checkpoint_restored=(
                None if record.checkpoint_restored < 0 else record.checkpoint_restored
            ),
            prefill_ms=record.prefill_ms,
            total_ms=record.total_ms,
            reason=reason,
            output_ids=tuple(record.output_ids),
        )


# The fields each view copies from the core object of the same names.
_TOTALS = (  # _C.ManagerStats.totals: summed over every turn
    "requests",
    "reused_tokens",
    "prefilled_tokens",
    "generated_tokens",
    "invalidations",
    "checkpoint_restores",
    "checkpoints_taken",
    "settles",
    "settled_tokens",
)
_MANAGER = (  # _C.ManagerStats: the manager now
    "hit_rate",
    "evictions",
    "resident_bytes",
    "checkpoint_bytes",
    "sessions",
    "resident_sessions",
    "shared_prefixes",
    "prefix_shares",
    "shared_tokens",
)
_CACHE_INFO = (  # _C.ChatSession.cache_info()
    "cached_tokens",
    "trusted_tokens",
    "nbytes",
    "checkpoints",
    "checkpoint_bytes",
    "last_check",
)


def _read(source, names: tuple[str, ...]) -> dict:
    return {name: getattr(source, name) for name in names}


@dataclass(frozen=True)
class ManagerStats:
    """Totals over all sessions, removed ones included."""

    requests: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    hit_rate: float  # reused / (reused + prefilled)
    invalidations: int  # turns whose reuse a corruption or repetition check capped
    checkpoint_restores: int  # turns that restored non-croppable layers from a checkpoint
    checkpoints_taken: int  # snapshots taken at message boundaries
    evictions: int
    resident_bytes: int  # distinct tensor storage held by all sessions, shared storage once
    checkpoint_bytes: int  # the part of resident_bytes held by checkpoints
    sessions: int
    resident_sessions: int
    shared_prefixes: int  # prefixes (e.g. a system prompt) held once for several sessions
    prefix_shares: int  # turns that started from another session's prefix
    shared_tokens: int  # tokens those turns took from it instead of prefilling
    # Whatever the tier: caches it stored, and turns that started from one of them.
    tier_writes: int = 0
    tier_loads: int = 0
    spill_writes: int = 0  # evicted caches written to spill_dir (the disk tier's tier_writes)
    spill_loads: int = 0  # turns that read their cache back from spill_dir
    store_writes: int = 0  # snapshots published to the Redis store
    store_loads: int = 0  # turns that started from a stored snapshot
    store_misses: int = 0  # stored snapshots not used: absent, stale, corrupt, Redis down
    store_write_errors: int = 0  # snapshots not stored (Redis down, chunks evicted)
    # store_misses by reason: absent, format, fingerprint, session, diverged,
    # chunk_missing, checksum, malformed, unavailable.
    store_miss_reasons: dict[str, int] = field(default_factory=dict)
    # Settling between turns (docs/settling.md).
    settles: int = 0  # settled caches committed, whole or taken over by a turn
    settled_tokens: int = 0  # tokens those settles prefilled, off the turns' path
    settle_ms: float = 0.0  # time settles spent prefilling
    settle_misses: int = 0  # turns whose prompt did not start with the prediction
    settles_taken_over: int = 0  # settles a turn on the session took over (and committed)
    settles_pending: int = 0  # waiting or running now
    # Compiled decode (docs/compiled-decode.md).
    compiled_turns: int = 0  # turns whose decode ran compiled, in a StaticCache
    static_caches_built: int = 0  # one per capacity bucket; more only under concurrency
    static_cache_bytes: int = 0  # held by idle static caches between turns
    # What torch.compile did in compiled turns and warm_up() (compile_watch.py).
    compiles: int = 0  # frames dynamo compiled for the decode
    recompiles: int = 0  # of those, of a function compiled before (a guard failed)
    compile_ms: float = 0.0  # time spent compiling them
    cuda_graph_records: int = 0  # CUDA graphs recorded (a GPU, mode="reduce-overhead")
    # Turns run as plain generate (docs/how-it-works.md), and by why:
    # generate_args (beams, use_cache=False, ...), unsupported_layers,
    # autocast, forward_refuses_cache (a forward compiled with fullgraph).
    plain_turns: int = 0
    plain_turn_reasons: dict[str, int] = field(default_factory=dict)
    # The engine (docs/ARCHITECTURE.md): batched decode steps, how full they
    # were, and how long turns waited for their first forward.
    decode_steps: int = 0
    mean_batch_rows: float = 0.0  # rows per decode step, on average
    max_batch_rows: int = 0
    batch_rows: int = 0  # rows decoding now
    prefilling: int = 0  # turns prefilling now
    queued: int = 0  # turns waiting for a row (max_batch_size reached, or Engine.hold)
    # Total, from submitting a batched turn to its first forward (turns that
    # run alone, plain or compiled, are not counted).
    queue_wait_ms: float = 0.0
    prefill_chunks: int = 0  # prefill forwards of batched turns (a chunk, or prompts together)
    # Prompts of turns that started together (engine/prompts.py, full-attention
    # models): those prefilled in a forward beside others, the prompt tokens
    # copied from a row that held them instead of computed, and those not
    # computed because prompts beginning alike ran their common head once in
    # such a forward: (prompts - 1) x head (engine/one_sequence.py).
    prompts_prefilled_together: int = 0
    prefix_tokens_copied: int = 0
    head_tokens_run_once: int = 0
    gather_waits: int = 0  # passes the waiting prompts waited for turns on their way
    jobs_run_alone: int = 0  # plain, compiled or checkpoint work run between steps
    idle_jobs: int = 0  # settle chunks run while nothing decoded
    batch_bytes: int = 0  # the decode batch's buffers now; counted in max_cache_bytes
    # The copy of the weights the engine packed for oneDNN (engine/packed.py;
    # pack_weights); not counted in max_cache_bytes, which bounds caches.
    packed_weight_bytes: int = 0

    @classmethod
    def from_core(cls, stats: _C.ManagerStats) -> ManagerStats:
        return cls(**_read(stats.totals, _TOTALS), **_read(stats, _MANAGER))

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SessionInfo:
    """One session's cache and history at a glance."""

    session_id: str
    resident: bool
    cached_tokens: int
    trusted_tokens: int  # reuse is capped here after a failed check
    nbytes: int  # layer states and checkpoints, shared storage counted once
    checkpoints: int
    checkpoint_bytes: int
    dtype: str | None  # torch's name: "float32", "bfloat16"
    device: str | None
    system_prompt: str | None
    messages: int  # history length, system prompt excluded
    requests: int
    last_check: str  # why trust was capped; empty when clean

    @classmethod
    def from_core(cls, session: _C.ChatSession) -> SessionInfo:
        info = session.cache_info()
        messages = session.messages()
        system = session.system_prompt
        return cls(
            session_id=session.id,
            resident=session.resident,
            **_read(info, _CACHE_INFO),
            dtype=torch_dtype_name(info.dtype),
            device=info.device or None,
            system_prompt=system,
            messages=len(messages) - (system is not None),
            requests=session.counters().requests,
        )
