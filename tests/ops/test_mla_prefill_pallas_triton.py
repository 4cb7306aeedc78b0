"""The Triton MLA prefill (up-projection in XLA, q/k 192-style and v head sizes that differ in
the kernel) in the Pallas interpreter against the float64 oracle; lowering for an H100."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import prefill_pallas_triton
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_prefill_oracle
from tests.ops.test_mla_lowering import _export_for_h100

C, ROPE, NOPE, DV, H = 32, 16, 32, 16, 2


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_prefill_interpret_matches_oracle(dtype, tol):
    rng = np.random.default_rng(8)
    query_lens, seq_lens = [20, 1, 0, 5], [20, 33, 4, 40]  # fresh, one token, idle, a chunk on context
    b = make_mla_batch(8, seq_lens=seq_lens, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=16, dtype=dtype)
    num_tokens = sum(query_lens) + 3
    q = jnp.asarray(rng.standard_normal((num_tokens, H, NOPE + ROPE)), dtype)
    w_uk = jnp.asarray(rng.standard_normal((C, H, NOPE)) * C**-0.5, dtype)
    w_uv = jnp.asarray(rng.standard_normal((C, H, DV)) * C**-0.5, dtype)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    out, lse = prefill_pallas_triton.mla_prefill(q, b.kv_cache, w_uk, w_uv, qsl, b.seq_lens, b.block_tables,
                                                 sm_scale=0.2, kv_lora_rank=C, q_block=32, return_lse=True,
                                                 interpret=True, block_q=16, block_k=16)  # fmt: skip
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, w_uk, w_uv)]
    want, want_lse = mla_prefill_oracle(f64[0], b.latents, f64[1], f64[2], query_lens, sm_scale=0.2)
    assert out.shape == (num_tokens, H, DV) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=tol * 10, rtol=1e-4)  # -inf on the padding rows


def test_prefill_lowers_for_h100_at_mla_p1():
    sds = jax.ShapeDtypeStruct

    def f(q, cache, w_uk, w_uv, qsl, lens, table):
        return prefill_pallas_triton.mla_prefill(q, cache, w_uk, w_uv, qsl, lens, table, sm_scale=192**-0.5,
                                          kv_lora_rank=512, q_block=4096, interpret=False)  # fmt: skip

    text = _export_for_h100(f, sds((16384, 16, 192), jnp.bfloat16), sds((300, 64, 576), jnp.bfloat16),
                            sds((512, 16, 128), jnp.bfloat16), sds((512, 16, 128), jnp.bfloat16),
                            sds((5,), jnp.int32), sds((4,), jnp.int32), sds((4, 64), jnp.int32))  # fmt: skip
    assert 'name = "mla_prefill_pallas_triton"' in text


@pytest.mark.gpu
def test_prefill_compiled_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(9)
    query_lens, seq_lens = [200, 1, 100], [200, 300, 400]
    b = make_mla_batch(9, seq_lens=seq_lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                       dtype=jnp.bfloat16)  # fmt: skip
    q = jnp.asarray(rng.standard_normal((301, 16, 192)), jnp.bfloat16)
    w_uk = jnp.asarray(rng.standard_normal((512, 16, 128)) * 512**-0.5, jnp.bfloat16)
    w_uv = jnp.asarray(rng.standard_normal((512, 16, 128)) * 512**-0.5, jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    out = prefill_pallas_triton.mla_prefill(q, b.kv_cache, w_uk, w_uv, qsl, b.seq_lens, b.block_tables,
                                     sm_scale=192**-0.5, kv_lora_rank=512, q_block=256, interpret=False)  # fmt: skip
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, w_uk, w_uv)]
    want, _ = mla_prefill_oracle(f64[0], b.latents, f64[1], f64[2], query_lens, sm_scale=192**-0.5)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=3e-2, rtol=3e-2)
