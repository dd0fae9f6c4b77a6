"""Loading a .gguf file needs packages transformers does not install, and a
fresh machine's ``make demo`` (which loads one) installs only RUN_DEPS: they,
and the ``gguf`` extra, must hold every one, and a missing one is named before
anything is read. ``make demo`` on a fresh venv once died in transformers
("accelerate is required when loading a GGUF file") after a minute of
installs, because the test dependencies, which pull accelerate in, were
always there when it was tried. No model."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import tomllib
from helpers import ROOT
from kvchat import pretrained


def _names(requirements) -> set[str]:
    return {re.split(r"[<>=\[ ]", r.strip('"'), maxsplit=1)[0].lower() for r in requirements}


def test_make_demo_installs_what_loading_a_gguf_needs():
    makefile = (ROOT / "Makefile").read_text()
    run_deps = re.search(r"^RUN_DEPS := (.*?)(?<!\\)\n", makefile, re.S | re.M).group(1)
    installed = _names(re.findall(r'"[^"]+"', run_deps))
    assert _names(pretrained.GGUF_NEEDS) <= installed


@pytest.mark.parametrize("extra", ["gguf", "serve", "test"])
def test_the_extras_that_read_gguf_files_install_what_it_needs(extra):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _names(pretrained.GGUF_NEEDS) <= _names(project["optional-dependencies"][extra])


@pytest.mark.parametrize(
    ("package", "installed"),
    [("gguf", None), ("accelerate", None), ("gguf", "0.9.1"), ("accelerate", "0.34.2")],
    ids=["no-gguf", "no-accelerate", "old-gguf", "old-accelerate"],
)
def test_a_missing_or_old_package_is_named_before_the_file_is_read(
    package, installed, tmp_path, monkeypatch
):
    real = importlib.metadata.version

    def version(name):
        if name != package:
            return real(name)
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"not read")
    found = "" if installed is None else rf" \(found {re.escape(installed)}\)"
    named = rf"needs {package}>=[0-9.]+{found}: pip install 'kvchat\[gguf\]'"
    with pytest.raises(ImportError, match=named):
        pretrained.load_pretrained(model_file)
