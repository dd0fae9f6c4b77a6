"""Every ``python`` block of README.md and docs/*.md runs as written: a page's
blocks in order, in one namespace (a page builds on its earlier blocks), in a
temporary folder, on the CPU. A page whose blocks need a server or a Redis
gets one started here (tests/python/snippets.py says how a block says so),
and its ``bash`` blocks marked ``server`` (``curl``) are sent to that server.
Blocks marked ``skip`` are reported as skips, with why."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
import types

import pytest
from helpers import ROOT
from kvchat import SessionManager
from kvchat.serve.process import ServerProcess, redis_server
from snippets import PAGES, REDIS_URL, SERVER_URL, Block, blocks

MARKS = {"server": pytest.mark.server, "store": pytest.mark.store, "slow": pytest.mark.slow}


def _runnable(page: str) -> list[Block]:
    return [
        b
        for b in blocks(page)
        if b.kind != "skip" and (b.lang == "python" or (b.lang == "bash" and b.kind == "server"))
    ]


def _page_params():
    for page in PAGES:
        run = _runnable(page)
        if any(b.lang == "python" for b in run):
            kinds = {b.kind for b in run} - {None}
            yield pytest.param(page, id=page, marks=[MARKS[k] for k in sorted(kinds)])


SKIPPED = [b for page in PAGES for b in blocks(page) if b.kind == "skip"]


def _server(command: str) -> ServerProcess:
    """``kvchat serve ARGS``, as the block's mark names it, on a free port."""
    words = shlex.split(command)
    assert words[:2] == ["kvchat", "serve"], command
    return ServerProcess(
        lambda port: [sys.executable, "-m", "kvchat.serve", *words[2:], "--port", str(port)]
    )


def _run_python(block: Block, code: str, module: types.ModuleType) -> None:
    # Blank lines first, so a traceback's line numbers are the page's.
    source = "\n" * block.line + code
    exec(compile(source, block.page, "exec"), module.__dict__)  # noqa: S102


def _run_bash(block: Block, code: str) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{block.where}: {done.stderr}"
    answer = json.loads(done.stdout)
    assert "error" not in answer, f"{block.where}: {answer}"


@pytest.mark.parametrize("page", list(_page_params()))
def test_the_python_blocks_of_a_page_run_as_written(page, tmp_path, monkeypatch):
    run = _runnable(page)
    servers = {b.detail for b in run if b.kind == "server"}
    assert len(servers) <= 1, f"{page}: one server per page, not {servers}"
    monkeypatch.chdir(tmp_path)  # what a block writes (a session file) lands here
    # A module of its own: pydantic and dataclasses resolve annotations there.
    module = types.ModuleType(f"snippets_{page.replace('/', '_').replace('.', '_')}")
    sys.modules[module.__name__] = module
    with contextlib.ExitStack() as stack:
        stack.callback(sys.modules.pop, module.__name__)
        replace = {}
        if servers:
            server = stack.enter_context(_server(servers.pop()))
            replace[SERVER_URL] = server.url
        if any(b.kind == "store" for b in run):
            redis = stack.enter_context(redis_server())
            replace[REDIS_URL] = redis.redis_url
        stack.callback(_close_managers, module)
        for block in run:
            code = block.code
            for old, new in replace.items():
                code = code.replace(old, new)
            with contextlib.redirect_stdout(io.StringIO()):
                if block.lang == "python":
                    _run_python(block, code, module)
                else:
                    _run_bash(block, code)


def _close_managers(module: types.ModuleType) -> None:
    for value in list(vars(module).values()):
        if isinstance(value, SessionManager):
            value.close()


@pytest.mark.parametrize("block", SKIPPED, ids=[b.where for b in SKIPPED])
def test_a_block_marked_skip_says_why(block):
    assert block.detail, f"{block.where}: a skip needs its reason in parentheses"
    pytest.skip(f"{block.where}: {block.detail}")


# What a fence may be tagged: code the tests run or check, or output shown as it is.
KNOWN_LANGUAGES = {"python", "bash", "text", ""}


def test_every_block_is_one_the_tests_know():
    """A block tagged ``py``, ``sh`` or ``console``, or a fence indented so
    the block reader misses it, would never be run or checked: the docs use
    only the languages the tests read."""
    for page in PAGES:
        for block in blocks(page):
            assert block.lang in KNOWN_LANGUAGES, (
                f"{block.where}: a ```{block.lang} block; the snippet tests run python, "
                "check bash, and show text (or an untagged block) as it is"
            )
        text = (ROOT / page).read_text("utf-8")
        indented = [n for n, line in enumerate(text.splitlines(), 1) if line.startswith(" ")]
        fences = [n for n in indented if text.splitlines()[n - 1].lstrip().startswith("```")]
        assert not fences, f"{page}: indented fences at lines {fences} are not read"


def test_an_untagged_block_is_not_python():
    """Output shown as it is must not be code left untagged (it would not run)."""
    for page in PAGES:
        for block in blocks(page):
            if block.lang == "":
                code = block.code.lstrip()
                assert not code.startswith(("from ", "import ", "def ", "mgr.")), block.where
