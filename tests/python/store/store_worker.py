"""A second process for the Redis store tests: one SessionManager on a tiny
float64 model, fed turns as JSON lines on stdin, answering each on stdout once
the turn's snapshot is stored (so the other process's next turn can find it).

    python store_worker.py FAMILY REDIS_URL
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from kvchat import SessionManager
from kvchat.tiny import tiny_model, tiny_tokenizer


def main() -> None:
    family, url = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # two workers and the test share two cores
    model = tiny_model(family, dtype=torch.float64, seed=0)
    manager = SessionManager(model, tiny_tokenizer(), store=url)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        reply = manager.chat(
            request["session"], request["messages"], max_new_tokens=request["max_new_tokens"]
        )
        stored = manager.flush(timeout=60)
        report = dataclasses.asdict(manager.last_turn(request["session"]))
        answer = {"reply": reply, "report": report, "stored": stored}
        print(json.dumps(answer), flush=True)
    manager.close()
    stats = manager.stats()
    print(json.dumps({"stats": dataclasses.asdict(stats)}), flush=True)


if __name__ == "__main__":
    main()
