"""The README's examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_jax_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["out"].shape == (namespace["T"], 8 * 64)


def test_pytorch_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    torch_blocks = [b for b in blocks if "import attn_torch" in b]
    assert torch_blocks, "README has no PyTorch example"
    namespace: dict = {}
    exec(compile(torch_blocks[0], str(README), "exec"), namespace)
    assert tuple(namespace["out"].shape) == (namespace["md"].num_tokens, 8 * 64)
