"""Where a reused turn's time to first token goes, on every thread.

    python benchmarks/turn_profile.py --model lfm2-350m
    python benchmarks/turn_profile.py --model lfm2-350m --device cuda --dtype bfloat16

One seeded conversation (workload.py's agent shape): turn 1 through kvchat,
settled, then turn 2 (one new token) under ``torch.profiler`` with every
thread profiled (the engine's runs the forwards). Printed: kvchat's time to
first token, the model forwards it ran, the top-level ATen ops inside and
outside those forwards by thread, the ops outside by count and time, and the
device syncs (``aten::item``, ``aten::_local_scalar_dense``, CUDA's stream and
device synchronizes), which on a GPU each wait for every launched kernel.
``--trace FILE`` writes the Chrome trace. Section 32 of RESULTS.md asks this
of an H200, where turn 2 of the LFM2 shape took 2.84x the limit's time.
"""

from __future__ import annotations

import argparse
import collections

import torch
from kvchat import SessionManager
from torch.profiler import ProfilerActivity, profile, record_function
from workload import load_model, make_conversation

_SYNCS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
)


def _top_level(events):
    """ATen ops not called from another ATen op."""
    for event in events:
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (
            parent is None or not parent.name.startswith("aten::")
        ):
            yield event


def _inside(event, spans) -> bool:
    return any(
        s.thread == event.thread
        and s.time_range.start <= event.time_range.start
        and event.time_range.end <= s.time_range.end
        for s in spans
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lfm2-350m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", default=None, help="write the Chrome trace here")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    conversation = make_conversation(tokenizer, seed=args.seed, turns=2)
    vocab = model.config.get_text_config().vocab_size
    suppress = list(range(len(tokenizer), vocab)) or None  # ids with no text
    manager = SessionManager(model, tokenizer)
    messages = [
        {"role": "system", "content": conversation.system},
        {"role": "user", "content": conversation.user_turns[0]},
    ]
    reply = manager.chat("s", messages, max_new_tokens=8, suppress_tokens=suppress)
    manager.wait_settled()
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": conversation.user_turns[1]},
    ]

    forward = type(model).forward

    def labelled(self, *args_, **kwargs):
        with record_function("model forward"):
            return forward(self, *args_, **kwargs)

    activities = [ProfilerActivity.CPU]
    if torch.device(args.device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    type(model).forward = labelled
    try:
        with profile(activities=activities, experimental_config=config) as prof:
            manager.chat("s", messages, max_new_tokens=1, suppress_tokens=suppress)
    finally:
        type(model).forward = forward
    report = manager.last_turn("s")
    manager.close()

    events = prof.events()
    spans = [e for e in events if e.name == "model forward"]
    tops = list(_top_level(events))
    outside = [e for e in tops if not _inside(e, spans)]
    print(
        f"{args.model} on {args.device} ({args.dtype}), turn 2: {report.prefilled_tokens} "
        f"tokens prefilled over {report.reused_tokens} reused; time to first token "
        f"{report.prefill_ms:.1f} ms; {len(spans)} model forwards, "
        f"{sum(s.cpu_time_total for s in spans) / 1e3:.1f} ms in them (CPU side)"
    )
    by_thread = collections.Counter((e.thread, _inside(e, spans)) for e in tops)
    for (thread, inside), count in sorted(by_thread.items()):
        print(f"  thread {thread}: {count} top-level ops {'in' if inside else 'outside'} forwards")
    counts = collections.Counter(e.name for e in outside)
    times = collections.Counter()
    for event in outside:
        times[event.name] += event.cpu_time_total
    print(
        f"outside the forwards: {len(outside)} ops, {sum(times.values()) / 1e3:.1f} ms (CPU side)"
    )
    for name, count in counts.most_common(15):
        print(f"  {name:<32} {count:>5}  {times[name] / 1e3:>8.2f} ms")
    syncs = collections.Counter(e.name for e in events if e.name in _SYNCS)
    print("device syncs:", dict(syncs) or "none")
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")


if __name__ == "__main__":
    main()
