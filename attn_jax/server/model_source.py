"""The engine that ``attn-stack serve --model`` names, and the name it is served under.

``--model`` is a Llama GGUF file (default: the embedded SmolLM2-135M-Instruct), a
Hugging Face checkpoint directory (``attn_jax.models.hf_checkpoint``: Llama, Mistral,
Qwen2/3, Gemma 2/3, DeepSeek-V2/V3 safetensors), or ``tiny-random``: a 2-layer model of random weights over SmolLM2's
tokenizer, for tests (``attn_jax.testing.models.tiny_random_engine``). ``--dtype`` is the
weights' and activations' dtype (``resolve_dtype``: ``auto`` is bfloat16 on an accelerator).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from attn_jax.testing.models import TINY_RANDOM


def resolve_dtype(dtype: str, model: str | None, platform: str) -> tuple[str, str]:
    """``(dtype, why)``: the model dtype ``--dtype`` gives for ``--model`` on a ``platform``
    ("cpu", "gpu", "tpu"). ``auto`` is float32 on a CPU (what the float64 references check)
    and, on an accelerator, a checkpoint folder's stored float16 or bfloat16, else bfloat16 (a
    float32 checkpoint, a GGUF, ``tiny-random``), as vLLM's ``--dtype auto`` serves 16-bit
    models. Any other value is taken as given (ValueError when not one of ``MODEL_DTYPES``)."""
    from attn_jax.models.hf_checkpoint import MODEL_DTYPES, stored_dtype

    if dtype != "auto":
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; supported: {['auto', *MODEL_DTYPES]}")
        return dtype, "--dtype"
    if platform == "cpu":
        return "float32", "--dtype auto on a CPU"
    stored = stored_dtype(model) if model not in (None, TINY_RANDOM) and pathlib.Path(model).is_dir() else None
    if stored in ("bfloat16", "float16"):
        return stored, f"--dtype auto: the checkpoint's {stored}"
    return "bfloat16", f"--dtype auto on a {platform.upper()}"


def default_served_name(model: str | None) -> str:
    """The name clients use in ``"model"``: the GGUF's or directory's name, without suffixes."""
    if model is None:
        from attn_jax.models.smollm2 import GGUF_NAME

        return GGUF_NAME.split(".")[0]
    if model == TINY_RANDOM:
        return TINY_RANDOM
    path = pathlib.Path(model)
    return path.name if path.is_dir() else path.name.split(".")[0]


def build_engine(
    model: str | None,
    *,
    dtype: str = "float32",
    devices: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    **engine_kwargs,
):
    """An ``Engine`` for ``--model`` (None: the embedded SmolLM2) in ``dtype`` (one of
    ``MODEL_DTYPES``; ``resolve_dtype`` picks it for ``--dtype``), sharded over ``devices``
    devices when more than one; ``ModelLoadError`` / FileNotFoundError from the GGUF and
    checkpoint loaders."""
    from attn_jax.serving import Engine

    if model == TINY_RANDOM:
        from attn_jax.testing.models import tiny_random_engine

        return tiny_random_engine(devices=devices, dtype=dtype, **engine_kwargs)
    if model is not None and pathlib.Path(model).is_dir():
        return engine_from_hf_checkpoint(model, dtype=dtype, devices=devices, progress=progress, **engine_kwargs)
    return Engine.from_gguf(model, dtype=dtype, devices=devices, progress=progress, **engine_kwargs)


def engine_from_hf_checkpoint(
    path: str, *, dtype: str = "float32", devices: int | None = None, model_parallel: int | None = None,
    progress=None, **engine_kwargs,
):  # fmt: skip
    """``Engine.from_gguf``'s sibling for a Hugging Face checkpoint folder (weights and
    activations in ``dtype``, whatever the checkpoint stores), sharded over
    ``make_mesh(devices, model_parallel=...)`` when more than one device."""
    from attn_jax.models.hf_checkpoint import load_hf_checkpoint, read_hf_config
    from attn_jax.serving import Engine
    from attn_jax.sharding import make_mesh

    mesh = None
    if devices is not None and devices > 1:
        mesh = make_mesh(devices, model_parallel=model_parallel, num_kv_heads=read_hf_config(path).num_kv_heads)
    model, params, tokenizer = load_hf_checkpoint(path, dtype, mesh=mesh, progress=progress)
    return Engine(model, params, tokenizer, mesh=mesh, **engine_kwargs)
