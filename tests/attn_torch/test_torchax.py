"""attn_torch.torchax under torchax on the CPU: the checks in torchax_checks.py, in a subprocess.

A subprocess because importing torchax registers a "jax" device with torch, which breaks
torch.compile for every later test in the same process.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("torchax") is None, reason="torchax is the xla extra: attn-stack[xla]")
def test_torchax_checks_pass_in_their_own_process():
    result = subprocess.run(
        [sys.executable, "-m", "tests.attn_torch.torchax_checks"],
        cwd=ROOT, env=os.environ | {"JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("ok check_")]
    assert len(passed) == 3, result.stdout


def test_missing_torchax_is_a_clear_error(monkeypatch):
    import attn_torch.torchax

    monkeypatch.setitem(sys.modules, "torchax", None)  # import torchax -> ImportError
    with pytest.raises(ImportError, match=r"attn_torch.torchax needs torchax==0.0.13: pip install 'attn-stack\[xla\]'"):
        attn_torch.torchax.enable()
