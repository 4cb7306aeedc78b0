"""The PALLAS_MLA_GPU and PALLAS_MLA_TPU backends: MLA with the decode as a Pallas kernel.

Decodes (the absorbed MQA over the latent cache) run in ``ops/mla/pallas_triton.py`` (GPU,
Triton lowering; on Hopper, for 16 or more requests of 64 or more query heads,
``ops/mla/decode_pallas_mosaic_gpu.py``, 2x faster at DeepSeek-V3's 128 heads; off with
``ATTN_STACK_MGPU_MLA_DECODE=0``) or
``ops/mla/pallas_mosaic_tpu.py`` (Mosaic TPU). On GPU, prefills run in
``ops/mla/prefill_pallas_triton.py`` (up-projection in XLA, attention with q/k and v head sizes that
differ in a Triton kernel), on Hopper in ``ops/mla/prefill_pallas_mosaic_gpu.py`` (the Mosaic GPU
prefill kernel, the Triton kernel for the rows its tiles leave; off with ``ATTN_STACK_MGPU_PREFILL=0``,
or where ``unsupported_reason`` names why) and sparse MLA in ``sparse_pallas_triton.py``; on TPU prefills are
``mla_xla``'s jnp (``ops/mla/dense.py``). The latent write and the metadata are ``mla_xla``'s.
Forced where their hardware is absent they run the kernels in the Pallas interpreter, with a
logged warning.
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar

import jax.numpy as jnp

from attn_jax.backends.base import AttentionConfig
from attn_jax.backends.mla_xla import MLACommonBackend, XLAMLAImpl
from attn_jax.backends.pallas_gpu import mgpu_prefill_setting
from attn_jax.ops.mla import (
    decode_pallas_mosaic_gpu,
    pallas_mosaic_tpu,
    pallas_triton,
    prefill_pallas_mosaic_gpu,
    prefill_pallas_triton,
    sparse_pallas_triton,
)
from attn_jax.ops.mla.validate import validate_write
from attn_jax.ops.ragged_paged_attention import kv_write
from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available
from attn_jax.platforms import Platform, current_platform
from attn_jax.types import cache_storage_dtype

logger = logging.getLogger(__name__)


MGPU_MLA_DECODE_ENV = "ATTN_STACK_MGPU_MLA_DECODE"
"""Set to ``0`` to keep MLA decodes on the Triton kernel on Hopper."""


MGPU_MLA_DECODE_MIN_REQS = 16
"""Decode rows (requests) from which the Mosaic GPU MLA decode serves. Through the layer on an
H100 (BENCHMARKS.md) it won at 16, 32 and 64 requests; at one request, where the call is
host-bound, one run found it 100 us behind the Triton kernel and another within noise."""


def mgpu_mla_decode_setting() -> bool:
    """``ATTN_STACK_MGPU_MLA_DECODE``: read when the impl is made and by ``kernel_plan``."""
    return os.environ.get(MGPU_MLA_DECODE_ENV, "1") != "0"


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _PallasMLAImpl(XLAMLAImpl):
    """``XLAMLAImpl`` with the decode in a kernel; ``interpret`` None: compiled on ``platform_kind``."""

    backend_name: ClassVar[str]
    platform_kind: ClassVar[str]

    def __init__(self, *args, interpret: bool | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if interpret is None:
            platform = current_platform()
            interpret = platform.kind != self.platform_kind
            if interpret:
                logger.warning("%s runs in the Pallas interpreter on platform %s (no %s): correct but slow",
                               self.backend_name, platform, self.platform_kind.upper())  # fmt: skip
        self.interpret = interpret


class PallasMLAGPUImpl(_PallasMLAImpl):
    backend_name, platform_kind = "PALLAS_MLA_GPU", "gpu"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dims = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        self.triton_prefill = all(d >= 16 and d & (d - 1) == 0 for d in dims)
        if not self.triton_prefill:
            logger.warning("PALLAS_MLA_GPU: qk_nope/qk_rope/v head dims %s are not all powers of two >= 16: "
                           "prefills run in jnp (ops/mla/dense.py), not the Triton prefill kernel", dims)  # fmt: skip
        # Read once, here at the edge: the Mosaic GPU prefill on Hopper (compiled) unless turned off.
        platform = current_platform()
        self.device_kind = platform.device_kind if platform.kind == "gpu" else None  # the decode's default blocks
        hopper = mgpu_prefill_available(self.device_kind)
        self.mgpu_prefill = self.triton_prefill and not self.interpret and mgpu_prefill_setting() and hopper
        # Measured (BENCHMARKS.md): 2x the Triton kernel at 128 heads; 5-10 % behind it at 16
        # heads, which the kernel pads to its 64-head wgmma rows. Small batches: MGPU_MLA_DECODE_MIN_REQS.
        self.mgpu_decode = (
            not self.interpret and hopper and mgpu_mla_decode_setting()
            and self.num_heads >= decode_pallas_mosaic_gpu.BLOCK_H
        )  # fmt: skip

    def write_latents(self, kv_cache, kv_c, k_pe, slot_mapping, k_scale=None):
        """Compiled: the Pallas k/v write with one plane (``kv_write.write_latents``), the rows
        stored at copy speed where XLA's scatter took 4-5x longer (BENCHMARKS.md)."""
        if self.interpret:
            return super().write_latents(kv_cache, kv_c, k_pe, slot_mapping, k_scale)
        validate_write(kv_cache, kv_c, k_pe, slot_mapping, kv_lora_rank=self.kv_lora_rank, k_scale=k_scale)
        latents = jnp.concatenate([kv_c, k_pe], axis=-1)
        return kv_write.write_latents(kv_cache, latents, slot_mapping, k_scale, interpret=False)

    def prefill(self, q, kv_cache, w_uk, w_uv, md, k_scale=None):
        if not self.triton_prefill:
            return super().prefill(q, kv_cache, w_uk, w_uv, md, k_scale)
        max_len = md.prefill_block_tables.shape[1] * kv_cache.shape[1]
        if self.mgpu_prefill and prefill_pallas_mosaic_gpu.unsupported_reason(
            qk_head_dim=q.shape[2], v_head_dim=self.v_head_dim, dtype=q.dtype, max_len=max_len,
            rope_dim=kv_cache.shape[2] - self.kv_lora_rank,
        ) is None:  # fmt: skip
            return prefill_pallas_mosaic_gpu.mla_prefill(
                q, kv_cache, w_uk, w_uv, md.prefill_query_start_loc, md.prefill_seq_lens, md.prefill_block_tables,
                sm_scale=self.scale, kv_lora_rank=self.kv_lora_rank, q_block=md.prefill_q_block, k_scale=k_scale,
                block_q=min(64, max(16, md.prefill_q_block)),
            )  # fmt: skip
        return prefill_pallas_triton.mla_prefill(
            q, kv_cache, w_uk, w_uv, md.prefill_query_start_loc, md.prefill_seq_lens, md.prefill_block_tables,
            sm_scale=self.scale, kv_lora_rank=self.kv_lora_rank, q_block=md.prefill_q_block, k_scale=k_scale,
            interpret=self.interpret, block_q=min(64, max(16, md.prefill_q_block)),
        )  # fmt: skip

    def decode(self, q_abs, kv_cache, seq_lens, block_tables, k_scale=None):
        _, page_size, width = kv_cache.shape
        mosaic = self.mgpu_decode and q_abs.shape[0] >= MGPU_MLA_DECODE_MIN_REQS
        if mosaic and decode_pallas_mosaic_gpu.unsupported_reason(
            kv_lora_rank=self.kv_lora_rank, width=width, page_size=page_size, dtype=q_abs.dtype,
            cache_dtype=kv_cache.dtype,
        ) is None:  # fmt: skip
            return decode_pallas_mosaic_gpu.mla_decode(q_abs, kv_cache, seq_lens, block_tables, sm_scale=self.scale,
                                                       kv_lora_rank=self.kv_lora_rank)  # fmt: skip
        return pallas_triton.mla_decode(q_abs, kv_cache, seq_lens, block_tables, sm_scale=self.scale,
                                        kv_lora_rank=self.kv_lora_rank, interpret=self.interpret,
                                        k_scale=k_scale, device_kind=self.device_kind)  # fmt: skip

    def sparse(self, q_abs, kv_cache, topk_positions, md, k_scale=None):
        return sparse_pallas_triton.sparse_mla(
            q_abs, kv_cache, topk_positions, md.query_start_loc, md.seq_lens, md.block_tables, sm_scale=self.scale,
            kv_lora_rank=self.kv_lora_rank, interpret=self.interpret,
            block_h=min(64, max(16, _pow2_at_least(self.num_heads))), k_scale=k_scale,
        )  # fmt: skip


class PallasMLATPUImpl(_PallasMLAImpl):
    backend_name, platform_kind = "PALLAS_MLA_TPU", "tpu"

    def decode(self, q_abs, kv_cache, seq_lens, block_tables, k_scale=None):
        return pallas_mosaic_tpu.mla_decode(q_abs, kv_cache, seq_lens, block_tables, sm_scale=self.scale,
                                     kv_lora_rank=self.kv_lora_rank, interpret=self.interpret,
                                     k_scale=k_scale)  # fmt: skip


class PallasMLAGPUBackend(MLACommonBackend):
    """MLA decode (and sparse MLA) in Pallas GPU kernels (Triton lowering). The latent row must
    split into power-of-two parts: ``head_size = kv_lora_rank + 64`` with a power-of-two
    kv_lora_rank (DeepSeek's 576 = 512 + 64); block sizes powers of two."""

    supports_sparse = True

    @staticmethod
    def get_name() -> str:
        return "PALLAS_MLA_GPU"

    @staticmethod
    def get_impl_cls() -> type[PallasMLAGPUImpl]:
        return PallasMLAGPUImpl

    @classmethod
    def kernel_plan(
        cls, head_size: int, dtype, kv_cache_dtype, block_size: int, device_kind: str | None, *, causal: bool = True,
        has_sink: bool = False, query_quant: bool = False, qk_nope_head_dim: int = 128, v_head_dim: int = 128,
    ) -> list[str]:  # fmt: skip
        """Which kernel serves which batches, in words (``attn-stack info --use-mla``), for
        DeepSeek's head dims by default (nope 128 + rope 64 for q/k, v 128)."""
        qk = qk_nope_head_dim + 64
        triton_decode = (
            "decodes: the absorbed MQA over the latent cache in one Triton-lowered Pallas launch (pallas_triton)"
        )
        hopper = mgpu_prefill_available(device_kind)
        decode_reason = decode_pallas_mosaic_gpu.unsupported_reason(
            kv_lora_rank=head_size - 64, width=head_size, page_size=block_size, dtype=dtype,
            cache_dtype=cache_storage_dtype(kv_cache_dtype, dtype),
        )  # fmt: skip
        if not hopper:
            decode = f"{triton_decode} (the Mosaic GPU MLA decode needs Hopper)"
        elif not mgpu_mla_decode_setting():
            decode = f"{triton_decode} (Mosaic GPU MLA decode turned off: {MGPU_MLA_DECODE_ENV}=0)"
        elif decode_reason is not None:
            decode = f"{triton_decode} ({decode_reason})"
        else:
            decode = (
                f"decodes: batches of >= {MGPU_MLA_DECODE_MIN_REQS} requests with >= "
                f"{decode_pallas_mosaic_gpu.BLOCK_H} query heads the Mosaic GPU MLA decode kernel "
                "(decode_pallas_mosaic_gpu), others the Triton-lowered one (pallas_triton)"
            )
        lines = [decode, "sparse MLA: the Triton-lowered sparse kernel (sparse_pallas_triton)"]
        triton = f"prefills: up-projected in XLA, attention (q/k {qk}, v {v_head_dim}) in the Triton kernel"
        if not hopper:
            return [*lines, f"{triton} (the Mosaic GPU prefill needs Hopper; device {device_kind!r})"]
        if not mgpu_prefill_setting():
            return [*lines, f"{triton} (Mosaic GPU prefill turned off: ATTN_STACK_MGPU_PREFILL=0)"]
        max_len = -(-4096 // block_size) * block_size  # a bucket of requests up to 4096 tokens
        reason = prefill_pallas_mosaic_gpu.unsupported_reason(
            qk_head_dim=qk, v_head_dim=v_head_dim, dtype=dtype, max_len=max_len
        )  # fmt: skip
        if reason is not None:
            return [*lines, f"{triton} ({reason})"]
        mosaic = "the Mosaic GPU prefill kernel (prefill_pallas_mosaic_gpu), the rows its tiles leave in the Triton one"
        return [*lines, f"prefills: up-projected in XLA, attention (q/k {qk}, v {v_head_dim}) in {mosaic}"]

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """The latent width (kv_lora_rank a power of two) and power-of-two pages the kernel tiles."""
        reasons = super().backend_reasons(config, platform)
        head_size, block_size = config.head_size, config.block_size
        rank = head_size - 64
        if rank < 16 or rank & (rank - 1):
            reasons.append(f"head_size={head_size} is not supported; supported: kv_lora_rank + 64 with kv_lora_rank "
                           "a power of two >= 16, e.g. 576 = 512 + 64")  # fmt: skip
        if block_size & (block_size - 1):
            reasons.append(f"block_size={block_size} is not supported; supported: powers of two (16, 64, ...)")
        return reasons


class PallasMLATPUBackend(MLACommonBackend):
    """MLA decode in a Pallas Mosaic TPU kernel; block sizes multiples of 16."""

    @staticmethod
    def get_name() -> str:
        return "PALLAS_MLA_TPU"

    @staticmethod
    def get_impl_cls() -> type[PallasMLATPUImpl]:
        return PallasMLATPUImpl

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """Pages in multiples of 16 rows (the kernel's sublane tiles)."""
        reasons = super().backend_reasons(config, platform)
        if config.block_size % 16:
            reasons.append(f"block_size={config.block_size} is not supported; supported: multiples of 16 (16, 64, ...)")
        return reasons
