"""Llama-family weights, configuration and tokenizer from a GGUF file.

Weights are read and dequantised (Q4_1, Q8_0, F16, ...) by the ``gguf`` package; the
tokenizer is built from the same file's metadata (``gguf_tokenizer``, no torch). Query
and key projections are un-permuted exactly as transformers does on load (llama.cpp's
converter interleaves each head's rotary halves), so the model uses Hugging Face's
rotate-half RoPE and gives the same numbers as ``AutoModelForCausalLM.from_pretrained(
folder, gguf_file=name)``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
from collections.abc import Callable

import numpy as np

from attn_jax.cache_dir import cache_root, source_hash
from attn_jax.models.llama import LlamaConfig, assemble_params

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)


class ModelLoadError(ValueError):
    """A model file that cannot be used: missing, not GGUF, truncated, or unsupported.

    A user error: the CLI prints its message, without a traceback.
    """


def check_finite_tensor(name: str, w: np.ndarray, where: str) -> None:
    """Raises ``ModelLoadError`` naming tensor ``name`` of ``where`` (a file or folder) when
    ``w`` holds a NaN or an infinity: such a model runs, and answers with empty or garbage
    tokens. One pass over the tensor; loaders take ``check_finite=False`` to skip it."""
    finite = np.isfinite(w)
    if not finite.all():
        nans = int(np.isnan(w).sum())
        infs = finite.size - int(finite.sum()) - nans
        raise ModelLoadError(
            f"tensor {name!r} of {where!r} holds non-finite values ({nans} NaN, {infs} infinite of {finite.size}): "
            "the checkpoint is damaged (check_finite=False skips this check)"
        )


def _reader(path: pathlib.Path):
    if not path.exists():
        raise ModelLoadError(f"model file {str(path)!r} does not exist (expected a .gguf file)")
    if not path.is_file():
        raise ModelLoadError(f"model path {str(path)!r} is not a file (expected a .gguf file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    stat = path.stat()
    try:
        return _open_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # the reader raises ValueError/IndexError/... on truncated files
        raise ModelLoadError(f"{str(path)!r} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=1)
def _open_reader(path: pathlib.Path, size: int, mtime_ns: int):
    """One parse of the file (seconds for the embedded model) for its weights and its
    tokenizer; a changed file (size, mtime) is parsed again."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key: str, default=None, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _count(reader, key: str, default: int | None = None) -> int:
    """A metadata value that must be a positive integer (a head count, a size)."""
    value = _field(reader, key, default=default)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ModelLoadError(f"GGUF metadata {key}={value!r} must be a positive integer")
    return int(value)


def read_config(reader) -> LlamaConfig:
    """The ``LlamaConfig`` from a GGUF reader's metadata (architecture "llama" only)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    num_heads = _count(reader, f"{arch}.attention.head_count")
    hidden = _count(reader, f"{arch}.embedding_length")
    scaling = _field(reader, f"{arch}.rope.scaling.type", default="none", required=False)
    factor = _field(reader, f"{arch}.rope.scaling.factor", default=1.0, required=False)
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"rope scaling type {scaling!r} is not supported; supported: ['none', 'linear']")
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id", default=-1, required=False)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _count(reader, f"{arch}.vocab_size", default=len(tokens.data) if tokens else None)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_count(reader, f"{arch}.feed_forward_length"),
        num_layers=_count(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_count(reader, f"{arch}.attention.head_count_kv", default=num_heads),
        head_dim=_count(reader, f"{arch}.rope.dimension_count", default=hidden // num_heads),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", default=10000.0)),
        rope_scaling_factor=float(factor) if scaling == "linear" else 1.0,
        rope_type="linear" if scaling == "linear" else "default",
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=_count(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", default=-1, required=False)),
        eos_token_ids=(int(eos),) if eos >= 0 else (),
        name=str(_field(reader, "general.name", default="llama", required=False)),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' ``_reverse_permute_weights``: [out, in] rows back to rotate-half order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_TENSOR_NAMES = {  # params key -> GGUF tensor name ("{i}": the layer)
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
}


def load_gguf(
    path: str | os.PathLike,
    dtype=np.float32,
    progress: Callable[[int, int], None] | None = None,
    check_finite: bool = True,
) -> tuple[LlamaConfig, dict]:
    """Reads and dequantises a Llama GGUF.

    Args:
      path: the .gguf file.
      dtype: NumPy dtype of the returned weights (float32 default).
      progress: called as ``progress(done, total)`` after each tensor.
      check_finite: raise ``ModelLoadError`` naming the first tensor with a NaN or an
        infinity (one more pass over each tensor; False skips it).

    Returns ``(config, params)``; params (NumPy, ``dtype``) in ``llama.fuse_params``'
    layout (``llama.assemble_params`` builds it: q/k/v and gate/up fused, every matrix
    [out, in]). Raises ``ModelLoadError`` for a missing, corrupt or unsupported file.
    """
    from gguf import dequantize

    path = pathlib.Path(path)
    cached = _weights_cache_file(path, dtype)
    if cached is not None and cached.is_file():
        try:
            with open(cached, "rb") as f:
                config, params, (reads, total) = pickle.load(f)
        except Exception as e:  # damaged: read the file again (and rewrite it)
            logger.warning("dequantised weights cache %s unreadable (%s); reading %s again", cached, e, path)
        else:
            for done in range(1, reads + 1) if progress is not None else ():  # as the reads told it
                progress(done, total)
            return config, params
    reader = _reader(path)
    config = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    total = len(tensors)
    done = 0

    def get(key: str, layer: int | None, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal done
        name = _TENSOR_NAMES[key].format(i=layer)
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{str(path)!r} has no tensor {name!r}; is it a Llama checkpoint?")
        try:
            w = dequantize(np.asarray(t.data), t.tensor_type)  # a plain view: no memmap object per row group
        except Exception as e:
            raise ModelLoadError(
                f"cannot dequantise tensor {name!r} ({t.tensor_type.name}) of {str(path)!r}: {e}"
            ) from e
        if w.shape != shape:
            raise ModelLoadError(f"{name} has shape {w.shape}; expected {shape}: the file is inconsistent")
        if check_finite:
            check_finite_tensor(name, w, str(path))
        done += 1
        if progress is not None:
            progress(done, total)
        if key == "wq":
            return _unpermute(w, config.num_heads)
        if key == "wk":
            return _unpermute(w, config.num_kv_heads)
        return w

    params = assemble_params(config, get, dtype)
    if cached is not None and check_finite:
        _write_atomically(cached, pickle.dumps((config, params, (done, total)), protocol=pickle.HIGHEST_PROTOCOL))
    return config, params


WEIGHTS_CACHE_ENV = "ATTN_STACK_GGUF_WEIGHTS_CACHE"
"""A folder for dequantised GGUF weights (off when unset): ``load_gguf`` writes each file's
weights there once per dtype and later processes read them back instead of parsing and
dequantising the file again (seconds each for the embedded model). Meant for test suites and
repeated short runs; the weights take their full dtype's size on disk."""


def _weights_cache_file(path: pathlib.Path, dtype) -> pathlib.Path | None:
    """Where ``WEIGHTS_CACHE_ENV``'s folder keeps ``path``'s weights in ``dtype`` (named by the
    file's path, size and mtime, the dtype and attn_jax's sources), or None when unset."""
    folder = os.environ.get(WEIGHTS_CACHE_ENV)
    if not folder or not path.is_file():
        return None
    stat = path.resolve().stat()
    key = repr((str(path.resolve()), stat.st_size, stat.st_mtime_ns, np.dtype(dtype).name, source_hash()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return pathlib.Path(folder) / f"{digest}.pkl"


def _write_atomically(target: pathlib.Path, blob: bytes) -> None:
    """``blob`` into ``target`` through a temporary file and a rename; a failure is logged."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
            f.write(blob)
        os.replace(f.name, target)
    except OSError as e:
        logger.warning("could not write the dequantised weights cache %s: %s", target, e)


def tokenizer_cache_dir(path: pathlib.Path) -> pathlib.Path:
    """Where the tokenizer built from ``path`` is saved: ``cache_dir.cache_root()``, then
    ``tokenizers/<file name>-<size>-<mtime>``."""
    stat = path.stat()
    return cache_root() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _transformers_tokenizer(path: pathlib.Path, reason: Exception):
    """transformers' GGUF conversion, for the vocabularies ``GGUFTokenizer`` does not build
    (it needs torch: the ``torch`` extra)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise ModelLoadError(
            f"cannot build a tokenizer from {str(path)!r}: {reason}. Other vocabularies go through "
            "transformers' GGUF conversion, which needs torch and transformers: pip install 'attn-stack[torch]'"
        ) from reason
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: pathlib.Path, cache_dir: pathlib.Path):
    from attn_jax.models.gguf_tokenizer import GGUFTokenizer, TokenizerBuildError

    try:
        return GGUFTokenizer.load(cache_dir)
    except FileNotFoundError:
        pass  # not built yet
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged cache: rebuild it
        logger.warning("tokenizer cache %s is unreadable (%s); rebuilding it from the GGUF", cache_dir, e)
    try:
        tokenizer = GGUFTokenizer.from_gguf(_reader(path))
    except TokenizerBuildError as e:
        return _transformers_tokenizer(path, e)
    try:
        tokenizer.save(cache_dir)
    except OSError as e:  # the cache is an optimisation: an unwritable folder only costs a rebuild next time
        logger.info("cannot cache the tokenizer in %s: %s", cache_dir, e)
    return tokenizer


def load_tokenizer(path: str | os.PathLike):
    """The GGUF's tokenizer: a ``GGUFTokenizer`` (``attn_jax.models.gguf_tokenizer``) built
    from the file's metadata with ``gguf`` and ``tokenizers``, no torch or transformers.

    Vocabularies other than byte-level BPE go through transformers' GGUF conversion
    (the ``torch`` extra). The built tokenizer is saved under ``tokenizer_cache_dir(path)``
    and read from there next time; a cache folder that is missing, unwritable or damaged
    only means building it again. Within a process it is loaded once. Raises
    ``ModelLoadError`` for a missing or corrupt file.
    """
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        _reader(path)  # raises the missing-file error
    return _load_tokenizer_cached(path, tokenizer_cache_dir(path))
