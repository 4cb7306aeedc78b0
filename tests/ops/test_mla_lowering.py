"""The MLA Triton kernels lower from Pallas to Triton IR for an H100 from this CPU machine
(``jax.export`` under an abstract H100 device), at DeepSeek-V3 shapes: a kernel that
cannot be lowered fails here, before an H100 run. (PTX compilation happens only on a GPU.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from attn_jax.ops.mla import pallas_triton, sparse_pallas_triton
from attn_jax.ops.mla.pallas_triton import MLADecodeBlockSizes

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
sds = jax.ShapeDtypeStruct


def _export_for_h100(f, *shapes):
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H100)):
        exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[TRITON])(*shapes)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",) and "__gpu$xla.gpu.triton" in text
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
