"""What an edit of an earlier message reuses, per checkpoint placement.

    python benchmarks/edits.py

A 4-turn conversation on tiny float64 hybrids (the tests' 200-token system
prompt, 12-token replies); then the user edits one of its user messages and
resends, dropping what followed, as chat UIs do. Prints the edited prompt's
reuse and the checkpoint it restored, for checkpoints="every" and "last".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from kvchat import SessionManager
from kvchat.tiny import tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from helpers import LONG_SYSTEM, user_message  # noqa: E402

EDIT = {"role": "user", "content": "Actually, tell me about Tokyo instead."}


def main() -> None:
    tokenizer = tiny_tokenizer()
    print(f"{'family':10} {'placement':9} {'edited':>14} {'reused':>14} {'restored':>9}")
    for family in ("lfm2", "qwen3_5", "falcon_h1"):
        model = tiny_model(family, dtype=torch.float64)
        for placement in ("every", "last"):
            for index in (1, 3, 5):  # the first, second and third user message
                mgr = SessionManager(model, tokenizer, checkpoints=placement)
                messages = [LONG_SYSTEM]
                for turn in range(4):
                    messages.append(user_message(turn))
                    reply = mgr.chat("s", messages, max_new_tokens=12)
                    messages.append({"role": "assistant", "content": reply})
                    mgr.wait_settled()  # the user's reading time
                mgr.chat("s", messages[:index] + [EDIT], max_new_tokens=4)
                t = mgr.last_turn("s")
                edited = f"user message {index // 2 + 1}"
                reused = (
                    f"{t.reused_tokens}/{t.prompt_tokens} {t.reused_tokens / t.prompt_tokens:.0%}"
                )
                print(
                    f"{family:10} {placement:9}{edited:>15} {reused:>14} {t.checkpoint_restored:>7}"
                )


if __name__ == "__main__":
    main()
