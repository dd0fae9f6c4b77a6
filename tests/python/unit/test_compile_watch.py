"""CompileWatch counts what dynamo compiles on the watching thread, and
nothing another thread compiles meanwhile (no model: small functions)."""

from __future__ import annotations

import threading

import torch
from kvchat.compile_watch import CompileWatch


def _compiled():
    def double(x):
        return x * 2

    return torch.compile(double, backend="eager", dynamic=False)


def test_counts_compiles_and_recompiles_on_its_thread():
    torch._dynamo.reset()
    fn = _compiled()
    with CompileWatch() as watch:
        fn(torch.ones(3))
        fn(torch.ones(3))  # a graph it has: nothing
        assert (watch.compiles, watch.recompiles) == (1, 0)
        fn(torch.ones(5))  # a new shape (dynamic=False): the same function again
    assert (watch.compiles, watch.recompiles) == (2, 1)
    assert watch.seconds > 0 and watch.cuda_graph_records == 0
    fn(torch.ones(7))  # after the watch: not counted
    assert watch.compiles == 2


def test_another_threads_compile_is_not_counted():
    torch._dynamo.reset()
    fn = _compiled()
    with CompileWatch() as watch:
        other = threading.Thread(target=fn, args=(torch.ones(4),))
        other.start()
        other.join()
        assert watch.compiles == 0
        fn(torch.ones(4, 2))
    assert watch.compiles == 1


def test_a_dynamo_reset_inside_the_watch_is_no_error():
    """torch._dynamo.reset() clears every callback; leaving the watch then
    has nothing to remove."""
    with CompileWatch() as watch:
        torch._dynamo.reset()
    assert watch.compiles == 0
