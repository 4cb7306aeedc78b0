"""How every benchmark script writes results: only when asked.

``--write`` writes the committed file under ``benchmarks/results/``; ``--out PATH`` writes
elsewhere; neither prints the results and writes nothing, so a trial run (or ``--help``)
never overwrites a committed measurement. Imports nothing heavy: scripts import it from
their own folder (``from results_io import ...``) before parsing arguments.
"""

from __future__ import annotations

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def add_output_args(parser: argparse.ArgumentParser, committed: str) -> None:
    """``--write`` (to ``benchmarks/results/<committed>``) and ``--out PATH``, exclusive.
    ``committed`` may name other arguments, e.g. ``"bridge_overhead_{device}.json"``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write", action="store_true", help=f"write the results to benchmarks/results/{committed} (the committed file)"
    )
    group.add_argument("--out", type=pathlib.Path, default=None, metavar="PATH", help="write the results to PATH")
    parser.set_defaults(committed=committed)


def output_path(args: argparse.Namespace) -> pathlib.Path | None:
    """Where the parsed ``args`` ask results to go; None: nowhere."""
    if args.out is not None:
        return args.out
    return RESULTS / args.committed.format(**vars(args)) if args.write else None


def write_json(path: pathlib.Path | None, result) -> None:
    """Writes ``result`` as indented JSON to ``path`` (folders made); says where, or that
    nothing was written."""
    if path is None:
        print("(results not written: pass --write for the committed file or --out PATH)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
