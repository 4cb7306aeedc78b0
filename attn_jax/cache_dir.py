"""attn-stack's on-disk cache: built tokenizers, JAX's persistent compilation cache and the
serving engine's compiled step programs beside it.

The root is ``$ATTN_STACK_CACHE_DIR`` or ``~/.cache/attn-stack``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

CACHE_ENV = "ATTN_STACK_CACHE_DIR"

PACKAGE_RELATIVE_SOURCES = r".*/(?=attn_jax/)"
"""JAX's ``hlo_source_file_canonicalization_regex`` while the compilation cache is on: attn-stack's
source files named from ``attn_jax/`` on, wherever the package lies."""


def cache_root() -> pathlib.Path:
    """``$ATTN_STACK_CACHE_DIR``, else ``~/.cache/attn-stack``."""
    return pathlib.Path(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "attn-stack"))


def enable_compilation_cache() -> str:
    """Points JAX's persistent compilation cache at ``<cache root>/jax-compilation`` unless one is
    already set (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), so a restarted server loads its
    step programs instead of compiling them again; returns the folder in use.

    Also names attn-stack's source files from ``attn_jax/`` on in the programs' source locations
    (``PACKAGE_RELATIVE_SOURCES``, unless a canonicalisation regex is set already): a Pallas
    kernel's Triton or Mosaic GPU module keeps its locations, which are part of the cache key, so
    without this the same code installed or checked out at another path compiles everything again."""
    import jax

    if not jax.config.jax_hlo_source_file_canonicalization_regex:
        jax.config.update("jax_hlo_source_file_canonicalization_regex", PACKAGE_RELATIVE_SOURCES)
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    folder = str(cache_root() / "jax-compilation")
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def executable_cache_dir(compilation_cache: str) -> str:
    """attn-stack's compiled step programs (``serving/executable_cache.py``) beside JAX's
    compilation cache folder ``compilation_cache``: the same folder name with ``-executables``."""
    return str(pathlib.Path(compilation_cache)) + "-executables"


@functools.cache
def source_hash() -> str:
    """SHA-256 of every ``.py`` and ``.json`` file of the attn_jax package (paths and bytes): the
    caches of things this code computes (compiled step programs, dequantised weights) start
    over whenever it changes."""
    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
