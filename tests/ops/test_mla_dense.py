"""The per-request up-projected MLA prefill (the backends' prefill path) against the float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla.dense import mla_prefill_dense
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_prefill_oracle

C, ROPE, NOPE, DV, H = 32, 16, 24, 20, 4


@pytest.mark.parametrize(
    ("causal", "context_chunk"),
    [(True, None), (False, None), (True, 16), (False, 32)],  # 16: a 40-token context in three chunks
)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_dense_prefill_matches_oracle(causal, context_chunk, dtype, tol):
    rng = np.random.default_rng(4)
    query_lens, seq_lens = [3, 1, 0, 20], [3, 40, 5, 29]
    b = make_mla_batch(4, seq_lens=seq_lens, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16, dtype=dtype)
    num_tokens = sum(query_lens) + 3
    q = jnp.asarray(rng.standard_normal((num_tokens, H, NOPE + ROPE)), dtype)
    w_uk = jnp.asarray(rng.standard_normal((C, H, NOPE)) * C**-0.5, dtype)
    w_uv = jnp.asarray(rng.standard_normal((C, H, DV)) * C**-0.5, dtype)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    scale = (NOPE + ROPE) ** -0.5
    out = mla_prefill_dense(q, b.kv_cache, w_uk, w_uv, qsl, b.seq_lens, b.block_tables, sm_scale=scale,
                            kv_lora_rank=C, q_block=32, causal=causal, context_chunk=context_chunk)  # fmt: skip
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, w_uk, w_uv)]
    want, _ = mla_prefill_oracle(*f64[:1], b.latents, *f64[1:], query_lens, sm_scale=scale, causal=causal)
    assert out.dtype == dtype and out.shape == (num_tokens, H, DV)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol)


def test_error_q_block_too_small():
    b = make_mla_batch(0, seq_lens=[9], num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    q = jnp.zeros((9, H, NOPE + ROPE))
    with pytest.raises(ValueError, match=r"q_block=8 must cover the longest query, 9 tokens"):
        mla_prefill_dense(q, b.kv_cache, jnp.zeros((C, H, NOPE)), jnp.zeros((C, H, DV)), np.array([0, 9], np.int32),
                          b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C, q_block=8)  # fmt: skip


@pytest.mark.parametrize("context_chunk", [0, 24])
def test_error_context_chunk_not_a_multiple_of_the_page(context_chunk):
    b = make_mla_batch(0, seq_lens=[9], num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    q = jnp.zeros((9, H, NOPE + ROPE))
    match = rf"context_chunk={context_chunk} must be a positive multiple of the page size 16"
    with pytest.raises(ValueError, match=match):
        mla_prefill_dense(q, b.kv_cache, jnp.zeros((C, H, NOPE)), jnp.zeros((C, H, DV)), np.array([0, 9], np.int32),
                          b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C, q_block=16,
                          context_chunk=context_chunk)  # fmt: skip
