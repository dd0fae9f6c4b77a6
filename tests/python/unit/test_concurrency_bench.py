"""benchmarks/concurrency.py's arithmetic: the percentiles and the ratios it
prints against each server's own one-conversation figures. No server, no model."""

from __future__ import annotations

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("concurrency")


def test_percentile_interpolates_between_ranks_as_numpy_does(bench):
    assert bench.percentile([], 95) is None
    assert bench.percentile([7.0], 95) == 7.0
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input
    # numpy.percentile(range(1, 21), 95) == 19.05
    assert bench.percentile([float(v) for v in range(1, 21)], 95) == pytest.approx(19.05)
    assert bench.percentile([1.0, 2.0, 3.0], 100) == 3.0


def _turn(ttft: float, error=None) -> dict:
    return {"ttft_ms": ttft, "turn_ms": 2 * ttft, "completion_tokens": 48, "error": error}


def _run(server, concurrency, tokens_per_s, ttfts, repetition=0, errors=()):
    return {
        "server": server,
        "shape": "chat",
        "concurrency": concurrency,
        "repetition": repetition,
        "tokens_per_s": tokens_per_s,
        "errors": list(errors),
        "turns": [_turn(t) for t in ttfts],
    }


def test_summary_takes_the_median_run_and_pools_every_turn(bench):
    runs = [
        _run("kvchat", 1, 20.0, [100.0]),
        _run("kvchat", 1, 22.0, [300.0], repetition=1),
        _run("kvchat", 1, 30.0, [200.0], repetition=2),
    ]
    runs[0]["turns"].append(_turn(5000.0, error="APIError"))  # a failed turn counts nowhere
    (row,) = bench.summarize(runs)
    assert row["tokens_per_s"] == 22.0
    assert row["ttft_p50_ms"] == 200.0
    assert row["turn_p95_ms"] == pytest.approx(bench.percentile([200.0, 400.0, 600.0], 95))


def test_ratios_divide_by_each_servers_own_one_conversation(bench):
    runs = [
        _run("kvchat", 1, 20.0, [100.0, 200.0]),
        _run("kvchat", 2, 36.0, [100.0, 200.0]),
        _run("kvchat", 4, 50.0, [150.0, 300.0]),
        _run("kvchat", 8, 80.0, [400.0]),
        _run("llama-server", 1, 60.0, [50.0]),
        _run("llama-server", 4, 100.0, [200.0]),
    ]
    ratios = bench.ratios(bench.summarize(runs))
    kvchat = ratios["kvchat", "chat"]
    assert kvchat["x2"] == pytest.approx(1.8)
    assert kvchat["x4"] == pytest.approx(2.5)
    assert kvchat["x8"] == pytest.approx(4.0)
    p95_one = bench.percentile([100.0, 200.0], 95)
    assert kvchat["ttft_p95_4/1"] == pytest.approx(bench.percentile([150.0, 300.0], 95) / p95_one)
    assert ratios["llama-server", "chat"] == {"x4": pytest.approx(100 / 60), "ttft_p95_4/1": 4.0}


def test_ratios_are_none_where_a_figure_is_missing(bench):
    # No 4-conversation run, and a one-conversation run whose server never started.
    runs = [_run("kvchat", 1, 0.0, [], errors=["did not start"]), _run("kvchat", 2, 30.0, [90.0])]
    assert bench.ratios(bench.summarize(runs))["kvchat", "chat"] == {
        "x2": None,
        "ttft_p95_4/1": None,
    }


@pytest.mark.parametrize("shape", ["agent", "chat"])
def test_no_two_conversations_share_a_turn_past_the_system_prompt(bench, shape):
    # Two alike would let a server reuse one conversation's cache for another.
    conversations = [bench.conversation(shape, i, 3) for i in range(16)]
    assert len({system for system, _ in conversations}) == 1  # one agent, many users
    assert len({turns[0] for _, turns in conversations}) == 16
    assert all(len(set(turns)) == 3 for _, turns in conversations)
    assert bench.conversation(shape, 5, 3) == conversations[5]  # the same at every concurrency
