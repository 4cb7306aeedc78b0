"""Runs every benchmark script given on the command line with ``--help`` in this one process
(``runpy``, as ``python SCRIPT --help`` runs it: ``__main__``, its folder first on
``sys.path``, ``argv[0]`` its path) and prints one JSON line: each script's exit code, standard
output and the end of its standard error.

Started by tests/test_benchmark_scripts.py: one interpreter imports jax and the package once
for all the scripts instead of once each (38 processes: about 40 s of CPU on the 2-core CI
machine).
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import runpy
import sys
import traceback


def answer_help(script: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = [script, "--help"], str(pathlib.Path(script).parent)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = argv, path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]}


def main() -> None:
    results = {script: answer_help(script) for script in sys.argv[1:]}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
