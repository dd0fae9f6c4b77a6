"""The ``kvchat serve`` command line: load a model, build the manager, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..arguments import check_seconds
from ..manager import SessionManager
from ..pretrained import load_pretrained
from ..prompting import check_template_kwargs
from ..quiet_imports import import_model_classes
from ..settling import SETTLE_DELAY_S
from ..tiny import FAMILIES, tiny_model, tiny_tokenizer, words_only
from ..units import parse_bytes
from .chat_template import chat_template, template_kwargs
from .preflight import preflight
from .startup import model_id, startup_line

logger = logging.getLogger("kvchat.serve")

_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, less "(default: None)" and
    "(default: False)" on options whose default is to be absent."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        absent = (
            default is None or default is False or default == [] or default is argparse.SUPPRESS
        )
        return text if absent or "default" in text else f"{text} (default: %(default)s)"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model",
        help="a local checkpoint directory, a .gguf file transformers can load (dequantized "
        "to float32 unless --dtype says otherwise), or an embedded tiny model with random "
        f"weights that writes whole words: tiny, tiny:FAMILY (FAMILY one of {', '.join(FAMILIES)})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument(
        "--dtype",
        choices=tuple(_DTYPES),
        default="auto",
        help="the weights' dtype (auto: the checkpoint's; float32 for a .gguf or tiny)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--served-model-name",
        help="the model id clients send (default: a .gguf file's name without .gguf, a "
        "folder's name, or tiny[:FAMILY])",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        type=chat_template,
        help="render with this Jinja chat template instead of the model's own: a file, the "
        "template's text, or one kvchat ships by name (chatml-tools: ChatML with Hermes-style "
        "tool calls); tool calls are read in the markup it writes (default: the model's)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        type=template_kwargs,
        help="template variables every request gets, a JSON object such as "
        "'{\"enable_thinking\": false}'; a request's own chat_template_kwargs win (default: none)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this bearer key (repeatable; also KVCHAT_API_KEYS, comma-separated); "
        "each key sees only its own sessions",
    )
    limits = parser.add_argument_group("sessions (see SessionManager)")
    limits.add_argument(
        "--max-sessions", type=int, default=16, help="sessions holding a cache at once (LRU)"
    )
    limits.add_argument("--max-cache-bytes", help="e.g. 4GiB (default: no byte limit)")
    limits.add_argument(
        "--max-context-length",
        type=int,
        help="prompt plus reply, in tokens (default: the model's max_position_embeddings)",
    )
    limits.add_argument(
        "--max-checkpoints",
        type=int,
        default=8,
        help="checkpoints a hybrid or sliding-window session keeps",
    )
    limits.add_argument(
        "--checkpoints",
        choices=["last", "every"],
        default="last",
        help="where hybrid models' turns take checkpoints (see docs/hybrid-models.md, Checkpoints)",
    )
    limits.add_argument("--spill-dir", help="write evicted caches here, read them back later")
    limits.add_argument(
        "--no-share-prefixes",
        action="store_true",
        help="do not hold a prefix sessions share (a system prompt) once",
    )
    limits.add_argument(
        "--no-settle",
        action="store_true",
        help="do not settle sessions between turns (see docs/settling.md)",
    )
    limits.add_argument(
        "--settle-delay",
        type=_seconds,
        default=SETTLE_DELAY_S,
        metavar="SECONDS",
        help="seconds without any turn before a session settles: a next turn sent "
        "sooner prefills those ids itself instead of waiting for the settle",
    )
    limits.add_argument(
        "--max-batch-size",
        type=int,
        default=16,
        help="conversations that decode in one batched step; more wait for a row",
    )
    limits.add_argument(
        "--max-step-tokens",
        type=int,
        default=256,
        help="prompt tokens prefilled between two decode steps while others decode "
        "(several short prompts in one forward, or a chunk of a long one)",
    )
    limits.add_argument(
        "--pack-weights",
        choices=["auto", "all", "off"],
        default="auto",
        help="on a CPU, run linear layers through oneDNN on a packed copy of their weights: "
        "float32 ones of 2**18 elements or more (auto), every float32 and bfloat16 one (all), "
        "or none (off)",
    )
    limits.add_argument(
        "--compile",
        action="store_true",
        help="decode compiled: the engine's decode batch compiles its step, and every turn "
        "decodes in it (see docs/compiled-decode.md)",
    )
    limits.add_argument(
        "--warm-up",
        type=_lengths,
        metavar="LENGTHS",
        help="with --compile: compile the batch's decode step before serving, for every row "
        "count in the capacity buckets of these lengths (prompt + max_tokens, "
        "comma-separated: 2048,4096)",
    )
    store = parser.add_argument_group("shared store (several replicas, see RedisTier)")
    store.add_argument(
        "--store",
        metavar="URL",
        help="redis://host:port/db: session snapshots every replica with this flag reads",
    )
    store.add_argument(
        "--store-write",
        choices=("turn", "evict"),
        default="turn",
        help="write a session's snapshot after every turn, or only on eviction",
    )
    store.add_argument(
        "--store-ttl", type=float, default=24 * 3600.0, help="seconds a snapshot lives"
    )
    store.add_argument(
        "--store-timeout", type=float, default=0.5, help="seconds one Redis call may take"
    )
    store.add_argument(
        "--store-wait",
        type=float,
        default=5.0,
        help="seconds a reply's end waits for its snapshot to be stored, so the next turn "
        "finds it on any replica (0: do not wait)",
    )
    kept = parser.add_argument_group(
        "stored responses (/v1/responses, previous_response_id), per API key, for --session-ttl"
    )
    kept.add_argument(
        "--responses-per-key",
        type=int,
        default=1000,
        help="responses each API key keeps stored; its oldest go first (default: 1000)",
    )
    kept.add_argument(
        "--response-bytes-per-key",
        default="64MiB",
        help="bytes of stored responses each API key keeps; its oldest go first, and one "
        "larger alone is not stored (its body says store: false) (default: 64MiB)",
    )
    server = parser.add_argument_group("requests")
    server.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help="a reply's tokens when a request sets no max_tokens",
    )
    server.add_argument(
        "--max-pending", type=int, default=64, help="requests at once; more get 429"
    )
    server.add_argument(
        "--session-ttl",
        type=float,
        default=24 * 3600.0,
        help="seconds a session may sit unused before it is removed (0: never)",
    )
    server.add_argument("--max-body-bytes", default="8MiB", help="larger bodies get 413")
    server.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=("debug", "info", "warning", "error"),
        help="kvchat's logger and uvicorn's",
    )
    return parser


def load_model(spec: str, dtype: torch.dtype | None, device: str):
    """(model, tokenizer) for a checkpoint directory, a GGUF file or ``tiny[:family]``."""
    import_model_classes()  # without the warnings of the optional packages it imports
    if spec == "tiny" or spec.startswith("tiny:"):
        family = spec.partition(":")[2] or "llama"
        if family not in FAMILIES:
            raise SystemExit(f"kvchat serve: unknown tiny family {family!r}; one of {FAMILIES}")
        tokenizer = tiny_tokenizer()
        model = tiny_model(family, dtype=dtype or torch.float32, seed=0)
        # Random weights: write whole words, so replies re-tokenize to the ids
        # generated, as a trained model's do (and the cache is reused as it would be).
        model.generation_config.suppress_tokens = words_only(tokenizer, model.config.vocab_size)
        return model.to(device), tokenizer
    return load_pretrained(Path(spec), dtype, device)  # preflight checked the path


def _lengths(text: str) -> list[int]:
    """--warm-up's value: positive ints, comma-separated."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"positive ints, comma-separated, got {text!r}")
    return lengths


def _seconds(text: str) -> float:
    """--settle-delay's value: a finite number of seconds, at least 0 (the
    manager's own check, said in argparse's words)."""
    try:
        return check_seconds(float(text), "--settle-delay", allow_none=False)
    except ValueError:  # not a number, or not a finite one >= 0
        raise argparse.ArgumentTypeError(f"a number of seconds >= 0, got {text!r}") from None


def build_app(args: argparse.Namespace):
    from . import ServeConfig, create_app

    if args.responses_per_key < 1:
        raise ValueError(f"--responses-per-key must be at least 1, got {args.responses_per_key}")
    response_bytes = parse_bytes(args.response_bytes_per_key, "--response-bytes-per-key")
    model, tokenizer = load_model(args.model, _DTYPES[args.dtype], args.device)
    if args.chat_template is not None:
        # Before the manager: everything that reads the template (the tool-call
        # format, the end tokens, the probes of how it renders) reads this one.
        tokenizer.chat_template = args.chat_template
    if args.chat_template_kwargs:
        try:  # the model's own special tokens, which a template takes from the tokenizer
            check_template_kwargs(args.chat_template_kwargs, tokenizer)
        except ValueError as error:
            raise ValueError(f"--chat-template-kwargs: {error}") from None
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get("KVCHAT_API_KEYS", "").split(",") if k.strip()]
    tier = None
    if args.store is not None:
        from ..tiers.redis import RedisTier

        tier = RedisTier(
            args.store, write=args.store_write, ttl=args.store_ttl, timeout=args.store_timeout
        )
    manager = SessionManager(
        model,
        tokenizer,
        tier=tier,
        max_sessions=args.max_sessions,
        max_cache_bytes=args.max_cache_bytes,
        max_context_length=args.max_context_length,
        max_checkpoints=args.max_checkpoints,
        checkpoints=args.checkpoints,
        spill_dir=args.spill_dir,
        share_prefixes=not args.no_share_prefixes,
        settle=not args.no_settle,
        settle_delay=args.settle_delay,
        compile=args.compile,
        max_batch_size=args.max_batch_size,
        max_step_tokens=args.max_step_tokens,
        pack_weights={"auto": "auto", "all": True, "off": False}[args.pack_weights],
        isolate_namespaces=True,  # one API key never starts from another's cache
    )
    if args.warm_up:
        try:
            capacities = manager.warm_up(args.warm_up)
        except ValueError as error:
            raise ValueError(f"--warm-up: {error}") from None
        stats = manager.stats()
        logger.info(
            "compiled the decode for capacities %s in %.1f s (%d graphs)",
            capacities,
            stats.compile_ms / 1e3,
            stats.compiles,
        )
    config = ServeConfig(
        model_name=args.served_model_name or model_id(args.model),
        # The path as given was the id before: clients that send it still reach the model.
        model_aliases=() if args.served_model_name else (args.model,),
        api_keys=tuple(keys),
        max_body_bytes=parse_bytes(args.max_body_bytes, "max_body_bytes"),
        max_pending=args.max_pending,
        default_max_tokens=args.default_max_tokens,
        session_ttl=args.session_ttl,
        store_wait=args.store_wait if args.store is not None else 0.0,
        responses_per_key=args.responses_per_key,
        response_bytes_per_key=response_bytes,
        chat_template_kwargs=args.chat_template_kwargs or {},
    )
    app = create_app(manager, config)
    logger.info("%s", startup_line(args, manager, config))
    return app


def start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What comes before the model loads: the checks that need no model (a bad
    flag exits here, naming it)."""
    try:
        preflight(args)
    except ValueError as error:
        parser.error(str(error))
    logger.info("loading MODEL %r on %s", args.model, args.device)


def main(argv: list[str] | None = None) -> None:
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="kvchat serve",
            description="An OpenAI-compatible server over kvchat.",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    start(parser, args)
    import uvicorn

    try:
        # Built on a thread that then exits: the main thread (uvicorn's event loop)
        # then never starts an OpenMP team, whose idle workers would make each
        # turn's threads wait to be woken on every op (2x per token on small CPU models).
        with ThreadPoolExecutor(1) as builder:
            app = builder.submit(build_app, args).result()
    except (TypeError, ValueError, ImportError) as error:  # a bad flag: say which, no traceback
        parser.error(str(error))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
