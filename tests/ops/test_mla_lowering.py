"""The MLA Triton kernels lower from Pallas to Triton IR for an H100 from this CPU machine
(``jax.export`` under an abstract H100 device), at DeepSeek-V3 shapes: a kernel that
cannot be lowered fails here, before an H100 run. (PTX compilation happens only on a GPU.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from attn_jax.ops.mla import indexer_pallas_triton, pallas_triton, sparse_pallas_triton
from attn_jax.ops.mla.pallas_triton import MLADecodeBlockSizes
from tests.ops.triton_lowering import export_for_h100

sds = jax.ShapeDtypeStruct


def _export_for_h100(f, *shapes):
    text, _ = export_for_h100(f, *shapes)
    assert "__gpu$xla.gpu.triton" in text
    return text


@pytest.mark.parametrize(
    "num_heads, page_size, cache_dtype, bs",
    [
        (128, 64, jnp.bfloat16, None),  # MLA-D1's defaults: two 64-head programs, 2 KV splits
        (16, 64, jnp.bfloat16, MLADecodeBlockSizes(block_h=16, pages_per_tile=1, num_kv_splits=8, num_warps=4)),
        (128, 16, jnp.float8_e4m3fn, MLADecodeBlockSizes(block_h=128, pages_per_tile=4, num_kv_splits=1)),
    ],
)
def test_decode_lowers_for_h100(num_heads, page_size, cache_dtype, bs):
    scale = {} if cache_dtype == jnp.bfloat16 else {"k_scale": jnp.float32(0.5)}

    def f(q, cache, lens, table):
        return pallas_triton.mla_decode(q, cache, lens, table, sm_scale=192**-0.5, kv_lora_rank=512, return_lse=True,
                                        interpret=False, block_sizes=bs, **scale)  # fmt: skip

    text = _export_for_h100(f, sds((64, num_heads, 576), jnp.bfloat16), sds((4200, page_size, 576), cache_dtype),
                            sds((64,), jnp.int32), sds((64, 4096 // page_size), jnp.int32))  # fmt: skip
    assert 'name = "mla_decode_triton"' in text


def test_sparse_lowers_for_h100():
    def f(q, cache, topk, qsl, lens, table):
        return sparse_pallas_triton.sparse_mla(q, cache, topk, qsl, lens, table, sm_scale=192**-0.5,
                                               kv_lora_rank=512, interpret=False)  # fmt: skip

    text = _export_for_h100(f, sds((256, 128, 576), jnp.bfloat16), sds((4200, 64, 576), jnp.bfloat16),
                            sds((256, 2048), jnp.int32), sds((5,), jnp.int32), sds((4,), jnp.int32),
                            sds((4, 64), jnp.int32))  # fmt: skip
    assert 'name = "sparse_mla_triton"' in text


@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_lightning_indexer_lowers_for_h100(key_dtype):
    """DeepSeek-V3.2's indexer (64 index heads of 128) over a 4096-token context, keys bf16 or e4m3."""

    def f(q, w, keys, qsl, lens, table):
        return indexer_pallas_triton.lightning_indexer(q, w, keys, qsl, lens, table, topk=2048, interpret=False)

    text = _export_for_h100(f, sds((256, 64, 128), jnp.bfloat16), sds((256, 64), jnp.float32),
                            sds((4200, 64, 128), key_dtype), sds((5,), jnp.int32), sds((4,), jnp.int32),
                            sds((4, 64), jnp.int32))  # fmt: skip
    assert 'name = "lightning_indexer_triton"' in text


def test_prefill_on_mosaic_gpu_lowers_for_h100():
    """DeepSeek's prefill shapes (q/k 192, v 128) through the Mosaic GPU kernel, with the Triton
    kernel writing the rows its tiles leave into the same output (traced metadata: the schedule
    computed with jnp)."""
    from attn_jax.ops.mla import prefill_pallas_mosaic_gpu

    assert prefill_pallas_mosaic_gpu.unsupported_reason(
        qk_head_dim=192, v_head_dim=128, dtype=jnp.bfloat16, max_len=4096
    ) is None  # fmt: skip
    assert "do not tile 64-key blocks" in prefill_pallas_mosaic_gpu.unsupported_reason(
        qk_head_dim=192, v_head_dim=128, dtype=jnp.bfloat16, max_len=4112
    )  # fmt: skip
    assert "k_nope head size 8 is not one of" in prefill_pallas_mosaic_gpu.unsupported_reason(
        qk_head_dim=72, v_head_dim=128, dtype=jnp.bfloat16, max_len=4096
    )  # fmt: skip
    assert "rope_dim=32" in prefill_pallas_mosaic_gpu.unsupported_reason(
        qk_head_dim=160, v_head_dim=128, dtype=jnp.bfloat16, max_len=4096, rope_dim=32
    )  # fmt: skip

    def f(q, cache, w_uk, w_uv, qsl, lens, table):
        return prefill_pallas_mosaic_gpu.mla_prefill(q, cache, w_uk, w_uv, qsl, lens, table, sm_scale=192**-0.5,
                                                     kv_lora_rank=512, q_block=1024)  # fmt: skip

    text = _export_for_h100(f, sds((2048, 16, 192), jnp.bfloat16), sds((80, 64, 576), jnp.bfloat16),
                            sds((512, 16, 128), jnp.bfloat16), sds((512, 16, 128), jnp.bfloat16),
                            sds((3,), jnp.int32), sds((2,), jnp.int32), sds((2, 32), jnp.int32))  # fmt: skip
    assert 'name = "mla_prefill_pallas_triton"' in text and "mosaic_gpu" in text
