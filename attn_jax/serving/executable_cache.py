"""Compiled step programs kept on disk, so a restarted server loads them without tracing.

JAX's persistent compilation cache skips XLA's compilation, but finding an entry still
traces and lowers the step (30 unrolled layers: about a second a program, under the GIL),
so a warm ``attn-stack serve`` start spent most of a minute tracing. This cache is keyed
before tracing: a folder per *fingerprint* (everything a step program depends on besides
its compile key: jax and jaxlib versions, the devices, ``XLA_FLAGS``, the jax options that
change a trace, a hash of every attn_jax source file, the model's class and configuration,
the attention backend, and the shape, dtype and sharding of every input the step takes),
and a file per compile key (``PreparedCall.key``) holding ``serialize_executable``'s
payload, and the warm-up's list of calls per set of engine limits (``store_list``: a warm
start prepares one dummy call per program instead of enumerating thousands of batches). A
loaded program is checked against the call's inputs (tree and avals) before it
is used; anything that does not match, or fails to load, is compiled as before.

Used by ``Engine.warmup(executable_cache=...)`` (``attn-stack serve`` points it at
``<cache root>/executables`` unless ``--no-compilation-cache``). One process only: a
multi-process mesh compiles as before. The folder only grows (a new attn_jax or jax version
starts a new fingerprint folder); deleting it is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import pickle
import tempfile

import jax
import jaxlib

from attn_jax.cache_dir import source_hash

logger = logging.getLogger(__name__)

__all__ = ["ExecutableCache"]

_TRACE_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion")
"""jax options whose values change what a trace produces."""


def _avals(tree) -> str:
    """Each leaf's shape, dtype and sharding, with the tree's structure."""
    leaves, treedef = jax.tree.flatten(tree)
    described = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]
    return repr((treedef, described))


def _shapes(tree) -> list[tuple]:
    """Each leaf's shape and dtype, in order."""
    return [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)]


class ExecutableCache:
    """A folder of serialized step programs for one runner (see the module docstring).

    Args:
      folder: the cache's root; a subfolder per fingerprint is made on the first store.
      runner: the ``ModelRunner`` whose programs it holds (its model, inputs and devices
        make the fingerprint).
    """

    def __init__(self, folder: str | os.PathLike, runner) -> None:
        model = runner.model
        devices = jax.devices()
        parts = [
            jax.__version__, jaxlib.__version__, jax.default_backend(), len(devices),
            sorted({d.device_kind for d in devices}), os.environ.get("XLA_FLAGS", ""),
            [(name, str(getattr(jax.config, name, None))) for name in _TRACE_OPTIONS], source_hash(),
            type(model).__module__, type(model).__qualname__, repr(model.config),
            model.attn_backend.get_name(), runner.block_size, runner.max_rows,
            _avals((runner.step_params, runner.kv_caches)),
        ]  # fmt: skip
        self.fingerprint = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
        self.folder = pathlib.Path(folder) / self.fingerprint
        self.num_loaded = 0
        self.num_stored = 0

    def _path(self, key: tuple) -> pathlib.Path:
        layout, num_steps, sampled = key
        text = repr((layout.treedef, layout.leaves, num_steps, sampled))
        return self.folder / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.pkl"

    def load(self, key: tuple, args: tuple):
        """The compiled program stored for ``key`` if it takes ``args`` (the step's dynamic
        arguments), else None."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            from jax.experimental.serialize_executable import deserialize_and_load

            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as e:  # a damaged or foreign file: compile instead
            logger.warning("executable cache: %s could not be loaded (%s: %s); compiling", path, type(e).__name__, e)
            return None
        if _shapes(compiled.in_avals) != _shapes(args):
            logger.warning("executable cache: %s takes other inputs than this call; compiling", path)
            return None
        self.num_loaded += 1
        return compiled

    def load_list(self, name: str) -> list | None:
        """The JSON list ``store_list`` wrote under ``name`` (the warm-up's calls), else None."""
        try:
            return json.loads((self.folder / f"{name}.json").read_text())
        except FileNotFoundError:
            return None
        except Exception as e:  # damaged: the caller enumerates again
            logger.warning("executable cache: the list %s could not be read (%s: %s)", name, type(e).__name__, e)
            return None

    def store_list(self, name: str, value: list) -> None:
        """Writes ``value`` (JSON) under ``name``, as ``_write`` does."""
        self._write(self.folder / f"{name}.json", lambda: json.dumps(value).encode())

    def store(self, key: tuple, compiled) -> None:
        """Writes ``compiled`` for ``key`` (atomically: a reader never sees half a file); a
        failure to write is logged, never raised."""
        from jax.experimental.serialize_executable import serialize

        if self._write(self._path(key), lambda: pickle.dumps(serialize(compiled))):
            self.num_stored += 1

    @staticmethod
    def _write(path: pathlib.Path, blob) -> bool:
        """Writes the bytes ``blob()`` returns to ``path`` atomically (a reader never sees half
        a file); a failure, serialising included, is logged and returns False, never raises."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = blob()
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
                f.write(data)
            os.replace(f.name, path)
            return True
        except Exception as e:
            logger.warning("executable cache: could not write %s (%s: %s)", path, type(e).__name__, e)
            return False
