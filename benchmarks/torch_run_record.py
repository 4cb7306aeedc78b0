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

import bridge

RESULTS = pathlib.Path(__file__).parent / "results"


def run_environment(**versions: str) -> dict:
    """Date, versions (python, jax, torch and ``versions``), machine, JAX's GPU memory policy, XLA_FLAGS."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__, "torch": torch.__version__, **versions},
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
        "jax_gpu_memory_policy": bridge.JAX_MEMORY_POLICY,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def write_result(name: str, result: dict) -> pathlib.Path:
    """Prints ``result`` and writes it to ``benchmarks/results/<name>.json``."""
    print(json.dumps(result, indent=2))
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out
