"""kvchat serve's flags reach the SessionManager it builds (no server started)."""

from __future__ import annotations

import argparse

import pytest
from kvchat.serve import cli
from kvchat.serve.preflight import preflight


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


@pytest.mark.parametrize(("flags", "delay"), [((), 0.25), (("--settle-delay", "0"), 0.0)])
def test_settle_delay_flag_reaches_the_manager(monkeypatch, flags, delay):
    assert _manager_arguments(monkeypatch, *flags)["settle_delay"] == delay


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "soon"])
def test_a_bad_settle_delay_is_refused_by_name(capsys, bad):
    with pytest.raises(SystemExit):
        _args("--settle-delay", bad)
    err = capsys.readouterr().err
    assert "--settle-delay" in err and repr(bad) in err


@pytest.mark.parametrize(("flags", "compiled"), [((), False), (("--compile",), True)])
def test_compile_flag_reaches_the_manager(monkeypatch, flags, compiled):
    assert _manager_arguments(monkeypatch, *flags)["compile"] is compiled


def test_warm_up_flag_warms_the_manager_up(monkeypatch):
    """--warm-up 300,2000 calls warm_up with those lengths before serving."""
    warmed = []
    monkeypatch.setattr(cli.SessionManager, "warm_up", lambda self, n: warmed.append(n) or [])
    _manager_arguments(monkeypatch, "--compile", "--warm-up", "300,2000")
    assert warmed == [[300, 2000]]
    warmed.clear()
    _manager_arguments(monkeypatch, "--compile")
    assert warmed == []


def test_bad_warm_up_flags_are_refused_by_name(capsys):
    for bad in ("0", "abc", "256,", ""):
        with pytest.raises(SystemExit):
            _args("--compile", "--warm-up", bad)
        assert "--warm-up" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--warm-up compiles the decode: give --compile too"):
        preflight(_args("--warm-up", "256"))
    with pytest.raises(ValueError, match="--warm-up: lengths: 9999 positions exceed"):
        cli.build_app(_args("--compile", "--warm-up", "9999", "--max-context-length", "2048"))


@pytest.mark.parametrize(
    ("flags", "per_key", "nbytes"),
    [
        ((), 1000, 64 * 2**20),
        (("--responses-per-key", "5", "--response-bytes-per-key", "12KiB"), 5, 12 * 1024),
    ],
)
def test_stored_response_bounds_reach_the_app(monkeypatch, flags, per_key, nbytes):
    import kvchat.serve

    seen = {}
    monkeypatch.setattr(kvchat.serve, "create_app", lambda manager, config: seen.update(c=config))
    cli.build_app(_args(*flags))
    assert (seen["c"].responses_per_key, seen["c"].response_bytes_per_key) == (per_key, nbytes)


@pytest.mark.parametrize(
    "flags",
    [("--responses-per-key", "0"), ("--response-bytes-per-key", "lots")],
    ids=["count", "bytes"],
)
def test_bad_stored_response_bounds_are_refused_by_name(flags):
    with pytest.raises(ValueError, match=flags[0]):
        cli.build_app(_args(*flags))


@pytest.mark.parametrize("ttl", ["-1", "inf", "nan", "1e16"])
def test_a_session_ttl_no_store_can_keep_is_refused_by_name(ttl):
    # inf crashed a --store server at start, 1e16 failed every stored response
    # (Redis takes lives in ms below 2**63), and nan was taken silently.
    with pytest.raises(ValueError, match="--session-ttl"):
        preflight(_args("--session-ttl", ttl))


def test_the_start_up_line_names_the_options_and_masks_the_store_password(monkeypatch, caplog):
    """Logged once the model is loaded (build_app): the id, the address, dtype,
    device and options; a --store URL never with its password."""
    args = _args(
        "--store", "redis://user:s3cret@127.0.0.1:1/0", "--max-cache-bytes", "1GiB",
        "--max-sessions", "3", "--compile", "--api-key", "k1", "--port", "9001",
    )  # fmt: skip
    built = []
    real = cli.SessionManager

    def keep(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(cli, "SessionManager", keep)
    with caplog.at_level("INFO", logger="kvchat.serve"):
        cli.build_app(args)
    built[0].tier.close(timeout=5)  # its writer thread: nothing listens on port 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving")]
    assert lines == [
        "serving model 'tiny:lfm2' at http://127.0.0.1:9001/v1 (float32 on cpu): "
        "max sessions 3, cache bytes 1GiB, store redis://***@127.0.0.1:1/0, settle after 0.25 s, "
        "compile on, 1 API key(s)"
    ]
    assert "s3cret" not in caplog.text


@pytest.mark.parametrize(
    ("flags", "value"),
    [((), "auto"), (("--pack-weights", "all"), True), (("--pack-weights", "off"), False)],
)
def test_pack_weights_flag_reaches_the_manager(monkeypatch, flags, value):
    given = _manager_arguments(monkeypatch, *flags)["pack_weights"]
    assert given == value and type(given) is type(value)  # True, not the string "all"


def test_a_bad_pack_weights_value_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        _args("--pack-weights", "yes")
    assert "--pack-weights" in capsys.readouterr().err
