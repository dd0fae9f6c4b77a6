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


# SmolLM3's own template lists tools from ``xml_tools`` (function specs, each
# written with Jinja's ``string`` filter) in its system header and asks for
# calls as Hermes-style <tool_call> JSON; llama.cpp's copy drops that header
# section. This one is written here in that shape, not copied.
_SMOLLM3_TOOLS = r"""{%- if xml_tools is defined -%}
    {{- "### Tools\n\nYou can call these functions, listed in <tools></tools>:\n<tools>\n" -}}
    {%- for tool in xml_tools -%}{{- (tool | string) + "\n" -}}{%- endfor -%}
    {{- "</tools>\n\nWrite each call as JSON inside <tool_call></tool_call> tags:\n" -}}
    {{- "<tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call>\n\n" -}}
{%- endif -%}
"""
_SMOLLM3_HEADER_END = '{{- "<|im_end|>\\n" -}}\n{# ───── main loop ───── #}'


def smollm3_template(target: Path = DEFAULT_DIR) -> str:
    """SmolLM3-3B's chat template with its ``xml_tools`` section: llama.cpp's
    copy, the section added where the system header ends. It renders an
    assistant message's content only, never its ``tool_calls``, and a tool's
    result as a user turn, as the original does."""
    template = (fetch(target) / "templates" / "HuggingFaceTB-SmolLM3-3B.jinja").read_text()
    if "xml_tools" in template:  # a later copy that kept it
        return template
    if _SMOLLM3_HEADER_END not in template:
        raise RuntimeError("llama.cpp's SmolLM3 template changed: the system header's end moved")
    return template.replace(_SMOLLM3_HEADER_END, _SMOLLM3_TOOLS + _SMOLLM3_HEADER_END, 1)


# Templates the tests name that are not llama.cpp's files as they are.
SMOLLM3 = "SmolLM3-3B-xml_tools"


def template_text(name: str, target: Path = DEFAULT_DIR) -> str:
    """The chat template a test names: llama.cpp's file of that stem, or
    ``SMOLLM3`` (``smollm3_template``)."""
    if name == SMOLLM3:
        return smollm3_template(target)
    return (fetch(target) / "templates" / f"{name}.jinja").read_text()


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
