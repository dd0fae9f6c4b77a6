"""The demo behind `make demo`: a replay, and the table it prints."""

from __future__ import annotations

import pytest
from kvchat import demo

pytestmark = pytest.mark.slow


def test_replay_reuses_and_matches_plain_generate():
    result = demo.replay(turns=3, max_new_tokens=4, family="lfm2", size="tiny", progress=False)
    assert [row.turn for row in result.rows] == [1, 2, 3]
    assert result.rows[0].reused == 0
    assert all(row.reused > 0 for row in result.rows[1:])
    # float32 may flip a near-tie in principle; these seeds do not, so a NO is a bug.
    assert all(row.same_tokens for row in result.rows)
    table = demo.format_table(result.rows)
    assert "hit rate" in table and "NO" not in table
    summary = demo.format_family_summary([result])
    assert "lfm2" in summary and "LinearAttentionLayer" in summary


def test_main_prints_the_table(capsys):
    demo.main(["--turns", "2", "--max-new-tokens", "3", "--size", "tiny", "--family", "llama"])
    out = capsys.readouterr().out
    assert "kvchat demo: tiny random llama (tiny)" in out
    assert "speedup" in out


def test_main_replays_a_real_conversation_by_default(capsys):
    # make demo's default: SmolLM2-135M-Instruct's real weights (make test installs them).
    demo.main(["--turns", "2", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "kvchat demo: SmolLM2-135M-Instruct" in out
    assert "[1] user: " + demo.REAL_USER_TURNS[0] in out and "[2] user: " in out
    assert "assistant: " in out and "NO" not in out.split("speedup")[1]
