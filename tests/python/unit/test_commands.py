"""The commands a newcomer runs first say what they are: ``kvchat`` with no
arguments prints its help, ``python -m kvchat.demo --help`` names itself and
explains every option, and ``python -m kvchat.tiny`` writes where it is told,
never into the installed package."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvchat import cli, demo, tiny
from kvchat.tiny import TOKENIZER_FILE

SHIPPED = Path(tiny.__file__).parent / "data" / TOKENIZER_FILE


def _flat(text: str) -> str:
    return " ".join(text.split())  # argparse wraps to the terminal's width


def test_kvchat_with_no_arguments_prints_its_help_and_commands(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == 2  # no command: a usage error, as argparse's are
    err = _flat(capsys.readouterr().err)
    assert err.startswith("usage: kvchat [-h] COMMAND ...")
    assert "kvchat: multi-turn KV-cache reuse for HuggingFace transformers." in err
    assert "serve an OpenAI-compatible server that keeps every conversation's cache" in err
    assert "kvchat COMMAND --help shows a command's options." in err


def test_kvchat_help_and_an_unknown_command(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert "serve an OpenAI-compatible server" in _flat(capsys.readouterr().out)
    with pytest.raises(SystemExit) as exited:
        cli.main(["srve"])
    assert exited.value.code == 2
    assert "invalid choice: 'srve' (choose from 'serve')" in capsys.readouterr().err


def test_the_demos_help_names_it_and_every_option(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m kvchat.demo ")
    assert "demo.py" not in out
    flat = _flat(out)
    assert "--size {tiny,small} with --family: the tiny model's size;" in flat
    for option in ("--turns TURNS", "--max-new-tokens MAX_NEW_TOKENS", "--size {tiny,small}"):
        after = flat.split(option, 2)[2].split()  # past the usage line's mention
        assert not after[0].startswith("--"), f"{option} has no help text"


def test_tiny_writes_the_tokenizer_where_it_is_told(tmp_path, monkeypatch, capsys):
    shipped = SHIPPED.stat().st_mtime_ns
    tiny.main([str(tmp_path / "out" / "tok.json")])
    assert (tmp_path / "out" / "tok.json").read_bytes() == SHIPPED.read_bytes()
    monkeypatch.chdir(tmp_path)
    tiny.main([])  # the current folder by default
    assert (tmp_path / TOKENIZER_FILE).read_bytes() == SHIPPED.read_bytes()
    assert SHIPPED.stat().st_mtime_ns == shipped  # the package's own file untouched
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {TOKENIZER_FILE}"
    with pytest.raises(SystemExit):
        tiny.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m kvchat.tiny [-h] [path]")


def test_a_tiny_model_builds_without_optional_packages_import_warnings():
    """transformers' model classes import torchao when it is installed (a test
    dependency here), which logs "Failed to load" for its CUDA kernels and
    torch's pytree deprecations: not on kvchat's paths that build a model."""
    import subprocess
    import sys

    code = "from kvchat.tiny import tiny_model; tiny_model('llama'); print('built')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "built\n", done.stderr
    for noise in ("Failed to load", "torchao", "_pytree"):
        assert noise not in done.stderr, done.stderr
