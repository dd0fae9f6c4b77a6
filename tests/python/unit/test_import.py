"""The package imports, and refuses a torch other than the one it was built with."""

from __future__ import annotations

import subprocess
import sys


def test_import_public_api():
    from kvchat import SessionManager  # noqa: F401


def test_torch_version_mismatch_is_a_clear_import_error():
    code = "import torch; torch.__version__ = '0.0.1'; import kvchat"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "kvchat was built against torch" in result.stderr
    assert "0.0.1" in result.stderr
