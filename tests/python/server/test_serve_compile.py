"""``kvchat serve --compile --warm-up``: the decode compiles before the server
listens, /metrics counts it, and streamed turns in the warmed bucket compile
nothing more and give plain generate's replies (float64, tiny LFM2, two
conversations)."""

from __future__ import annotations

import re

import pytest
from helpers import SYSTEM, reference_turn, user_message
from serving import ask, client_for, reference_model, start_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def compiled_server():
    yield from start_server("tiny:lfm2", "--compile", "--warm-up", "256")


def _metric(server, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", server.get("/metrics").text, re.M)
    assert found, name
    return float(found.group(1))


def test_warmed_up_turns_compile_nothing_and_stay_exact(compiled_server, tokenizer):
    server, model = compiled_server, reference_model("lfm2")
    warmed = _metric(server, "kvchat_compiles_total")
    # The warm-up's own: the two-row graph recompiles the one-row graph's function.
    recompiled = _metric(server, "kvchat_recompiles_total")
    assert warmed >= 1 and _metric(server, "kvchat_compile_seconds_total") > 0
    client = client_for(server)
    histories = {key: [SYSTEM] for key in ("a", "b")}
    for turn in range(2):
        for offset, (key, messages) in enumerate(histories.items()):
            messages.append(user_message(turn + 3 * offset))
            reply, usage = ask(client, messages, key, stream=True)
            assert usage.prompt_tokens + 12 <= 256  # the warmed bucket
            assert reply == reference_turn(model, tokenizer, messages)[0], (key, turn)
            messages.append({"role": "assistant", "content": reply})
    assert _metric(server, "kvchat_compiled_turns_total") == 4
    assert _metric(server, "kvchat_compiles_total") == warmed
    assert _metric(server, "kvchat_recompiles_total") == recompiled
