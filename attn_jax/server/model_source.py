"""The engine that ``attn-stack serve --model`` names, and the name it is served under.

``--model`` is a Llama GGUF file (default: the embedded SmolLM2-135M-Instruct), a
Hugging Face checkpoint directory (``attn_jax.models.hf_checkpoint``: Llama, Mistral,
Qwen2/3, Gemma 2/3, DeepSeek-V2/V3 safetensors), or ``tiny-random``: a 2-layer model of random weights over SmolLM2's
tokenizer, for tests (``attn_jax.testing.models.tiny_random_engine``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from attn_jax.testing.models import TINY_RANDOM


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
    devices: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    **engine_kwargs,
):
    """An ``Engine`` for ``--model`` (None: the embedded SmolLM2), sharded over ``devices``
    devices when more than one; ``ModelLoadError`` / FileNotFoundError from the GGUF and
    checkpoint loaders."""
    from attn_jax.serving import Engine

    if model == TINY_RANDOM:
        from attn_jax.testing.models import tiny_random_engine

        return tiny_random_engine(devices=devices, **engine_kwargs)
    if model is not None and pathlib.Path(model).is_dir():
        return engine_from_hf_checkpoint(model, devices=devices, progress=progress, **engine_kwargs)
    return Engine.from_gguf(model, devices=devices, progress=progress, **engine_kwargs)


def engine_from_hf_checkpoint(
    path: str, *, devices: int | None = None, model_parallel: int | None = None, progress=None, **engine_kwargs
):
    """``Engine.from_gguf``'s sibling for a Hugging Face checkpoint folder (float32 weights),
    sharded over ``make_mesh(devices, model_parallel=...)`` when more than one device."""
    from attn_jax.models.hf_checkpoint import load_hf_checkpoint, read_hf_config
    from attn_jax.serving import Engine
    from attn_jax.sharding import make_mesh

    mesh = None
    if devices is not None and devices > 1:
        mesh = make_mesh(devices, model_parallel=model_parallel, num_kv_heads=read_hf_config(path).num_kv_heads)
    model, params, tokenizer = load_hf_checkpoint(path, mesh=mesh, progress=progress)
    return Engine(model, params, tokenizer, mesh=mesh, **engine_kwargs)
