"""What the torch-side benchmarks (bridge_overhead, torch_transformers) record about their
run, and how they write it: one place, so their JSON files carry the same fields."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

import jax
import torch
from results_io import write_json  # benchmarks/, the script's folder

import bridge


def run_environment(**versions: str) -> dict:
    """Date, versions (python, jax, torch and ``versions``), machine, JAX's GPU memory policy, XLA_FLAGS."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__, "torch": torch.__version__, **versions},
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
        "jax_gpu_memory_policy": bridge.JAX_MEMORY_POLICY,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def write_result(path: pathlib.Path | None, result: dict) -> None:
    """Prints ``result`` and writes it to ``path`` (``results_io.output_path(args)``; None: nowhere)."""
    print(json.dumps(result, indent=2))
    write_json(path, result)
