"""What the benchmark wrappers (``layer_layout.py``, ``pin_main_thread.py``) share: another
benchmark script and its arguments on the command line, run in this process once the wrapper
has set it up."""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys


def add_script_args(parser: argparse.ArgumentParser) -> None:
    """The wrapped script and everything after it (its own arguments)."""
    parser.add_argument("script", help="a benchmark script, e.g. benchmarks/generate_gpu.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def checked_script(parser: argparse.ArgumentParser, args: argparse.Namespace) -> pathlib.Path:
    """The wrapped script's path; a usage error when it is not a file."""
    script = pathlib.Path(args.script)
    if not script.is_file():
        parser.error(f"script {args.script!r} is not a file")
    return script


def run_script(script: pathlib.Path, args: list[str]) -> None:
    """Runs ``script`` as ``__main__`` with ``args``, its folder first on the import path (as
    running it directly would put it)."""
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
