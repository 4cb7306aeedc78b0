"""JAX's GPU memory and CPU thread policies, set before JAX initialises, so PyTorch and
JAX share a machine without starving each other.

By default JAX preallocates 75 % of every GPU it initialises, which leaves PyTorch, in
the same process, almost nothing. ``configure_jax_memory`` sets
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX then allocates on demand) unless the user
has chosen a policy with any of ``USER_MEMORY_VARS``. It must run before JAX creates its
GPU client; ``import bridge`` (and so ``import attn_torch``) calls it first thing. The
variable only matters on a GPU; on a CPU-only machine it changes nothing.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
USER_MEMORY_VARS = (PREALLOCATE_ENV, "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
"""If the user set any of these, their policy stands and nothing is changed."""


def _jax_backends_initialised() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def configure_jax_memory() -> str:
    """Sets JAX's on-demand GPU allocation unless the user chose a policy.

    Returns what happened: "user" (a ``USER_MEMORY_VARS`` variable was set; untouched),
    "set" (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` now), or "too-late" (JAX's backends
    were already initialised, so a variable set now would have no effect; a warning is
    logged and nothing is changed).
    """
    if any(name in os.environ for name in USER_MEMORY_VARS):
        return "user"
    if _jax_backends_initialised():
        logger.warning(
            "attn-stack: JAX was initialised before the bridge was imported, so %s=false could not be set: "
            "on a GPU, JAX may have preallocated 75%% of its memory and left PyTorch little. Import "
            "attn_torch (or bridge) before using JAX, or set %s=false yourself.",
            PREALLOCATE_ENV,
            PREALLOCATE_ENV,
        )
        return "too-late"
    os.environ[PREALLOCATE_ENV] = "false"
    return "set"


CPU_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")
"""Appended to ``XLA_FLAGS`` by ``configure_jax_cpu_threads``."""


def configure_jax_cpu_threads() -> str:
    """Runs JAX's CPU computations on the calling thread, leaving the cores to torch.

    XLA's CPU client keeps its own thread pool whose workers spin after each computation;
    in a process where torch computes between JAX calls (a model whose attention runs in
    JAX) they starve torch's threads. Measured on this project's 2-core machine:
    SmolLM2 ``generate`` of 4 x 32 tokens through attn_stack took 60 s with XLA's default
    pool and 8 s with these flags (stock transformers: 5 s). Appends ``CPU_THREAD_FLAGS``
    to ``XLA_FLAGS`` unless the user's ``XLA_FLAGS`` already mention either setting.
    Returns "user", "set" or "too-late" like ``configure_jax_memory``. The flags affect
    only JAX's CPU client, not its GPU or TPU ones.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" in flags or "intra_op_parallelism_threads" in flags:
        return "user"
    if _jax_backends_initialised():
        logger.warning(
            "attn-stack: JAX was initialised before the bridge was imported, so its CPU thread pool keeps "
            "spinning between calls and may slow torch down; set XLA_FLAGS='%s' before importing JAX",
            " ".join(CPU_THREAD_FLAGS),
        )
        return "too-late"
    os.environ["XLA_FLAGS"] = " ".join([flags, *CPU_THREAD_FLAGS]).strip()
    return "set"
