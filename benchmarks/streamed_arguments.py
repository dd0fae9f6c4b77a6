"""The cost of deciding which part of a streamed call's JSON arguments may go out.

``ArgumentsScan.sure()`` runs once per piece of a call's arguments, on the
server's event loop. It used to read the arguments so far back as JSON every
time, so a long string argument (a file's text, say) cost the square of its
length. Text that only lengthens a string value already sure is now sure
unread. This times both, side by side in one run: a call whose one string
argument is ``--chars`` long, fed ``--step`` characters a piece, as a decode
writes it.

    python benchmarks/streamed_arguments.py --chars 1000 10000 50000 --step 3

Writes ``benchmarks/results/streamed-arguments.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvchat.agents.json_arguments import ArgumentsScan

LINE = "def f(x):  return x * 2  # é 日本 "


class _EveryPieceRead(ArgumentsScan):
    """The scan as it was: every piece read back as JSON."""

    def _lengthens_a_sure_string(self) -> bool:
        return False


def _feed(scan_type, text: str, step: int) -> float:
    scan = scan_type(lambda key, kind: False)  # a string parameter: nothing is cast
    started = time.perf_counter()
    for end in range(step, len(text) + step, step):
        scan.feed(text[end - step : end])
        scan.sure()
    elapsed = time.perf_counter() - started
    assert scan.sure() == text
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    print(f"{'chars':>7} {'pieces':>7} {'every piece read':>17} {'now':>9} {'ratio':>7}")
    for chars in args.chars:
        text = '{"code": "' + (LINE * (chars // len(LINE) + 1))[:chars]
        old = statistics.median(
            _feed(_EveryPieceRead, text, args.step) for _ in range(args.repeats)
        )
        new = statistics.median(_feed(ArgumentsScan, text, args.step) for _ in range(args.repeats))
        pieces = -(-len(text) // args.step)
        rows.append(dict(chars=chars, pieces=pieces, every_piece_read_s=old, now_s=new))
        print(f"{chars:>7} {pieces:>7} {old:>16.4f}s {new:>8.4f}s {old / new:>6.1f}x")
    out = Path(__file__).parent / "results" / "streamed-arguments.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(step=args.step, repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()
