"""A server in a subprocess on a free 127.0.0.1 port, ready once ``GET /health``
answers 200, and stopped by whoever started it: what the tests,
``benchmarks/serve.py`` and ``docs/screenshot.py`` run servers with."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Runs ``command(port)``; its output goes to ``log`` (default: a temporary
    file, removed by ``stop``), never to a pipe nobody reads, which would stall
    a server that logs every request."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        log: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 180.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._temporary = log is None
        if log is None:
            handle, log = tempfile.mkstemp(prefix="kvchat-server-", suffix=".log")
            os.close(handle)
        self.log = Path(log)
        self._argv = command(self.port)
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                self._argv, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, tail = self.process.returncode, self.output()[-4000:]
                raise RuntimeError(f"{self._argv[0]} exited with {code}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):  # not listening yet, or not ready
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self._argv[0]} did not answer /health in {timeout:.0f} s")

    def output(self) -> str:
        """What the server has written so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """Ends the server (terminate, then kill after 30 s); safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._temporary:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
