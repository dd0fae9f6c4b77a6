"""Turn 1 against plain generate, measured in pairs.

A first turn has nothing to reuse, so kvchat's time to first token there is
plain generate's plus what kvchat adds (planning, its cache, a checkpoint stop
on a hybrid). That difference is a few percent, and on a shared 2-core machine
one sample of either moves by 10%, with drifts over seconds. The replay in
multiturn.py runs the two seconds apart with other modes in between, so its
turn-1 ratio mostly measures that noise. Here each pair runs the same new
conversation's first turn through both, back to back, the order swapped every
other pair (so neither always runs second), and the figure is the median of
the per-pair ratios.

Used by multiturn.py (``--first-turn-pairs``), and so by hybrid.py.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from unittest import mock

from kvchat import SessionManager
from kvchat.bridge import CacheBridge
from kvchat.prompting import render_prompt
from kvchat.timing import FirstTokenTimer
from workload import make_conversation


def _plain(model, prompt, kwargs):
    timer = FirstTokenTimer()
    out = model.generate(prompt[None].to(model.device), **timer.attach(kwargs))
    return timer.prefill_ms, out[0, prompt.numel() :].tolist()


def _kvchat(manager, session, messages, kwargs):
    manager.chat(session, messages, **kwargs)
    manager.wait_settled()  # the user reads; settling is off the clock
    turn = manager.last_turn(session)
    return turn.prefill_ms, list(turn.output_ids)


def _manager(model, tokenizer, no_checkpoints: bool = False, **options) -> SessionManager:
    """A SessionManager; ``no_checkpoints`` (a diagnostic, not a setting) builds
    its core as for a model that needs none, so a hybrid's turn never stops
    its prefill to take one (and its later turns could not reuse)."""
    if not no_checkpoints:
        return SessionManager(model, tokenizer, **options)
    with mock.patch.object(CacheBridge, "needs_checkpoints", new=property(lambda self: False)):
        return SessionManager(model, tokenizer, **options)


def paired(model, tokenizer, pairs: int, shape, seed: int, generate_extra: dict, **options):
    """``pairs`` new conversations' first turns, each through plain generate and
    through one SessionManager (``options``), back to back in alternating order."""
    system_range, user_range, reply_range = shape
    manager = _manager(model, tokenizer, **options)
    ratios, plain_ms, kvchat_ms, same = [], [], [], True
    try:
        for i in range(-1, pairs):  # pair -1 warms both paths up and is not counted
            # Seeds apart from the replay's, so no system prompt is shared with it.
            conversation = make_conversation(
                tokenizer, 10_000 + seed + i, 1, system_range, user_range, reply_range
            )
            messages = [
                {"role": "system", "content": conversation.system},
                {"role": "user", "content": conversation.user_turns[0]},
            ]
            prompt = render_prompt(tokenizer, messages)
            reply = conversation.reply_tokens[0]
            kwargs = dict(
                max_new_tokens=reply, min_new_tokens=reply, do_sample=False, **generate_extra
            )
            session = f"first-{i}"
            if i % 2 == 0:
                p_ms, p_ids = _plain(model, prompt, kwargs)
                k_ms, k_ids = _kvchat(manager, session, messages, kwargs)
            else:
                k_ms, k_ids = _kvchat(manager, session, messages, kwargs)
                p_ms, p_ids = _plain(model, prompt, kwargs)
            same = same and p_ids == k_ids
            if i < 0:
                continue
            plain_ms.append(p_ms)
            kvchat_ms.append(k_ms)
            ratios.append(k_ms / p_ms)
    finally:
        manager.close()
    return dict(
        pairs=pairs,
        median=statistics.median(ratios),
        mean=statistics.fmean(ratios),
        each=ratios,
        plain_ms_median=statistics.median(plain_ms),
        kvchat_ms_median=statistics.median(kvchat_ms),
        same_tokens=same,
    )


# Ways to run kvchat's side, for telling apart what a first turn costs.
VARIANTS = {
    "default": {},
    "every": {"checkpoints": "every"},
    "no-share": {"share_prefixes": False},
    "no-settle": {"settle": False},
    "no-stop": {"no_checkpoints": True},  # what the checkpoint stops cost
}


def main(argv=None) -> dict:
    import argparse

    import torch
    from kvchat.tiny import words_only
    from multiturn import SHAPES
    from workload import PRESETS, load_model

    parser = argparse.ArgumentParser(description="Turn 1 against plain generate, in pairs.")
    parser.add_argument("--model", default="lfm2-350m", choices=sorted(PRESETS))
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="agent")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["default"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    model, tokenizer = load_model(args.model, torch.float32, "cpu", args.seed)
    # As multiturn.py's replay generates (--replies words).
    suppress = words_only(tokenizer, model.config.get_text_config().vocab_size)
    extra = {"no_repeat_ngram_size": 3, "suppress_tokens": suppress}
    results = {}
    for name in args.variants:
        result = paired(
            model, tokenizer, args.pairs, SHAPES[args.shape], args.seed, extra, **VARIANTS[name]
        )
        results[name] = result
        each = ", ".join(f"{v:.2f}" for v in result["each"])
        same = "yes" if result["same_tokens"] else "NO"
        print(f"{name}: median {result['median']:.2f}x ({each}); same tokens: {same}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"first-turn-{args.model}-cpu.json"
    command = "python benchmarks/first_turn.py " + " ".join(argv or sys.argv[1:])
    path.write_text(json.dumps(dict(command=command, variants=results), indent=2))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
