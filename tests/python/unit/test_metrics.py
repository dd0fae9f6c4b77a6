"""/metrics reads what it names from ``SessionManager.stats()`` at every
scrape (no model, no server): each metric is the stats field it names."""

from __future__ import annotations

from dataclasses import fields

from kvchat.report import ManagerStats
from kvchat.serve.metrics import STATS_METRICS, Metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


class _Manager:
    def __init__(self, stats: ManagerStats):
        self._stats = stats

    def stats(self) -> ManagerStats:
        return self._stats


def _distinct_stats() -> ManagerStats:
    """A value of its own in every field, so a metric that reads the wrong one shows."""
    values = {}
    for i, f in enumerate(fields(ManagerStats), start=1):
        if f.name == "store_miss_reasons":
            values[f.name] = {"absent": 3, "checksum": 1}
        elif f.name == "plain_turn_reasons":
            values[f.name] = {"autocast": 5, "generate_args": 2}
        elif f.name == "hit_rate":
            values[f.name] = 0.25
        else:
            values[f.name] = 7 * i
    return ManagerStats(**values)


def _scraped(stats: ManagerStats) -> dict[tuple, float]:
    text = generate_latest(Metrics(_Manager(stats)).registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_stats_metric_is_the_field_it_names():
    stats = _distinct_stats()
    scraped = _scraped(stats)
    for name, _, field, kind in STATS_METRICS:
        exposed = f"{name}_total" if kind == "counter" else name
        assert scraped[(exposed, ())] == getattr(stats, field), name
    reasons = {("reason", r): n for r, n in stats.store_miss_reasons.items()}
    for (reason, value), count in reasons.items():
        assert scraped[("kvchat_store_misses_total", ((reason, value),))] == count
    for reason, count in stats.plain_turn_reasons.items():
        assert scraped[("kvchat_plain_turns_total", (("reason", reason),))] == count
    assert scraped[("kvchat_settle_seconds_total", ())] == stats.settle_ms / 1e3
    assert scraped[("kvchat_compile_seconds_total", ())] == stats.compile_ms / 1e3


def test_the_counters_a_user_tunes_by_are_exported():
    """The engine, compiled-decode, settling and store counters each have a metric."""
    exported = {field for _, _, field, _ in STATS_METRICS}
    for field in (
        "compiled_turns",
        "static_cache_bytes",
        "compiles",
        "recompiles",
        "settles",
        "settled_tokens",
        "settle_misses",
        "store_writes",
        "store_loads",
        "tier_writes",
        "tier_loads",
        "evictions",
        "resident_bytes",
        "decode_steps",
        "mean_batch_rows",
        "batch_rows",
        "queued",
        "queue_wait_ms",
        "batch_bytes",
        "packed_weight_bytes",
    ):
        assert field in exported, field
