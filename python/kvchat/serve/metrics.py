"""Prometheus metrics for /metrics: request and token counters, a TTFT
histogram, and the manager's own counters read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..tiers import StoreUnavailable

# What /metrics reads from SessionManager.stats() at every scrape:
# (metric name, help, ManagerStats field, counter or gauge). Counters get
# prometheus' "_total" suffix when exposed.
STATS_METRICS = [
    ("kvchat_hit_rate", "Reused / (reused + prefilled) prompt tokens", "hit_rate", "gauge"),
    ("kvchat_evictions", "Caches evicted to hold the limits", "evictions", "counter"),
    ("kvchat_resident_bytes", "Distinct cache bytes held", "resident_bytes", "gauge"),
    ("kvchat_sessions", "Sessions known", "sessions", "gauge"),
    ("kvchat_resident_sessions", "Sessions holding a cache", "resident_sessions", "gauge"),
    # The engine: one batched decode step for every conversation (docs/ARCHITECTURE.md).
    ("kvchat_decode_steps", "Batched decode steps the engine ran", "decode_steps", "counter"),
    (
        "kvchat_batch_rows_mean",
        "Conversations per decode step, on average",
        "mean_batch_rows",
        "gauge",
    ),
    ("kvchat_batch_rows", "Conversations decoding now", "batch_rows", "gauge"),
    ("kvchat_turns_queued", "Turns waiting for a row (max-batch-size)", "queued", "gauge"),
    (
        "kvchat_queue_wait_ms",
        "Milliseconds batched turns waited from submission to their first forward",
        "queue_wait_ms",
        "counter",
    ),
    (
        "kvchat_batch_bytes",
        "Bytes of the decode batch's buffers now (counted in max_cache_bytes)",
        "batch_bytes",
        "gauge",
    ),
    (
        "kvchat_packed_weight_bytes",
        "Bytes of the weights' copy packed for oneDNN (pack_weights)",
        "packed_weight_bytes",
        "gauge",
    ),
    (
        "kvchat_prompts_prefilled_together",
        "Prompts prefilled in one forward beside other conversations' prompts",
        "prompts_prefilled_together",
        "counter",
    ),
    (
        "kvchat_prefix_tokens_copied",
        "Prompt tokens copied from a conversation that held them instead of computed",
        "prefix_tokens_copied",
        "counter",
    ),
    (
        "kvchat_head_tokens_run_once",
        "Prompt tokens not computed: prompts beginning alike ran their common head once",
        "head_tokens_run_once",
        "counter",
    ),
    (
        "kvchat_gather_waits",
        "Engine passes in which waiting prompts waited for requests on their way",
        "gather_waits",
        "counter",
    ),
    (
        "kvchat_prefix_shares",
        "Turns that started from another session's prefix",
        "prefix_shares",
        "counter",
    ),
    ("kvchat_tier_writes", "Caches the storage tier stored", "tier_writes", "counter"),
    (
        "kvchat_tier_loads",
        "Turns that started from a cache the storage tier held",
        "tier_loads",
        "counter",
    ),
    (
        "kvchat_store_writes",
        "Session snapshots published to the Redis store",
        "store_writes",
        "counter",
    ),
    ("kvchat_store_loads", "Turns that started from a stored snapshot", "store_loads", "counter"),
    (
        "kvchat_store_write_errors",
        "Snapshots not stored (Redis down, chunks evicted)",
        "store_write_errors",
        "counter",
    ),
    ("kvchat_settles", "Sessions settled between turns for the next prompt", "settles", "counter"),
    (
        "kvchat_settled_tokens",
        "Tokens settles prefilled off the turns' critical path",
        "settled_tokens",
        "counter",
    ),
    (
        "kvchat_settle_misses",
        "Turns whose prompt did not start with the settled prediction",
        "settle_misses",
        "counter",
    ),
    (
        "kvchat_settles_taken_over",
        "Settles a turn on the session arrived during and took over",
        "settles_taken_over",
        "counter",
    ),
    ("kvchat_settles_pending", "Settles waiting or running", "settles_pending", "gauge"),
    (
        "kvchat_compiled_turns",
        "Turns whose decode ran compiled in a StaticCache",
        "compiled_turns",
        "counter",
    ),
    (
        "kvchat_compiles",
        "Frames torch.compile compiled for the compiled decode (turns and warm-up)",
        "compiles",
        "counter",
    ),
    (
        "kvchat_recompiles",
        "Of kvchat_compiles, those of a function compiled before (a guard failed)",
        "recompiles",
        "counter",
    ),
    (
        "kvchat_cuda_graph_records",
        "CUDA graphs recorded for the compiled decode",
        "cuda_graph_records",
        "counter",
    ),
    (
        "kvchat_static_cache_bytes",
        "Bytes held by idle static caches for compiled decode",
        "static_cache_bytes",
        "gauge",
    ),
]
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class _ManagerCollector:
    """Reads SessionManager.stats() when scraped, so nothing can drift."""

    def __init__(self, manager):
        self._mgr = manager

    def collect(self):
        stats = self._mgr.stats()
        for name, text, field, kind in STATS_METRICS:
            yield _FAMILIES[kind](name, text, value=getattr(stats, field))
        yield _by_reason(
            "kvchat_store_misses",
            "Stored snapshots not used, by reason (absent, chunk_missing, checksum, ...)",
            stats.store_miss_reasons,
        )
        yield _by_reason(
            "kvchat_plain_turns",
            "Turns run as plain generate, by reason (generate_args, autocast, ...)",
            stats.plain_turn_reasons,
        )
        yield CounterMetricFamily(
            "kvchat_settle_seconds", "Time settles spent prefilling", value=stats.settle_ms / 1e3
        )
        yield CounterMetricFamily(
            "kvchat_compile_seconds",
            "Time spent compiling the compiled decode (turns and warm-up)",
            value=stats.compile_ms / 1e3,
        )


class _TablesCollector:
    """How many sessions the server's own tables track, read when scraped: at
    most the sessions that exist and those with a request in progress (a
    refused request or a deleted session leaves nothing behind)."""

    def __init__(self, expiry, router):
        self._expiry, self._router = expiry, router

    def collect(self):
        yield GaugeMetricFamily(
            "kvchat_tracked_sessions",
            "Sessions the idle-expiry table and the session router hold anything of",
            value=len(self._expiry.tracked() | self._router.tracked()),
        )


class _ResponsesCollector:
    """The stored responses, read when scraped: this replica's, or with a
    shared store the store's (every replica reports the same); nothing while
    the store cannot be reached."""

    def __init__(self, responses):
        self._responses = responses

    def collect(self):
        yield CounterMetricFamily(
            "kvchat_stored_responses_evicted",
            "Stored responses this replica evicted to keep an API key within its bounds",
            value=self._responses.evicted,
        )
        try:
            records, nbytes = self._responses.totals()
        except StoreUnavailable:
            return
        yield GaugeMetricFamily(
            "kvchat_stored_responses", "Responses stored, over every API key", value=records
        )
        yield GaugeMetricFamily(
            "kvchat_stored_response_bytes",
            "Bytes of the stored responses' records, over every API key",
            value=nbytes,
        )


class Metrics:
    def __init__(self, manager):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvchat_requests",
            "Chat completion requests by outcome",
            ["status"],
            registry=self.registry,
        )
        tokens = {
            "prompt": "Prompt tokens of finished turns",
            "reused": "Prompt tokens taken from a cache",
            "prefilled": "Prompt tokens run through the model",
            "generated": "Tokens generated",
        }
        self.tokens = {
            kind: Counter(f"kvchat_{kind}_tokens", text, registry=self.registry)
            for kind, text in tokens.items()
        }
        self.expired = Counter(
            "kvchat_sessions_expired",
            "Sessions removed after --session-ttl seconds unused",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvchat_ttft_seconds",
            "Time to first token (kvchat's planning and prefill included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.registry.register(_ManagerCollector(manager))

    def track(self, expiry, router) -> None:
        """Also report the size of the server's session tables."""
        self.registry.register(_TablesCollector(expiry, router))

    def track_responses(self, responses) -> None:
        """Also report the stored responses (a ``ResponseStore``)."""
        self.registry.register(_ResponsesCollector(responses))

    def observe(self, report) -> None:
        self.tokens["prompt"].inc(report.prompt_tokens)
        self.tokens["reused"].inc(report.reused_tokens)
        self.tokens["prefilled"].inc(report.prefilled_tokens)
        self.tokens["generated"].inc(report.generated_tokens)
        self.ttft.observe(report.prefill_ms / 1e3)


def _by_reason(name: str, text: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter with one sample per reason."""
    family = CounterMetricFamily(name, text, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family
