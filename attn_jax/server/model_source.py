"""The engine that ``attn-stack serve --model`` names, and the name it is served under.

``--model`` is a Llama GGUF file (default: the embedded SmolLM2-135M-Instruct), a
Hugging Face checkpoint directory (through the engine's checkpoint loader where this
build has one), or ``tiny-random``: a 2-layer model of random weights over SmolLM2's
tokenizer, for tests (``attn_jax.testing.models.tiny_random_engine``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from attn_jax.testing.models import TINY_RANDOM

HF_LOADER_NAMES = ("from_pretrained", "from_hf", "from_hf_checkpoint", "from_safetensors")
"""``Engine`` class methods tried, in order, for a checkpoint directory: ``(path, *, devices,
progress, **engine_kwargs) -> Engine``, as ``Engine.from_gguf`` takes them."""


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
    """An ``Engine`` for ``--model`` (None: the embedded SmolLM2). ValueError for a
    directory this build cannot load, or ``tiny-random`` on several devices;
    ``ModelLoadError`` / FileNotFoundError from the GGUF loader."""
    from attn_jax.serving import Engine

    if model == TINY_RANDOM:
        if devices is not None and devices > 1:
            raise ValueError(f"--model {TINY_RANDOM} runs on one device, not devices={devices}")
        from attn_jax.testing.models import tiny_random_engine

        return tiny_random_engine(**engine_kwargs)
    if model is not None and pathlib.Path(model).is_dir():
        loader = next((getattr(Engine, n) for n in HF_LOADER_NAMES if hasattr(Engine, n)), None)
        if loader is None:
            raise ValueError(
                f"--model {model} is a directory, and this build loads no Hugging Face checkpoints "
                f"(no Engine.{' / Engine.'.join(HF_LOADER_NAMES)}): give a Llama GGUF file, or leave "
                "--model out for the embedded SmolLM2-135M-Instruct"
            )
        return loader(model, devices=devices, progress=progress, **engine_kwargs)
    return Engine.from_gguf(model, devices=devices, progress=progress, **engine_kwargs)
