"""MLAAttention: backend selection, the latent cache, kv_b_proj's split, and a mixed batch
(written latents, absorbed decodes, up-projected prefills) against the float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attn_jax.backends.mla_pallas import PallasMLAGPUBackend
from attn_jax.backends.mla_xla import XLAMLABackend
from attn_jax.metadata import build_common_attn_metadata
from attn_jax.mla_layer import MLAAttention
from tests.ops.mla_oracle import mla_prefill_oracle

C, ROPE, NOPE, DV, H, S = 32, 16, 24, 20, 4, 16


def _layer(**kw):
    return MLAAttention(H, (NOPE + ROPE) ** -0.5, NOPE, ROPE, DV, None, C, block_size=S, dtype=jnp.float32, **kw)


def test_selects_xla_mla_on_cpu_and_allocates_latent_cache():
    layer = _layer()
    assert layer.attn_backend is XLAMLABackend
    assert layer.init_kv_cache(5).shape == (5, S, C + ROPE)
    assert "backend=XLA_MLA" in repr(layer)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "context_chunk"), [("auto", 8192), ("fp8", 8192), ("auto", 16)]
)  # 16: the 17/18-token contexts prefilled in chunks of one page
def test_two_steps_prefill_then_decode_match_oracle(kv_cache_dtype, context_chunk, monkeypatch):
    rng = np.random.default_rng(0)
    layer = _layer(kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr(type(layer.impl), "prefill_context_chunk", context_chunk)
    kv_b_proj = (rng.standard_normal((C, H * (NOPE + DV))) * C**-0.5).astype(np.float32)
    w = kv_b_proj.reshape(C, H, NOPE + DV)
    w_uk, w_uv = w[..., :NOPE], w[..., NOPE:]
    seqs = [rng.standard_normal((n, C + ROPE)).astype(np.float32) for n in (5, 18)]  # each request's latents
    table = np.array([[0, 1], [2, 3]], np.int32)
    cache = layer.init_kv_cache(4, fill=np.nan)  # unused slots NaN
    scale = (NOPE + ROPE) ** -0.5
    for query_lens, seq_lens in (([4, 17], [4, 17]), ([1, 1], [5, 18])):  # prefill, then one decode each
        md = build_common_attn_metadata(query_lens, seq_lens, table, S)
        new = np.concatenate([s[n - q : n] for s, q, n in zip(seqs, query_lens, seq_lens, strict=True)])
        pad = md.num_tokens - new.shape[0]
        q = rng.standard_normal((md.num_tokens, H * (NOPE + ROPE))).astype(np.float32)
        kv_c = jnp.asarray(np.pad(new[:, :C], ((0, pad), (0, 0))))
        k_pe = jnp.asarray(np.pad(new[:, C:], ((0, pad), (0, 0))))
        out, cache = layer(jnp.asarray(q), kv_c, k_pe, cache, md, jnp.asarray(kv_b_proj))
        assert out.shape == (md.num_tokens, H * DV)
        latents = [s[:n] for s, n in zip(seqs, seq_lens, strict=True)]
        if kv_cache_dtype == "fp8":  # what the cache holds: e4m3-rounded latents (k_scale 1.0)
            latents = [x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) for x in latents]
        want, _ = mla_prefill_oracle(q.reshape(-1, H, NOPE + ROPE), latents, w_uk, w_uv, query_lens, sm_scale=scale)
        n = sum(query_lens)
        np.testing.assert_allclose(np.asarray(out)[:n], want[:n].reshape(n, -1), atol=3e-5, rtol=3e-5)
        assert not np.asarray(out)[n:].any()  # padding rows: zero (the prefill step's rows in place too)


def test_prefill_rows_are_read_in_place_only_when_they_are_the_batch_in_order():
    """All-prefill batches skip the gather and scatter of rows (``prefill_rows_in_order``);
    a batch with decodes keeps them, wherever its prefills sit."""
    builder = _layer().metadata_builder
    table = np.array([[0, 1], [2, 3]], np.int32)
    cases = {(4, 17): True, (1, 17): False, (17, 1): False}
    for query_lens, in_order in cases.items():
        md = build_common_attn_metadata(query_lens, [max(q, 5) for q in query_lens], table, S)
        assert builder.build(0, md).prefill_rows_in_order is in_order, query_lens


def test_errors_name_the_bad_value():
    layer = _layer()
    with pytest.raises(ValueError, match=r"kv_b_proj.shape=\(32, 100\) must be \(32, 176\)"):
        layer.split_kv_b_proj(jnp.zeros((C, 100)))
    with pytest.raises(TypeError, match=r"q.dtype=bfloat16 must be the layer's dtype=float32"):
        layer(jnp.zeros((2, H, NOPE + ROPE), jnp.bfloat16), jnp.zeros((2, C)), jnp.zeros((2, ROPE)),
              layer.init_kv_cache(2), None, jnp.zeros((C, H * (NOPE + DV))))  # fmt: skip
    with pytest.raises(ValueError, match=r"attn_backend=PALLAS_MLA_GPU cannot serve this layer: head_size=48 is not"):
        _layer(attn_backend=PallasMLAGPUBackend)


def test_sparse_layer_needs_topk_positions_and_attends_to_them_only():
    rng = np.random.default_rng(1)
    layer = _layer(use_sparse=True)
    md = build_common_attn_metadata([3], [3], np.array([[0]], np.int32), S)
    t = md.num_tokens
    q = jnp.asarray(rng.standard_normal((t, H, NOPE + ROPE)).astype(np.float32))
    kv_c, k_pe = jnp.asarray(rng.standard_normal((t, C)).astype(np.float32)), jnp.zeros((t, ROPE))
    kv_b_proj = jnp.asarray(rng.standard_normal((C, H * (NOPE + DV))).astype(np.float32))
    with pytest.raises(ValueError, match=r"topk_positions is None but the layer has use_sparse=True"):
        layer(q, kv_c, k_pe, layer.init_kv_cache(1), md, kv_b_proj)
    only_first = np.full((t, 2), -1, np.int32)
    only_first[:3, 0] = 0  # every token attends to position 0 alone: out = c_kv[0] @ W_UV
    out, _ = layer(q, kv_c, k_pe, layer.init_kv_cache(1), md, kv_b_proj, topk_positions=only_first)
    w_uv = np.asarray(kv_b_proj).reshape(C, H, NOPE + DV)[..., NOPE:]
    want = np.einsum("c,chd->hd", np.asarray(kv_c)[0], w_uv).reshape(-1)
    np.testing.assert_allclose(np.asarray(out)[:3], np.broadcast_to(want, (3, want.size)), atol=1e-4, rtol=1e-5)
