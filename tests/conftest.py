"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_backend_selection(monkeypatch):
    """No forced backend, no registry overrides, no ATTN_STACK_BACKEND, default KV layout.

    Selection state is process-global; every test starts and ends without any.
    """
    from attn_jax import metadata, registry, selector

    def reset():
        selector.global_force_attn_backend(None)
        for enum_cls in (registry.AttentionBackendEnum, registry.MambaAttentionBackendEnum):
            for member in enum_cls:
                member.clear_override()
        metadata.set_kv_cache_layout(None)

    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    reset()
    yield
    reset()
