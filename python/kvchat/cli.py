"""The ``kvchat`` command: ``kvchat serve MODEL [options]``."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = "kvchat: multi-turn KV-cache reuse for HuggingFace transformers."


def parser() -> argparse.ArgumentParser:
    """The command's help: its commands, each with its own ``--help``."""
    top = argparse.ArgumentParser(
        prog="kvchat",
        description=DESCRIPTION,
        epilog="kvchat COMMAND --help shows a command's options.",
    )
    commands = top.add_subparsers(title="commands", metavar="COMMAND")
    commands.add_parser(
        "serve",
        add_help=False,  # kvchat serve --help is serve's own
        help="an OpenAI-compatible server that keeps every conversation's cache: "
        "kvchat serve MODEL [options]",
    )
    return top


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from .serve.cli import main as serve

        serve(argv[1:])
        return
    if not argv:  # what a newcomer types first: the help, and a usage error's status
        parser().print_help(sys.stderr)
        sys.exit(2)
    parser().parse_args(argv)  # --help, or an unknown command named as such


if __name__ == "__main__":
    main()
