"""attn_torch.MLAAttention: the torch shell gives the JAX MLAAttention's output on the same
inputs (a prefill step, then a decode step on the torch cache it wrote in place)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attn_jax.mla_layer import MLAAttention as JaxMLAAttention  # noqa: E402
from attn_torch import bind_kv_cache, build_common_attn_metadata, set_forward_context  # noqa: E402
from attn_torch.mla_layer import MLAAttention  # noqa: E402

C, ROPE, NOPE, DV, H, S = 32, 16, 24, 20, 4, 16


def test_torch_mla_matches_jax_layer_over_two_steps():
    rng = np.random.default_rng(0)
    kv_b = torch.nn.Linear(C, H * (NOPE + DV), bias=False)
    layer = MLAAttention(H, (NOPE + ROPE) ** -0.5, NOPE, ROPE, DV, None, C, kv_b_proj=kv_b, prefix="t.mla",
                         block_size=S, dtype=torch.float32)  # fmt: skip
    ref = JaxMLAAttention(H, (NOPE + ROPE) ** -0.5, NOPE, ROPE, DV, None, C, block_size=S, dtype=jnp.float32)
    cache = layer.init_kv_cache(4)
    bind_kv_cache({"t.mla": cache}, {"t.mla": layer})
    jax_cache = ref.init_kv_cache(4)
    w = jnp.asarray(kv_b.weight.detach().numpy().T)
    table = np.array([[0, 1], [2, 3]], np.int32)
    for query_lens, seq_lens in (([4, 17], [4, 17]), ([1, 1], [5, 18])):
        md = build_common_attn_metadata(query_lens, seq_lens, table, S)
        t = md.num_tokens
        q = rng.standard_normal((t, H, NOPE + ROPE)).astype(np.float32)
        kv_c = rng.standard_normal((t, C)).astype(np.float32)
        k_pe = rng.standard_normal((t, ROPE)).astype(np.float32)
        with torch.no_grad(), set_forward_context(md):
            out = layer(*(torch.from_numpy(x).clone() for x in (q, kv_c, k_pe)))  # clone: 64-byte aligned
        want, jax_cache = ref(jnp.asarray(q), jnp.asarray(kv_c), jnp.asarray(k_pe), jax_cache, md, w)
        n = sum(query_lens)
        assert out.shape == (t, H * DV)
        np.testing.assert_allclose(out.numpy()[:n], np.asarray(want)[:n], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(cache.numpy(), np.asarray(jax_cache))  # written in place, the same rows
