"""The Mosaic TPU MLA decode kernel: in the TPU interpreter against the float64 oracle, and
lowered for TPU from the CPU (``jax.export``) at the DeepSeek-V3 shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import pallas_mosaic_tpu
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_decode_oracle

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "block_size, dtype, splits", [(16, jnp.float32, 1), (16, jnp.float32, 3), (64, jnp.bfloat16, 2)]
)
def test_decode_interpret_matches_oracle(block_size, dtype, splits):
    b = make_mla_batch(7, seq_lens=[1, 70, 0, 33], num_heads=8, kv_lora_rank=128, rope_dim=64,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    scale = 192**-0.5
    out, lse = pallas_mosaic_tpu.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=scale,
                                     kv_lora_rank=128, return_lse=True, interpret=True,
                                     num_kv_splits=splits)  # fmt: skip
    want, want_lse = mla_decode_oracle(np.asarray(b.q_decode.astype(jnp.float32)), b.latents, kv_lora_rank=128,
                                       sm_scale=scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL[dtype] * 10, rtol=1e-5)


@pytest.mark.parametrize(
    "num_heads, page_size, splits, cache_dtype",
    [(128, 64, 1, jnp.bfloat16), (16, 64, 4, jnp.bfloat16), (16, 16, 1, jnp.bfloat16), (128, 64, 2, jnp.float8_e4m3fn)],
)
def test_decode_lowers_for_tpu(num_heads, page_size, splits, cache_dtype):
    sds = jax.ShapeDtypeStruct
    scale = {"k_scale": jnp.float32(0.5)} if cache_dtype == jnp.float8_e4m3fn else {}

    def f(q, cache, lens, table):
        return pallas_mosaic_tpu.mla_decode(q, cache, lens, table, sm_scale=192**-0.5, kv_lora_rank=512,
                                            return_lse=True, interpret=False, num_kv_splits=splits,
                                            **scale)  # fmt: skip

    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((64, num_heads, 576), jnp.bfloat16), sds((4200, page_size, 576), cache_dtype),
        sds((64,), jnp.int32), sds((64, 4096 // page_size), jnp.int32),
    )  # fmt: skip
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()


def test_error_num_kv_splits():
    b = make_mla_batch(0, seq_lens=[3], num_heads=4, kv_lora_rank=128, rope_dim=64, block_size=16)
    with pytest.raises(ValueError, match=r"num_kv_splits=0 must be an int >= 1"):
        pallas_mosaic_tpu.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=128,
                              interpret=True, num_kv_splits=0)  # fmt: skip
