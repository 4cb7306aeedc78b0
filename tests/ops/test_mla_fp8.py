"""fp8 latent caches (e4m3, e5m2; the cache stores latent / k_scale): the reference, both decode
kernels in their interpreters and the sparse kernel against the oracle on the dequantised
latents; the write quantises; a missing scale is a named error."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import pallas_mosaic_tpu, pallas_triton, reference, sparse_pallas_triton
from attn_jax.ops.mla.pallas_triton import MLADecodeBlockSizes
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_decode_oracle, sparse_mla_oracle

C, ROPE, H, SCALE = 64, 64, 16, 0.25  # a power-of-two scale: the test cache round-trips exactly


def _batch(cache_dtype):
    return make_mla_batch(9, seq_lens=[1, 37, 0, 20], num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16,
                          dtype=jnp.float32, cache_dtype=cache_dtype, k_scale=SCALE)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("impl", ["reference", "triton", "tpu"])
def test_fp8_decode_matches_oracle_on_dequantised_latents(cache_dtype, impl):
    b = _batch(cache_dtype)
    args = (b.q_decode, b.kv_cache, b.seq_lens, b.block_tables)
    kw = dict(sm_scale=0.1, kv_lora_rank=C, return_lse=True, k_scale=jnp.float32(SCALE))
    if impl == "reference":
        out, lse = reference.mla_decode(*args, **kw)
    elif impl == "triton":
        out, lse = pallas_triton.mla_decode(*args, **kw, interpret=True, block_sizes=MLADecodeBlockSizes(16, 1, 2))
    else:
        out, lse = pallas_mosaic_tpu.mla_decode(*args, **kw, interpret=True)
    want, want_lse = mla_decode_oracle(np.asarray(b.q_decode), b.latents, kv_lora_rank=C, sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)


def test_fp8_sparse_kernel_matches_oracle():
    b = _batch(jnp.float8_e4m3fn)
    rng = np.random.default_rng(2)
    query_lens = [1, 3, 0, 2]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    topk = np.full((6, 16), -1, np.int32)
    row = 0
    for qlen, n in zip(query_lens, b.seq_lens, strict=True):
        for i in range(qlen):
            chosen = rng.permutation(n - qlen + i + 1)[:16]
            topk[row, : chosen.size] = chosen
            row += 1
    q = jnp.asarray(rng.standard_normal((6, H, C + ROPE)).astype(np.float32))
    out = sparse_pallas_triton.sparse_mla(q, b.kv_cache, topk, qsl, b.seq_lens, b.block_tables, sm_scale=0.1,
                                          kv_lora_rank=C, interpret=True, block_h=16, block_k=16,
                                          k_scale=jnp.float32(SCALE))  # fmt: skip
    want, _ = sparse_mla_oracle(np.asarray(q), b.latents, topk, query_lens, kv_lora_rank=C, sm_scale=0.1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=3e-5, rtol=3e-5)


def test_fp8_write_quantises_and_missing_scale_is_named():
    cache = jnp.zeros((2, 4, C + ROPE), jnp.float8_e4m3fn)
    kv_c, k_pe = jnp.full((1, C), 3.0), jnp.full((1, ROPE), -1000.0)
    new = reference.write_latent_cache(cache, kv_c, k_pe, np.array([5], np.int32), kv_lora_rank=C, k_scale=2.0)
    row = np.asarray(new.astype(jnp.float32)).reshape(8, -1)[5]
    assert np.all(row[:C] == 1.5) and np.all(row[C:] == -448.0)  # 3 / 2; -500 saturates at e4m3's max
    with pytest.raises(ValueError, match=r"kv_cache.dtype=float8_e4m3fn is fp8: pass k_scale"):
        reference.write_latent_cache(cache, kv_c, k_pe, np.array([5], np.int32), kv_lora_rank=C)
    b = _batch(jnp.float8_e5m2)
    with pytest.raises(ValueError, match=r"kv_cache.dtype=float8_e5m2 is fp8: pass k_scale"):
        pallas_triton.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C,
                                 interpret=True)  # fmt: skip
