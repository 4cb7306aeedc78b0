"""attn-stack's cache folder and the persistent compilation cache `attn-stack serve` turns on."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

from attn_jax.cache_dir import CACHE_ENV, PACKAGE_RELATIVE_SOURCES, cache_root, enable_compilation_cache
from tests.subprocess_env import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cache_root_is_the_env_folder_or_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "attn-stack"


@pytest.fixture
def no_compilation_cache():
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_hlo_source_file_canonicalization_regex
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_hlo_source_file_canonicalization_regex", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_hlo_source_file_canonicalization_regex", before[1])


def test_compilation_cache_goes_under_the_cache_root(monkeypatch, tmp_path, no_compilation_cache):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert enable_compilation_cache() == str(tmp_path / "jax-compilation")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax-compilation")


def test_a_compilation_cache_already_set_is_kept(tmp_path, no_compilation_cache):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert enable_compilation_cache() == str(tmp_path / "mine")


def test_source_files_are_named_from_the_package_unless_a_regex_is_set(tmp_path, no_compilation_cache):
    enable_compilation_cache()
    assert jax.config.jax_hlo_source_file_canonicalization_regex == PACKAGE_RELATIVE_SOURCES
    jax.config.update("jax_hlo_source_file_canonicalization_regex", "mine")
    enable_compilation_cache()
    assert jax.config.jax_hlo_source_file_canonicalization_regex == "mine"


LOWER_WRITE_KERNEL = """
import functools, sys
import jax, jax.numpy as jnp
from attn_jax.cache_dir import enable_compilation_cache
from attn_jax.ops.ragged_paged_attention import kv_write
from tests.ops.triton_lowering import export_for_h100

sds = jax.ShapeDtypeStruct
shapes = (sds((2, 8, 16, 2, 64), jnp.bfloat16), sds((40, 2, 64), jnp.bfloat16), sds((40, 2, 64), jnp.bfloat16),
          sds((40,), jnp.int32))
write = functools.partial(kv_write.write_kv, interpret=False)
for _ in range(2):  # as it is, then with the compilation cache on
    sys.stdout.write(export_for_h100(write, *shapes, donate_argnums=0)[0] + "\\0")
    enable_compilation_cache()
"""


def test_two_copies_of_the_package_lower_a_kernel_alike_once_the_cache_is_on(tmp_path):
    """The k/v write kernel lowered for an H100 from this checkout and from a copy elsewhere: its
    program names the copy's path (a cache miss) until the compilation cache is on."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "attn_jax", copy / "attn_jax", ignore=shutil.ignore_patterns("__pycache__"))
    outputs = []
    for tree in (ROOT, copy):
        env = dict(subprocess_env(), PYTHONPATH=f"{tree}:{ROOT}", JAX_PLATFORMS="cpu", **{CACHE_ENV: str(tmp_path)})
        run = subprocess.run(
            [sys.executable, "-c", LOWER_WRITE_KERNEL], env=env, cwd=tree, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.split("\0")[:2])
    (here_before, here_after), (copy_before, copy_after) = outputs
    assert str(copy / "attn_jax") in copy_before and here_before != copy_before
    assert str(copy) not in copy_after and here_after == copy_after
