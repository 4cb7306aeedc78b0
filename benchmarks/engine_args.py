"""The engine flags the serving benchmarks share (generate_gpu, engine_step_profile,
scale_out), declared and parsed once: scale_out runs the other two's functions on its own
arguments, so the three must agree. Imports nothing heavy until parsing."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser, *, prompt_len: int, kv_cache_gib: int) -> None:
    """``--prompt-len``, ``--block-size``, ``--dtype``, ``--backend``, ``--kv-cache-gib``,
    ``--num-scheduler-steps`` and ``--no-prefix-caching``."""
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default=None, help="force a backend (XLA, PALLAS_GPU); default: selected")
    parser.add_argument("--kv-cache-gib", type=int, default=kv_cache_gib)
    parser.add_argument(
        "--num-scheduler-steps", type=int, nargs="+", default=[1],
        help="decode steps per engine call (multi-step decoding); several values: a run for each",
    )  # fmt: skip
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix caching off")


def parse_engine_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments with ``dtype`` a jnp dtype and ``attn_backend`` the forced
    backend's class (None: selected)."""
    import jax.numpy as jnp

    from attn_jax.registry import AttentionBackendEnum

    args = parser.parse_args()
    args.dtype = jnp.dtype(args.dtype)
    args.attn_backend = None if args.backend is None else AttentionBackendEnum[args.backend.upper()].get_class()
    return args
