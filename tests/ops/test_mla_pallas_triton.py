"""The Triton-lowered MLA decode kernel in the Pallas interpreter (CPU) against the float64
oracle and the jnp reference; the same body compiled on a GPU under the ``gpu`` mark."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import pallas_triton, reference
from attn_jax.ops.mla.pallas_triton import MLADecodeBlockSizes
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import check_deepseek_decode, mla_decode_oracle

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
C, ROPE, H = 32, 16, 20  # 20 heads: two head blocks of 16, the second partial


def _check(b, dtype, bs, interpret):
    scale = 48**-0.5
    out, lse = pallas_triton.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=scale,
                                        kv_lora_rank=C, return_lse=True, interpret=interpret,
                                        block_sizes=bs)  # fmt: skip
    want, want_lse = mla_decode_oracle(np.asarray(b.q_decode.astype(jnp.float32)), b.latents, kv_lora_rank=C,
                                       sm_scale=scale)  # fmt: skip
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=TOL[dtype] * 10, rtol=1e-5)


@pytest.mark.parametrize(
    "block_size, dtype, bs",
    [
        (16, jnp.float32, MLADecodeBlockSizes(block_h=16, pages_per_tile=1, num_kv_splits=1)),
        (16, jnp.float32, MLADecodeBlockSizes(block_h=32, pages_per_tile=2, num_kv_splits=3)),
        (64, jnp.bfloat16, MLADecodeBlockSizes(block_h=16, pages_per_tile=1, num_kv_splits=2)),
    ],
)
def test_decode_interpret_matches_oracle(block_size, dtype, bs):
    b = make_mla_batch(4, seq_lens=[1, 100, 0, 33], num_heads=H, kv_lora_rank=C, rope_dim=ROPE,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    _check(b, dtype, bs, interpret=True)


def test_default_block_sizes_and_reference_agree():
    b = make_mla_batch(5, seq_lens=[40, 3], num_heads=4, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    args = (b.q_decode, b.kv_cache, b.seq_lens, b.block_tables)
    got = pallas_triton.mla_decode(*args, sm_scale=0.15, kv_lora_rank=C, interpret=True)
    want = reference.mla_decode(*args, sm_scale=0.15, kv_lora_rank=C)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_default_block_sizes_deepseek_shape():
    bs = pallas_triton.default_block_sizes(num_reqs=64, num_heads=128, pages_per_req=64, page_size=64)
    assert (bs.block_h, bs.pages_per_tile, bs.num_kv_splits, bs.num_warps) == (32, 1, 1, 4)  # 256 programs: no split
    few = pallas_triton.default_block_sizes(num_reqs=16, num_heads=128, pages_per_req=64, page_size=64)
    assert (few.block_h, few.num_kv_splits, few.num_warps) == (64, 8, 8)  # 32 programs: split


@pytest.mark.parametrize(
    "device_kind, warps_stages", [("NVIDIA H100 80GB HBM3", (4, 3)), ("NVIDIA A100-SXM4-80GB", (8, 2)), (None, (8, 2))]
)
def test_default_block_sizes_sixteen_heads_take_three_stages_where_the_smem_holds_them(device_kind, warps_stages):
    bs = pallas_triton.default_block_sizes(
        num_reqs=64, num_heads=16, pages_per_req=64, page_size=64, device_kind=device_kind
    )  # MLA-D1-16
    assert (bs.block_h, bs.pages_per_tile, bs.num_kv_splits) == (16, 1, 4)
    assert (bs.num_warps, bs.num_stages) == warps_stages
    wide = pallas_triton.default_block_sizes(
        num_reqs=64, num_heads=64, pages_per_req=64, page_size=64, device_kind=device_kind
    )
    assert (wide.num_warps, wide.num_stages) == (8, 2)  # only 16-head programs were measured
    f32 = pallas_triton.default_block_sizes(
        num_reqs=64, num_heads=16, pages_per_req=64, page_size=64, device_kind=device_kind, kv_itemsize=4
    )
    assert (f32.num_warps, f32.num_stages) == (8, 2)  # three float32 tiles would not fit, and were not measured


def test_error_non_power_of_two_rank():
    b = make_mla_batch(0, seq_lens=[3], num_heads=4, kv_lora_rank=24, rope_dim=16, block_size=16)
    with pytest.raises(ValueError, match=r"kv_lora_rank=24 must be a power of two for the Triton MLA kernel"):
        pallas_triton.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=0.1,
                                 kv_lora_rank=24, interpret=True)  # fmt: skip


def test_error_block_h():
    b = make_mla_batch(0, seq_lens=[3], num_heads=4, kv_lora_rank=C, rope_dim=ROPE, block_size=16)
    with pytest.raises(ValueError, match=r"block_h=8 must be a power of two >= 16"):
        pallas_triton.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C,
                                 interpret=True, block_sizes=MLADecodeBlockSizes(block_h=8))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, block_size", [(16, 64), (128, 64), (128, 16)])
def test_decode_compiled_on_gpu(num_heads, block_size):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check_deepseek_decode(functools.partial(pallas_triton.mla_decode, interpret=False), num_heads=num_heads,
                          block_size=block_size)  # fmt: skip
