"""Loading a .gguf file needs packages transformers does not install, and a
fresh machine's ``make demo`` (which loads one) installs only RUN_DEPS: they,
and the ``gguf`` extra, must hold every one, and a missing one is named before
anything is read. ``make demo`` on a fresh venv once died in transformers
("accelerate is required when loading a GGUF file") after a minute of
installs, because the test dependencies, which pull accelerate in, were
always there when it was tried. No model."""

from __future__ import annotations

import importlib.util
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


@pytest.mark.parametrize("extra", ["gguf", "serve"])
def test_the_extras_that_read_gguf_files_install_what_it_needs(extra):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _names(pretrained.GGUF_NEEDS) <= _names(project["optional-dependencies"][extra])


@pytest.mark.parametrize("absent", ["gguf", "accelerate"])
def test_a_missing_package_is_named_before_the_file_is_read(absent, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a)
    )
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"not read")
    named = rf"needs {absent}>=[0-9.]+: pip install 'kvchat\[gguf\]'"
    with pytest.raises(ImportError, match=named):
        pretrained.load_pretrained(model_file)
