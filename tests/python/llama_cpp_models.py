"""Real chat templates and vocabularies for the tests, from llama.cpp's sources.

The ``llama-cpp-python`` sdist on PyPI vendors llama.cpp, whose ``models/``
folder holds about 70 public models' chat templates (``templates/*.jinja``)
and vocabulary-only GGUF files (``ggml-vocab-*.gguf``). No model hub needed.

    python tests/python/llama_cpp_models.py build/llama-cpp

downloads the sdist once and extracts the templates, the vocabularies the
tests use and llama.cpp's LICENSE (MIT) into that folder; ``make test`` runs it.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
VOCABS = ("qwen2", "llama-bpe", "gpt-2", "phi-3")
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "build" / "llama-cpp"
_DONE = ".complete"


def _wanted(member: str) -> str | None:
    """Where an sdist member goes under the target folder, or None."""
    parts = member.split("/")
    if parts[1:] == ["vendor", "llama.cpp", "LICENSE"]:
        return "LICENSE"
    if parts[1:4] != ["vendor", "llama.cpp", "models"]:
        return None
    rest = parts[4:]
    if len(rest) == 2 and rest[0] == "templates" and rest[1].endswith((".jinja", ".md")):
        return "/".join(rest)
    if len(rest) == 1 and rest[0] in {f"ggml-vocab-{v}.gguf" for v in VOCABS}:
        return rest[0]
    return None


def download_sdist(folder: Path) -> Path:
    """The llama-cpp-python sdist, downloaded from PyPI into ``folder``.
    Only it is taken as source: pip reads its metadata in an isolated build
    environment, and with ``:all:`` that environment's cmake was compiled
    from source too (half an hour on 2 cores, once a PyPI cmake is about)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--no-binary", "llama-cpp-python", SDIST, "-d", str(folder)],
        check=True,
    )
    (sdist,) = Path(folder).glob("llama_cpp_python-*.tar.gz")
    return sdist


def fetch(target: Path = DEFAULT_DIR) -> Path:
    """The folder of templates and vocabularies, downloaded on first use."""
    if (target / _DONE).exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    # Two pytest workers may both get here: one downloads, the other waits for it.
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE).exists():
            _download(target)
    return target


def _download(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(download_sdist(Path(tmp))) as archive:
            for member in archive:
                name = _wanted(member.name)
                if name is None or not member.isfile():
                    continue
                out = target / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.extractfile(member).read())
    missing = [v for v in VOCABS if not (target / f"ggml-vocab-{v}.gguf").exists()]
    if missing or not (target / "templates").is_dir():
        raise RuntimeError(f"{SDIST} lacks the expected files (vocabularies missing: {missing})")
    (target / _DONE).write_text(f"{SDIST}\n")


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
