"""The Mosaic GPU MLA decode kernel (``ops/mla/decode_pallas_mosaic_gpu``): its lowering for
CUDA from the CPU, what it refuses, its split choice, and, compiled on a Hopper GPU
(marker ``gpu``), its output and LSE against the float64 oracle on ragged batches whose pages
past each request's length hold NaN."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from attn_jax.ops.mla import decode_pallas_mosaic_gpu as mgpu_decode
from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import check_deepseek_decode


@pytest.mark.parametrize(("num_heads", "page_size", "num_splits"), [(128, 64, 1), (16, 16, 3)])
def test_kernel_lowers_for_cuda(num_heads, page_size, num_splits):
    """Layouts, TMA boxes and wgmma shapes (576-wide scores, the two 256-wide halves of p @ c_kv)
    lower on the CPU; the compile to SASS and the numbers are the marked GPU case's."""
    sds = jax.ShapeDtypeStruct
    f = functools.partial(mgpu_decode.mla_decode, sm_scale=192**-0.5, kv_lora_rank=512, num_splits=num_splits)
    shapes = (sds((4, num_heads, 576), jnp.bfloat16), sds((64, page_size, 576), jnp.bfloat16),
              sds((4,), jnp.int32), sds((4, 16), jnp.int32))  # fmt: skip
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(dtype=jnp.float32, cache_dtype=jnp.float32), "float32"),
        (dict(cache_dtype=jnp.float8_e4m3fn), "float8_e4m3fn"),
        (dict(kv_lora_rank=640, width=704), "kv_lora_rank=640"),
        (dict(width=560), "560"),
        (dict(page_size=24), "page_size=24"),
    ],
)
def test_unsupported_reason_names_the_value(kwargs, words):
    base = dict(kv_lora_rank=512, width=576, page_size=64, dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert mgpu_decode.unsupported_reason(**base) is None
    reason = mgpu_decode.unsupported_reason(**{**base, **kwargs})
    assert reason is not None and words in reason


def test_refuses_unsupported_shapes_with_the_reason():
    b = make_mla_batch(0, seq_lens=[5], num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                       dtype=jnp.float32)  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        mgpu_decode.mla_decode(b.q_decode, b.kv_cache, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=512)


def test_smem_fits_hopper_at_deepseek_width():
    assert mgpu_decode.smem_bytes(576) <= 232448 < mgpu_decode.smem_bytes(640)


def test_default_num_splits_fills_the_sms():
    one_wave = dict(num_heads=128, pages_per_req=64, page_size=64)
    assert mgpu_decode.default_num_splits(num_reqs=64, **one_wave) == 1  # 128 CTAs
    assert mgpu_decode.default_num_splits(num_reqs=64, num_heads=16, pages_per_req=64, page_size=64) == 2
    assert mgpu_decode.default_num_splits(num_reqs=1, **one_wave) == 16
    assert mgpu_decode.default_num_splits(num_reqs=1, num_heads=128, pages_per_req=2, page_size=64) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_heads", "page_size", "num_splits"), [(128, 64, None), (16, 64, 3), (128, 16, 2), (20, 32, 1)]
)
def test_decode_on_hopper_matches_oracle(num_heads, page_size, num_splits):
    if jax.default_backend() != "gpu" or not mgpu_prefill_available(jax.devices()[0].device_kind):
        pytest.skip("needs a Hopper GPU (H100/H200) for Mosaic GPU")
    check_deepseek_decode(functools.partial(mgpu_decode.mla_decode, num_splits=num_splits), num_heads=num_heads,
                          block_size=page_size)  # fmt: skip
