"""The ``bash`` blocks of README.md and docs/*.md say what works: every
``kvchat serve`` / ``python -m kvchat...`` line parses with the command's own
argparse parser, every ``make`` target exists, every ``pip install`` of the
checkout names extras pyproject.toml has, every ``python -c`` runs. And
docs/serving.md's flag table is the parser's: every option with its default,
no flag the parser lacks; ``--help`` shows every default. No model."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from unittest import mock

import pytest
from helpers import ROOT
from kvchat import demo
from kvchat.serve import cli, preflight
from packaging.requirements import Requirement
from snippets import PAGES, all_blocks

MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
_EXTRAS_TABLE = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
EXTRAS = set(re.findall(r"^([\w-]+) = \[", _EXTRAS_TABLE.split("\n[")[0], flags=re.M))
# A command's ``main(argv)``, which parses argv with argparse first.
MAINS = {"kvchat serve": cli.main, "kvchat.serve": cli.main, "kvchat.demo": demo.main}
# Shown for the reader's own machine, not run here: the system's packages and servers.
SHOWN = {"apt-get", "redis-server"}


def _lines(code: str) -> list[list[str]]:
    """The block's commands, split as bash would, comments and blank lines left out."""
    commands, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if words:
            commands.append(words)
        pending = ""
    assert not pending.strip(), f"unclosed quote in {pending!r}"
    return commands


class _Parsed(Exception):
    pass


def parsed(main, argv: list[str]) -> argparse.Namespace | None:
    """What ``main(argv)``'s parser makes of ``argv``, stopping right after it
    parsed (nothing loads); None for ``--help``. Fails with argparse's message."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            main(argv)
        except _Parsed as done:
            return done.args[0]
        except SystemExit as exit:
            assert exit.code == 0, f"{argv} does not parse: {err.getvalue().strip()}"
            assert "usage:" in out.getvalue()
            return None
    raise AssertionError(f"{main.__module__}.main({argv}) never parsed its arguments")


def check_line(words: list[str]) -> None:
    program = words[0]
    if program == "make":
        assert len(words) > 1 and all(t in MAKE_TARGETS for t in words[1:]), (
            f"no such Makefile target in {words}"
        )
    elif words[:2] == ["kvchat", "serve"]:
        args = parsed(MAINS["kvchat serve"], words[2:])
        if args is not None and preflight.is_tiny(args.model):  # tiny:nonesuch parses
            try:
                preflight.check_model_spec(args.model)
            except ValueError as error:
                raise AssertionError(f"{words}: {error}") from None
    elif program in ("python", "python3") and words[1] == "-m":
        assert words[2] in MAINS, f"no check for python -m {words[2]}"
        parsed(MAINS[words[2]], words[3:])
    elif program in ("python", "python3") and words[1] == "-c":
        exec(compile(words[2], "python -c", "exec"), {})  # noqa: S102
    elif program in ("pip", "pip3") and words[1] == "install":
        for spec in (w for w in words[2:] if not w.startswith("-")):
            if spec.startswith("."):  # the checkout, with extras
                extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
                assert extras, f"cannot read {spec!r}"
                unknown = set((extras.group(1) or "").split(",")) - EXTRAS - {""}
                assert not unknown, f"pyproject.toml has no extra {unknown}"
            else:
                name = Requirement(spec).name
                assert name != "kvchat", (
                    f"{spec!r}: kvchat is on no index; install the checkout, '.[extra]'"
                )
    elif program not in SHOWN:
        raise AssertionError(f"no check for {words}: teach this test, or mark the block")


BASH = [b for b in all_blocks("bash") if b.kind != "skip"]


@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_every_bash_line_parses_or_exists(block):
    for words in _lines(block.code):
        if words[0] == "curl":  # sent by tests/python/api/test_doc_snippets.py
            assert block.kind == "server", f"{block.where}: curl needs a server: mark it"
            continue
        check_line(words)


# A command in running text: `make bench-serve`, `kvchat serve --no-settle`.
_INLINE = re.compile(r"`((?:make|kvchat serve|python -m kvchat\.demo) [^`]*)`")


@pytest.mark.parametrize("page", PAGES)
def test_every_command_in_the_text_parses_or_exists(page):
    for span in _INLINE.findall((ROOT / page).read_text()):
        words = [w for w in shlex.split(span) if not w.startswith("[")]  # "[flags]"
        if words[:2] == ["kvchat", "serve"] and (len(words) == 2 or words[2].startswith("-")):
            words.insert(2, "tiny")  # a flag named alone: any MODEL
        check_line(words)


@pytest.mark.parametrize(
    "line, message",
    [
        ("kvchat serve tiny --prot 8000", "does not parse"),
        ("kvchat serve tiny --dtype float8", "does not parse"),
        ("python -m kvchat.demo --family nonesuch", "does not parse"),
        ("kvchat serve tiny:nonesuch", "unknown tiny family"),
        ("make no-such-target", "no such Makefile target"),
        ('pip install "kvchat[serve]"', "kvchat is on no index"),
        ('pip install --no-build-isolation ".[sever]"', "no extra"),
        ("ls -l", "no check for"),
    ],
)
def test_a_wrong_line_fails_the_check(line, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_line(shlex.split(line))


def test_every_server_block_names_the_command_it_runs_against():
    for block in all_blocks("bash") + all_blocks("python"):
        if block.kind == "server":
            assert block.detail.startswith("kvchat serve "), block.where
            parsed(cli.main, shlex.split(block.detail)[2:])


# ------------------------------------------------------- serving.md's flags
def _parser() -> argparse.ArgumentParser:
    return cli.add_arguments(argparse.ArgumentParser())


def _options() -> list[argparse.Action]:
    return [a for a in _parser()._actions if a.option_strings and a.dest != "help"]


def _flag_table() -> dict[str, str]:
    """docs/serving.md's flag table: {flag: its default cell}."""
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    table = {}
    for row in rows:
        flag_cell, default_cell = (cell.strip() for cell in row.split("|")[1:3])
        for flag in re.findall(r"`(--[\w-]+)", flag_cell):
            assert flag not in table, f"{flag} has two rows"
            table[flag] = default_cell
    return table


def _no_value(default) -> bool:
    return default is None or default is False or default == []


def _says(cell: str, default) -> bool:
    """Whether a default cell says ``default``: its first code span is the
    value; a flag whose default is no value has none."""
    span = re.match(r"`([^`]*)`", cell)
    if _no_value(default):
        return span is None and cell != ""
    if span is None:
        return False
    if isinstance(default, float):
        return float(span.group(1)) == default
    return span.group(1) == str(default)


def test_every_flag_of_kvchat_serve_has_a_row_with_its_default():
    table = _flag_table()
    for action in _options():
        flag = action.option_strings[-1]
        assert flag in table, f"docs/serving.md's flag table has no row for {flag}"
        assert _says(table[flag], action.default), (
            f"{flag}: docs/serving.md says {table[flag]!r}, the parser's default is "
            f"{action.default!r}"
        )


def test_every_flag_the_table_names_exists():
    known = {s for a in _options() for s in a.option_strings}
    unknown = set(_flag_table()) - known
    assert not unknown, f"docs/serving.md lists flags kvchat serve lacks: {unknown}"


def test_help_gives_every_option_a_text_and_shows_its_default():
    for action in _options():
        assert action.help, f"{action.option_strings[-1]} has no help text"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(out.getvalue().split())  # argparse wraps lines
    for action in _options():
        if not _no_value(action.default):
            shown = f"default: {action.default}"
            assert shown in text, f"--help shows no {shown!r} for {action.option_strings[-1]}"
