"""The environment of the Python subprocesses tests start."""

from __future__ import annotations

import os

CPU_COMPILE_FLAG = "--xla_backend_optimization_level=0"
"""What conftest adds to ``XLA_FLAGS`` on a machine without a GPU (LLVM at -O0: the tests'
programs compile in about two thirds of the time and run a few times on tiny shapes)."""


def subprocess_env() -> dict[str, str]:
    """``os.environ`` with ``XLA_FLAGS`` reduced to conftest's compile flag (when it set one):
    a worker sets its own device count, and a caller's flags must not reach it."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if CPU_COMPILE_FLAG in os.environ.get("XLA_FLAGS", "").split():
        env["XLA_FLAGS"] = CPU_COMPILE_FLAG
    return env
