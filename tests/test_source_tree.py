"""Rules of the house that hold for the source tree as a whole."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = ROOT / "attn_jax" / "ops"
ENV_ACCESS = re.compile(r"\bos\.environ\b|\bgetenv\b|^\s*import os\b|^\s*from os import", re.M)


@pytest.mark.parametrize("path", sorted(OPS.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS)))
def test_kernels_are_pure(path):
    """Nothing under ops/ reads environment variables (ARCHITECTURE.md, rules of the house)."""
    assert not ENV_ACCESS.search(path.read_text()), f"{path.relative_to(ROOT)} reads the environment"


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: install attn-stack[test]"
    result = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


UPWARD_IMPORT = re.compile(
    r"^\s*(from|import)\s+attn_jax\.(backends|selector|layer|registry|testing|serving|models|cli)\b", re.M
)


@pytest.mark.parametrize("path", sorted(OPS.rglob("*.py")), ids=lambda p: str(p.relative_to(OPS)))
def test_ops_do_not_import_upward(path):
    """ops/ sits below backends, selection, layers and test helpers: no arrow points up."""
    match = UPWARD_IMPORT.search(path.read_text())
    assert match is None, f"{path.relative_to(ROOT)} imports {match.group(0).strip()!r}"


BRIDGE = ROOT / "bridge"
IMPORTS_ATTN_TORCH = re.compile(r"^\s*(from|import)\s+attn_torch\b", re.M)


@pytest.mark.parametrize("path", sorted(BRIDGE.rglob("*.py")), ids=lambda p: str(p.relative_to(BRIDGE)))
def test_bridge_does_not_import_attn_torch(path):
    """bridge/ is the torch side's ground floor (DLPack, JAX's memory policy): attn_torch
    builds on it, never the other way round (the torchax path lives in attn_torch/torchax.py)."""
    match = IMPORTS_ATTN_TORCH.search(path.read_text())
    assert match is None, f"{path.relative_to(ROOT)} imports {match.group(0).strip()!r}"


def test_bridge_holds_only_dlpack_and_memory_policy():
    assert sorted(p.name for p in BRIDGE.glob("*.py")) == ["__init__.py", "_jax_memory.py", "dlpack.py"]
