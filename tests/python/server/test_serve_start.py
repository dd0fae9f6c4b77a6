"""kvchat serve at start-up: what it refuses before loading the model (each
refusal one line naming the flag, exit 2, no traceback), the model id it
serves a folder or a .gguf file under, and the one line it logs once loaded."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
import torch
from helpers import doc_table_rows, user_message
from kvchat.tiny import tiny_model, tiny_tokenizer
from serving import Server

pytestmark = pytest.mark.server

# What kvchat serve logs as the model starts to load: a refusal must come before it.
LOADING = "loading MODEL"


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvchat.serve", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def busy_port():
    """A port something already listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def _cases(tmp_path, busy_port):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0")
    cases = {
        "missing file": (
            ["missing.gguf"],
            "MODEL: 'missing.gguf' does not exist (no such file or folder); give a checkpoint "
            "folder, a .gguf file or tiny[:FAMILY]",
        ),
        "folder without config.json": (
            [str(tmp_path / "empty")],
            f"MODEL: config.json is missing in '{tmp_path / 'empty'}'",
        ),
        "file that is not .gguf": (
            [str(tmp_path / "weights.bin")],
            "MODEL: a model file must be a .gguf file",
        ),
        "unknown tiny family": (["tiny:nope"], "unknown tiny family 'nope' in MODEL 'tiny:nope'"),
        "port out of range": (["tiny", "--port", "70000"], "--port must be 1 to 65535, got 70000"),
        "port in use": (
            ["tiny", "--port", str(busy_port)],
            f"--port {busy_port}: the address 127.0.0.1:{busy_port} is already in use",
        ),
        "unknown host": (
            ["tiny", "--host", "no-such-host.invalid"],
            "--host 'no-such-host.invalid' is not an address of this machine",
        ),
        "not a device": (["tiny", "--device", "gpu"], "--device 'gpu' is not a torch device"),
        "negative --session-ttl": (
            ["tiny", "--session-ttl", "-1"],
            "--session-ttl must be 0 (never) to 315360000 seconds (ten years), got -1.0",
        ),
        "endless --session-ttl": (  # crashed a --store server at start
            ["tiny", "--session-ttl", "inf"],
            "--session-ttl must be 0 (never) to 315360000 seconds (ten years), got inf",
        ),
        "--max-sessions 0": (  # was refused only after the model loaded
            ["tiny", "--max-sessions", "0"],
            "--max-sessions must be at least 1, got 0",
        ),
        "--max-cache-bytes not a size": (
            ["tiny", "--max-cache-bytes", "lots"],
            "--max-cache-bytes",
        ),
        "--log-level not a level": (  # was a ValueError traceback
            ["tiny", "--log-level", "loud"],
            "argument --log-level: invalid choice: 'loud'",
        ),
        "--api-key not ASCII": (  # was accepted, and no client could ever send it
            ["tiny", "--api-key", "ключ"],
            "--api-key 'ключ': a key is sent in an HTTP header, so it must be printable ASCII",
        ),
        "--store and --spill-dir": (
            ["tiny", "--store", "redis://127.0.0.1:1/0", "--spill-dir", str(tmp_path)],
            "give --store or --spill-dir, not both",
        ),
        "--warm-up without --compile": (
            ["tiny", "--warm-up", "2048"],
            "--warm-up compiles the decode: give --compile too",
        ),
        "--warm-up not lengths": (
            ["tiny", "--compile", "--warm-up", "0"],
            "argument --warm-up: positive ints, comma-separated, got '0'",
        ),
    }
    if not torch.cuda.is_available():
        cases["--device cuda without CUDA"] = (
            ["tiny", "--device", "cuda"],
            "--device 'cuda': this torch is built without CUDA"
            if torch.version.cuda is None
            else "--device 'cuda': no GPU",
        )
    return cases


CASES = [
    "missing file",
    "folder without config.json",
    "file that is not .gguf",
    "unknown tiny family",
    "port out of range",
    "port in use",
    "unknown host",
    "not a device",
    "negative --session-ttl",
    "endless --session-ttl",
    "--store and --spill-dir",
    "--api-key not ASCII",
    "--max-sessions 0",
    "--max-cache-bytes not a size",
    "--log-level not a level",
    "--device cuda without CUDA",
    "--warm-up without --compile",
    "--warm-up not lengths",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_start_is_refused_before_the_model_loads(case, tmp_path, busy_port):
    cases = _cases(tmp_path, busy_port)
    if case not in cases:
        pytest.skip("this torch has a GPU")
    argv, message = cases[case]
    done = _serve(*argv)
    assert done.returncode == 2, done.stderr
    assert f"kvchat serve: error: {message}" in done.stderr, done.stderr
    assert LOADING not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_model_ids_are_file_and_folder_names(tmp_path, monkeypatch):
    from kvchat.serve.startup import model_id

    gguf = tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf"
    gguf.write_bytes(b"")
    folder = tmp_path / "my-checkpoint"
    folder.mkdir()
    assert model_id(str(gguf)) == "SmolLM2-135M-Instruct-Q8_0"
    assert model_id(str(folder)) == model_id(f"{folder}/") == "my-checkpoint"
    monkeypatch.chdir(folder)
    assert model_id(".") == "my-checkpoint"
    assert model_id("tiny") == "tiny" and model_id("tiny:lfm2") == "tiny:lfm2"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("start") / "my-checkpoint"
    tiny_model("llama", dtype=torch.float64).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_a_folder_is_served_under_its_name_and_the_start_says_so(checkpoint):
    """One INFO line names the id to send, the address, dtype, device and
    options; no optional package's import warning (torchao's "Failed to
    load", torch's pytree deprecation) reaches the output."""
    server = Server(str(checkpoint), "--max-sessions", "7", "--no-settle")
    try:
        output = server.output()
        lines = [line for line in output.splitlines() if "serving model" in line]
        assert lines == [
            f"INFO kvchat.serve: serving model 'my-checkpoint' at {server.url}/v1 "
            "(float64 on cpu): max sessions 7, cache bytes no limit, store none, "
            "settle off, compile off, no API key"
        ], output
        assert output.index(LOADING) < output.index("serving model")
        for noise in ("Failed to load", "torchao", "_pytree", "Traceback"):
            assert noise not in output, output
        models = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"]
        assert [m["id"] for m in models] == ["my-checkpoint"]
        # The id, and the path as given (what clients sent before), reach the model.
        for model in ("my-checkpoint", str(checkpoint)):
            body = {"model": model, "messages": [user_message(0)], "max_tokens": 2}
            reply = server.post("/v1/chat/completions", key=None, json=body)
            assert reply.status_code == 200, reply.text
        body["model"] = "other"
        refused = server.post("/v1/chat/completions", key=None, json=body)
        assert refused.status_code == 404
        assert "this server serves 'my-checkpoint'" in refused.json()["error"]["message"]
    finally:
        server.stop()


# docs/serving.md "Start-up errors" row -> the cases above that cover it.
START_ROWS = {
    "`MODEL` that does not exist": ["missing file"],
    "`MODEL` a folder with no `config.json`": ["folder without config.json"],
    "`MODEL` a file that is not `.gguf`": ["file that is not .gguf", "unknown tiny family"],
    "`--port` out of range": ["port out of range"],
    "`--port` in use": ["port in use", "unknown host"],
    "`--device` torch does not have": ["not a device", "--device cuda without CUDA"],
    "`--session-ttl` below 0": [
        "negative --session-ttl",
        "endless --session-ttl",
        "--store and --spill-dir",
        "--warm-up without --compile",
    ],
    "an `--api-key`": ["--api-key not ASCII"],
    "`--max-sessions` below 1": [
        "--max-sessions 0",
        "--max-cache-bytes not a size",
        "--log-level not a level",
        "--warm-up not lengths",
    ],
}


def test_every_start_up_error_row_is_covered():
    rows = doc_table_rows("docs/serving.md", "## Start-up errors")
    assert len(rows) == len(START_ROWS)
    for row in rows:
        keys = [key for key in START_ROWS if row.startswith(key)]
        assert len(keys) == 1, f"docs/serving.md start-up row {row!r} has no test"
        assert set(START_ROWS[keys[0]]) <= set(CASES)
