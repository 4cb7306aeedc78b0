"""The jnp MLA reference (decode absorbed, prefill up-projected, the latent write) against
the float64 NumPy oracle, with NaN in every unused cache slot; and its input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla.reference import mla_decode, mla_prefill, write_latent_cache
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_decode_oracle, mla_prefill_oracle

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
C, ROPE, NOPE, DV, H = 32, 16, 24, 20, 4


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_matches_oracle(block_size, dtype):
    b = make_mla_batch(1, seq_lens=[1, 70, 0, 17], num_heads=H, kv_lora_rank=C, rope_dim=ROPE,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    scale = (NOPE + ROPE) ** -0.5
    out, lse = mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=scale, kv_lora_rank=C,
                          return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_oracle(np.asarray(b.q_decode.astype(jnp.float32)), b.latents, kv_lora_rank=C,
                                       sm_scale=scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == (4, H, C)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))  # empty request


def test_decode_under_jit_equals_eager():
    b = make_mla_batch(2, seq_lens=[5, 33], num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    f = jax.jit(lambda *a: mla_decode(*a, sm_scale=0.2, kv_lora_rank=C))
    args = (b.q_decode, b.kv_cache, jnp.asarray(b.seq_lens), jnp.asarray(b.block_tables))
    np.testing.assert_allclose(f(*args), mla_decode(*args, sm_scale=0.2, kv_lora_rank=C), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_matches_oracle(block_size, causal):
    rng = np.random.default_rng(3)
    query_lens, seq_lens = [3, 1, 0, 20], [3, 40, 5, 29]  # fresh, decode-like, no new tokens, chunk on context
    b = make_mla_batch(3, seq_lens=seq_lens, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=block_size)
    num_tokens = sum(query_lens) + 2  # two padding rows
    q = rng.standard_normal((num_tokens, H, NOPE + ROPE)).astype(np.float32)
    w_uk = (rng.standard_normal((C, H, NOPE)) * C**-0.5).astype(np.float32)
    w_uv = (rng.standard_normal((C, H, DV)) * C**-0.5).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    scale = (NOPE + ROPE) ** -0.5
    out, lse = mla_prefill(jnp.asarray(q), b.kv_cache, jnp.asarray(w_uk), jnp.asarray(w_uv), qsl, b.seq_lens,
                           b.block_tables, sm_scale=scale, kv_lora_rank=C, causal=causal, return_lse=True)  # fmt: skip
    want, want_lse = mla_prefill_oracle(q, b.latents, w_uk, w_uv, query_lens, sm_scale=scale, causal=causal)
    assert out.shape == (num_tokens, H, DV)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(out)[-2:] == 0)  # padding rows


def test_write_latent_cache_skips_padding_slots():
    cache = jnp.full((3, 4, C + ROPE), jnp.nan, jnp.float32)
    rng = np.random.default_rng(0)
    kv_c, k_pe = rng.standard_normal((3, C)).astype(np.float32), rng.standard_normal((3, ROPE)).astype(np.float32)
    slots = np.array([5, -1, 11], np.int32)
    new = np.asarray(write_latent_cache(cache, kv_c, k_pe, slots, kv_lora_rank=C)).reshape(12, C + ROPE)
    np.testing.assert_array_equal(new[5], np.concatenate([kv_c[0], k_pe[0]]))
    np.testing.assert_array_equal(new[11], np.concatenate([kv_c[2], k_pe[2]]))
    assert np.isnan(np.delete(new, [5, 11], axis=0)).all()  # -1 did not wrap around to the last slot


def _decode_args():
    b = make_mla_batch(0, seq_lens=[5, 9], num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    return b, (b.q_decode, b.kv_cache, b.seq_lens, b.block_tables)


def test_error_wrong_kv_lora_rank():
    _, args = _decode_args()
    with pytest.raises(ValueError, match=r"kv_lora_rank=48 must be an int in \[1, 47\]"):
        mla_decode(*args, sm_scale=0.1, kv_lora_rank=48)


def test_error_query_not_latent_width():
    b, (q, *rest) = _decode_args()
    with pytest.raises(ValueError, match=r"q head_size=40 must be 48 \(the absorbed query: kv_lora_rank=32"):
        mla_decode(q[..., :40], *rest, sm_scale=0.1, kv_lora_rank=C)


def test_error_cache_not_latent_rows():
    b, (q, cache, *rest) = _decode_args()
    with pytest.raises(ValueError, match=r"kv_cache.shape=\(1, 4, 16, 48\) must be \[num_blocks, block_size, kv_lora"):
        mla_decode(q, cache[None, :, :16], *rest, sm_scale=0.1, kv_lora_rank=C)


def test_error_block_id_out_of_range():
    b, (q, cache, lens, table) = _decode_args()
    table = table.copy()
    table[1, 0] = 99
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]=99 is outside \[0, num_blocks=4\)"):
        mla_decode(q, cache, lens, table, sm_scale=0.1, kv_lora_rank=C)


def test_error_prefill_head_sizes():
    b, (q, cache, lens, table) = _decode_args()
    w_uk, w_uv = jnp.zeros((C, H, NOPE)), jnp.zeros((C, H, DV))
    qsl = np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match=r"q head_size=48 must be 40 \(qk_nope_head_dim=24 \(from w_uk\)"):
        mla_prefill(q, cache, w_uk, w_uv, qsl, lens, table, sm_scale=0.1, kv_lora_rank=C)
    with pytest.raises(ValueError, match=r"w_uv.shape=\(16, 4, 20\) must be \[kv_lora_rank=32"):
        mla_prefill(q[..., :40], cache, w_uk, w_uv[:16], qsl, lens, table, sm_scale=0.1, kv_lora_rank=C)


def test_error_index_dtype_and_cache_dtype():
    b, (q, cache, lens, table) = _decode_args()
    with pytest.raises(TypeError, match="seq_lens has dtype int64; it must be an int32 array"):
        mla_decode(q, cache, lens.astype(np.int64), table, sm_scale=0.1, kv_lora_rank=C)
    with pytest.raises(TypeError, match=r"kv_cache.dtype=int8 is not supported. Valid dtypes are: float32, bfloat16, "
                                        r"float16, float8_e4m3fn, float8_e5m2"):  # fmt: skip
        mla_decode(q, cache.astype(jnp.int8), lens, table, sm_scale=0.1, kv_lora_rank=C)
