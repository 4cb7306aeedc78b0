"""attn_torch.torchax checks, run by tests/attn_torch/test_torchax.py in a subprocess of their own.

Importing torchax registers a "jax" device with torch, after which torch.compile in the
same process fails ("PyTorch is not linked with support for jax devices"), so these checks
never share a process with the rest of the suite. ``python -m tests.attn_torch.torchax_checks``
runs them all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchax

import attn_torch.torchax
from attn_torch import Attention, bind_kv_cache, build_common_attn_metadata, set_forward_context


def check_torchax_version_is_the_pinned_one():
    assert torchax.__version__ == attn_torch.torchax.TORCHAX_VERSION


def check_layer_under_torchax_matches_the_eager_path_and_updates_the_cache_in_place():
    torch.manual_seed(0)
    bt = np.array([[0, 1], [2, 0]])
    steps = [build_common_attn_metadata([1, 3], [6, 3], bt, 4), build_common_attn_metadata([1, 1], [7, 4], bt, 4)]
    inputs = [(torch.randn(16, 64), torch.randn(16, 32), torch.randn(16, 32)) for _ in steps]

    eager = Attention(4, 16, 0.25, 2, prefix="test_torchax.eager", block_size=4)
    start = eager.init_kv_cache(8).normal_()
    eager_cache = start.clone()
    bind_kv_cache({eager.layer_name: eager_cache})
    expected = []
    with torch.no_grad():
        for md, (q, k, v) in zip(steps, inputs, strict=True):
            with set_forward_context(md):
                expected.append(eager(q, k, v))

    env = attn_torch.torchax.enable()
    with env:
        layer = Attention(4, 16, 0.25, 2, prefix="test_torchax.torchax", block_size=4)
        cache = start.to("jax")
        bind_kv_cache({layer.layer_name: cache})
        pointer = cache._elem.unsafe_buffer_pointer()
        outs = []
        for md, (q, k, v) in zip(steps, inputs, strict=True):
            with set_forward_context(md):
                outs.append(layer(q.to("jax"), k.to("jax"), v.to("jax")))
        assert layer.kv_cache[0] is cache and cache._elem.unsafe_buffer_pointer() == pointer, "donated in place"
        got = [np.asarray(o._elem) for o in outs]
        final = np.asarray(cache._elem)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(final, eager_cache.numpy())


def check_torchax_path_needs_a_bound_cache():
    env = attn_torch.torchax.enable()
    md = build_common_attn_metadata([1], [1], np.array([[0]]), 4)
    with env:
        layer = Attention(2, 16, 0.25, prefix="test_torchax.unbound", block_size=4)
        x = torch.zeros(16, 32).to("jax")
        with set_forward_context(md), pytest.raises(RuntimeError, match="has no bound KV cache"):
            layer(x, x, x)


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("check_"):
            fn()
            print(f"ok {name}")
