"""The fenced code blocks of README.md and docs/*.md, with what each needs.

An HTML comment on the line right before a fence says what a block needs, so
the reader sees the block as written and the tests know how to run it:

- ``<!-- snippet: skip (why) -->``: not run here (a GPU, a network, a package
  the test environment lacks, or another test runs it); reported as a skip;
- ``<!-- snippet: server (kvchat serve ARGS) -->``: run against that server,
  started on a free port (``http://127.0.0.1:8000`` in the block is its URL);
- ``<!-- snippet: store -->``: run against a ``redis-server`` started on a free
  port (``redis://127.0.0.1:6379/0`` in the block is its URL);
- ``<!-- snippet: slow -->``: run, but only in ``make test``.

A block without one runs as it is: ``python`` blocks in ``make test-fast``,
a page's blocks in order in one namespace; ``bash`` lines are checked
(tests/python/unit/test_doc_commands.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from helpers import ROOT

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
KINDS = ("skip", "server", "store", "slow")
# The addresses the docs' examples use, replaced by the ones the tests start.
SERVER_URL = "http://127.0.0.1:8000"
REDIS_URL = "redis://127.0.0.1:6379/0"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
_MARK = re.compile(r"<!-- snippet: (\w+)(?: \((.*)\))? -->")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    kind: str | None  # one of KINDS, or None: runs as it is
    detail: str  # a skip's reason, a server's command

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    text = (ROOT / page).read_text("utf-8")
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        kind, detail = None, ""
        if mark := _MARK.fullmatch(before.strip()):
            kind, detail = mark.group(1), mark.group(2) or ""
            if kind not in KINDS:
                raise ValueError(f"{page}:{line}: unknown snippet kind {kind!r}, one of {KINDS}")
        found.append(Block(page, line, match.group(1), match.group(2), kind, detail))
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == lang]
