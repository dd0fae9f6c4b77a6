"""A server in a subprocess on a free 127.0.0.1 port, ready once ``GET /health``
answers 200 (or its own probe says so), and stopped by whoever started it: what
the tests, ``benchmarks/serve.py`` and ``docs/screenshot.py`` run servers
with, Redis included (``redis_server``)."""

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
        ready: Callable[[ServerProcess], bool] | None = None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self._ready = ready or _health_ok
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
            if self._ready(self):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self._argv[0]} was not ready in {timeout:.0f} s")

    def output(self) -> str:
        """What the server has written so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """Ends the server at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

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


def _health_ok(server: ServerProcess) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):  # not listening yet, or not ready
        return False


def _redis_pings(server: ServerProcess) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_server(
    maxmemory: str = "256mb", port: int | None = None, log: str | os.PathLike | None = None
) -> ServerProcess:
    """A ``redis-server`` (Debian's package) on 127.0.0.1, with nothing saved to
    disk and ``allkeys-lru`` eviction past ``maxmemory``; ``server.redis_url``
    is its URL. ``port``: reuse one (to restart a server a test killed)."""
    argv = lambda port: [  # noqa: E731
        "redis-server",
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", maxmemory,
        "--maxmemory-policy", "allkeys-lru",
    ]  # fmt: skip
    server = ServerProcess(argv, log=log, timeout=30, ready=_redis_pings, port=port)
    server.redis_url = f"redis://127.0.0.1:{server.port}/0"
    return server
