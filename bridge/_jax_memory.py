"""JAX's GPU memory policy, set before JAX initialises so PyTorch keeps room on the GPU.

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
