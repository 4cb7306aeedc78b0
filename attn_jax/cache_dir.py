"""attn-stack's on-disk cache: built tokenizers and JAX's persistent compilation cache.

The root is ``$ATTN_STACK_CACHE_DIR`` or ``~/.cache/attn-stack``.
"""

from __future__ import annotations

import os
import pathlib

CACHE_ENV = "ATTN_STACK_CACHE_DIR"


def cache_root() -> pathlib.Path:
    """``$ATTN_STACK_CACHE_DIR``, else ``~/.cache/attn-stack``."""
    return pathlib.Path(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "attn-stack"))


def enable_compilation_cache() -> str:
    """Points JAX's persistent compilation cache at ``<cache root>/jax-compilation`` unless one is
    already set (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), so a restarted server loads its
    step programs instead of compiling them again; returns the folder in use."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    folder = str(cache_root() / "jax-compilation")
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder
