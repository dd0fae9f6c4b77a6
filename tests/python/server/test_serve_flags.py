"""kvchat serve's flags reach the SessionManager it builds (no server started)."""

from __future__ import annotations

import argparse

import pytest
from kvchat.serve import cli


def _args(*flags: str) -> argparse.Namespace:
    return cli.add_arguments(argparse.ArgumentParser()).parse_args(["tiny:lfm2", *flags])


def _manager_arguments(monkeypatch, *flags: str) -> dict:
    """The keyword arguments kvchat serve builds its SessionManager with."""
    seen = {}
    real = cli.SessionManager

    def capture(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "SessionManager", capture)
    cli.build_app(_args(*flags))
    return seen


@pytest.mark.parametrize(
    ("flags", "placement"), [((), "last"), (("--checkpoints", "every"), "every")]
)
def test_checkpoints_flag_reaches_the_manager(monkeypatch, flags, placement):
    assert _manager_arguments(monkeypatch, *flags)["checkpoints"] == placement


def test_a_bad_checkpoints_value_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        _args("--checkpoints", "all")
    assert "--checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "settle"), [((), True), (("--no-settle",), False)])
def test_no_settle_flag_reaches_the_manager(monkeypatch, flags, settle):
    assert _manager_arguments(monkeypatch, *flags)["settle"] is settle


@pytest.mark.parametrize(("flags", "compiled"), [((), False), (("--compile",), True)])
def test_compile_flag_reaches_the_manager(monkeypatch, flags, compiled):
    assert _manager_arguments(monkeypatch, *flags)["compile"] is compiled
