"""docs/ARCHITECTURE.md's file table is the map a newcomer walks: every
module of the package has a row, and every file a row names exists. No model."""

from __future__ import annotations

import re

import pytest
from helpers import ROOT

PACKAGE = ROOT / "python" / "kvchat"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def _rows() -> list[list[str]]:
    """The names in the first cell of each row of the Python package's table:
    ``tiers/redis/writer.py``, ``reader.py`` -> both, the second beside the first."""
    text = ARCHITECTURE.read_text()
    table = text.split("Python package (`python/kvchat/`):", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", first)
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        rows.append([names[0]] + [folder + n if "/" not in n else n for n in names[1:]])
    return rows


def _named() -> set[str]:
    return {name for row in _rows() for name in row}


def test_every_module_of_the_package_has_a_row():
    named = _named()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name in ("__init__.py", "__main__.py") or "__pycache__" in relative:
            continue
        folders = [relative.rsplit("/", k)[0] + "/" for k in (1, 2) if relative.count("/") >= k]
        if relative not in named and not any(f in named for f in folders):
            missing.append(relative)
    assert not missing, f"docs/ARCHITECTURE.md has no row for {missing}"


@pytest.mark.parametrize("name", sorted(_named()))
def test_every_file_a_row_names_exists(name):
    assert (PACKAGE / name).exists(), f"docs/ARCHITECTURE.md names {name}, which does not exist"


def _paths_the_docs_name() -> set[tuple[str, str]]:
    """(page, path) for every ``tests/...`` or ``benchmarks/...`` file path the
    README and the docs pages name: the files a reader is sent to."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = set()
    for page in pages:
        for path in re.findall(
            r"\b((?:tests|benchmarks)/[\w./-]+\.(?:py|cpp|sh|md))", page.read_text()
        ):
            found.add((page.relative_to(ROOT).as_posix(), path))
    return found


def test_every_test_or_benchmark_file_the_docs_name_exists():
    named = _paths_the_docs_name()
    assert len(named) > 20  # the pattern still finds the pages' references
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, f"the docs name files that do not exist: {missing}"
