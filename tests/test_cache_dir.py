"""attn-stack's cache folder and the persistent compilation cache `attn-stack serve` turns on."""

from __future__ import annotations

import jax
import pytest

from attn_jax.cache_dir import CACHE_ENV, cache_root, enable_compilation_cache


def test_cache_root_is_the_env_folder_or_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "attn-stack"


@pytest.fixture
def no_compilation_cache():
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_compilation_cache_goes_under_the_cache_root(monkeypatch, tmp_path, no_compilation_cache):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert enable_compilation_cache() == str(tmp_path / "jax-compilation")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax-compilation")


def test_a_compilation_cache_already_set_is_kept(tmp_path, no_compilation_cache):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert enable_compilation_cache() == str(tmp_path / "mine")
