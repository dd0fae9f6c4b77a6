"""The ``kvchat`` command: ``kvchat serve MODEL [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        sys.exit("usage: kvchat serve MODEL [options]   (kvchat serve --help for the options)")
    from .serve.cli import main as serve

    serve(argv[1:])


if __name__ == "__main__":
    main()
