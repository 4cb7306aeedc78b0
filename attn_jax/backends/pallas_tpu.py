"""The Pallas TPU backend: ragged paged attention as one Mosaic TPU kernel (pallas_mosaic_tpu.py).

The default on TPU platforms. Forced where no TPU exists (``global_force_attn_backend``
or ``ATTN_STACK_BACKEND=PALLAS_TPU``), it runs the same kernel in the TPU interpreter
(``pltpu.InterpretParams()``): correct and slow, with a logged warning.

Its KV cache is the kernel's layout ``[num_blocks, Hkv, block_size, 2 * D]`` (K and V
interleaved on the last axis; see ``pallas_mosaic_tpu``). ``write_to_kv_cache`` writes it (the
cross-attention path), ``to_reference_layout`` views it as the reference's
``[2, P, S, Hkv, D]`` for tests and notebooks.

Cascade attention (a prefix the whole batch shares, read once) runs as on the other backends:
``cascade_ragged_paged_attention`` with the kernel for both parts (``return_lse``), chosen by
the XLA builder's ``use_cascade_attention`` and thresholds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.base import AttentionBackend, AttentionConfig, validate_kv_cache_dims
from attn_jax.backends.pallas import PallasKernelImpl
from attn_jax.backends.xla import XLAMetadataBuilder
from attn_jax.ops.ragged_paged_attention import pallas_mosaic_tpu
from attn_jax.ops.ragged_paged_attention.config import TpuBlockSizes, tpu_block_sizes
from attn_jax.ops.ragged_paged_attention.validate import is_concrete
from attn_jax.platforms import Platform, current_platform
from attn_jax.types import is_quantized_kv_cache

Array = Any

to_reference_layout = pallas_mosaic_tpu.to_reference_layout
from_reference_layout = pallas_mosaic_tpu.from_reference_layout


def write_to_kv_cache(kv_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
    """``kv_cache.write_to_kv_cache`` for the PALLAS_TPU layout ``[P, Hkv, S, 2D]``."""
    return pallas_mosaic_tpu.write_to_tpu_kv_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class PallasTPUAttentionMetadata:
    """What the TPU kernel needs for one batch: the index arrays, the q-block schedule
    (``pallas_mosaic_tpu.tpu_schedule``, computed on the host when the metadata is concrete) and
    the bucket's block sizes (static: part of the jit key)."""

    query_start_loc: Array  # i32[R + 1]
    seq_lens: Array  # i32[R]
    block_tables: Array  # i32[R, pages_per_req]
    slot_mapping: Array  # i32[T]
    schedule: Array  # i32[2 * ceil(T / q_tokens_per_block)]
    block_sizes: TpuBlockSizes = dataclasses.field(metadata=dict(static=True))
    # Cascade attention (``build(common_prefix_len > 0, ...)``): as ``XLAAttentionMetadata``'s. Its
    # two parts take the kernel's own block sizes and schedules (``block_sizes`` is the whole batch's).
    cascade_prefix_len: Array | None = None  # i32[]


class PallasTPUMetadataBuilder(XLAMetadataBuilder):
    """Builds ``PallasTPUAttentionMetadata``: the XLA builder's arrays (virtual batches for
    chunked local attention included) plus block sizes and the schedule.

    The spec does not carry the query head count, so block sizes are chosen for a head
    group of 1: ``q_tokens_per_block`` a multiple of the sublane tile, which tiles every
    group, and ``kv_heads_per_block`` left to the kernel (None), which knows the group.
    With concrete (NumPy) metadata everything is computed on the host, the SMEM budget of
    the bucket is checked (ValueError naming the limit), and a decode-only bucket gets
    decode block sizes. Traced metadata (``build`` inside ``jit``) derives the schedule
    with jnp; block sizes then depend on the shapes only. A ``common_prefix_len`` (whole
    pages of it) turns cascade attention on, with the XLA builder's thresholds.
    """

    # The block sizes follow the table's width and its SMEM budget is checked per bucket, so the
    # width stays bucketed (a fixed width, as tpu-inference has, was not tried on a TPU).
    reads_live_pages_only = False

    def __init__(self, kv_cache_spec, device_kind: str | None = None) -> None:
        super().__init__(kv_cache_spec)
        if device_kind is None:
            platform = current_platform()
            device_kind = platform.device_kind if platform.kind == "tpu" else None
        self.device_kind = device_kind

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return self._build(common_attn_metadata, common_prefix_len=common_prefix_len)

    def build_for_jit(self, common_attn_metadata, step_query_lens=None, common_prefix_len=0):
        return self._build(common_attn_metadata, step_query_lens, common_prefix_len)

    def _build(self, common_attn_metadata, step_query_lens=None, common_prefix_len=0) -> PallasTPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata)  # its cascade_prefix_len, its refusals
        spec = self.kv_cache_spec
        num_tokens = base.slot_mapping.shape[0]
        num_reqs, pages_per_req = base.block_tables.shape
        concrete = is_concrete(base.query_start_loc, base.seq_lens, base.block_tables, base.slot_mapping)
        qsl = np.asarray(base.query_start_loc) if concrete else base.query_start_loc
        query_lens = None
        if concrete:  # the block sizes follow the whole step's query lengths when given
            query_lens = np.diff(qsl) if step_query_lens is None else np.asarray(step_query_lens)
        decode_only = bool(concrete and np.all(query_lens <= 1))
        max_query_len = int(query_lens.max(initial=0)) if concrete else None
        dtype = np.dtype(spec.dtype)
        bs = tpu_block_sizes(
            q_dtype=dtype, kv_dtype=dtype, group=1, head_size=spec.head_size, page_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads, num_tokens=num_tokens, pages_per_req=pages_per_req,
            decode_only=decode_only, max_query_len=max_query_len, device_kind=self.device_kind,
        )  # fmt: skip
        bs = dataclasses.replace(bs, kv_heads_per_block=None)  # the kernel picks it for the real head group
        bq = bs.q_tokens_per_block
        padded = -(-num_tokens // bq) * bq
        pallas_mosaic_tpu.check_smem_capacity(
            num_reqs=num_reqs, pages_per_req=pages_per_req, num_tokens=padded, q_tokens_per_block=bq
        )
        if concrete:
            schedule = pallas_mosaic_tpu.tpu_schedule(qsl.astype(np.int32), padded, bq, xp=np)
        else:
            schedule = pallas_mosaic_tpu.tpu_schedule(jnp.asarray(qsl, jnp.int32), padded, bq)
        return PallasTPUAttentionMetadata(
            query_start_loc=base.query_start_loc, seq_lens=base.seq_lens, block_tables=base.block_tables,
            slot_mapping=base.slot_mapping, schedule=schedule, block_sizes=bs,
            cascade_prefix_len=base.cascade_prefix_len,
        )  # fmt: skip


class PallasTPUAttentionImpl(PallasKernelImpl):
    """Calls ``pallas_mosaic_tpu.ragged_paged_attention`` with the layer's hyperparameters; compiled on
    a TPU platform, the TPU interpreter elsewhere (with a logged warning)."""

    backend_name = "PALLAS_TPU"
    platform_kind = "tpu"
    interpreter = "TPU interpreter"
    op = staticmethod(pallas_mosaic_tpu.ragged_paged_attention)
    metadata_cls = PallasTPUAttentionMetadata

    def __init__(self, *args, interpret: bool | None = None, **kwargs) -> None:
        super().__init__(*args, interpret=interpret, **kwargs)
        pallas_mosaic_tpu.check_tpu_shapes(head_size=self.head_size)


class PallasTPUAttentionBackend(AttentionBackend):
    """Ragged paged attention as one Pallas kernel on Mosaic TPU; every feature of the op."""

    supports_quant_query_input = True  # FP8 attention: e4m3 x e4m3 dots on TPU v7x (FP8_QUERY_TPU_KINDS)

    supports_sink = True
    supported_dtypes: ClassVar[tuple[np.dtype, ...]] = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
    )  # fmt: skip

    write_to_kv_cache = staticmethod(write_to_kv_cache)  # the module's writer, for [P, Hkv, S, 2D]

    @staticmethod
    def get_name() -> str:
        return "PALLAS_TPU"

    @staticmethod
    def get_impl_cls() -> type[PallasTPUAttentionImpl]:
        return PallasTPUAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[PallasTPUAttentionMetadata]:
        return PallasTPUAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[PallasTPUMetadataBuilder]:
        return PallasTPUMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return pallas_mosaic_tpu.SUPPORTED_HEAD_SIZES

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return pallas_mosaic_tpu.SUPPORTED_PAGE_SIZES

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: K then V on the last axis.

        The reference layout ``(2, num_blocks, block_size, num_kv_heads, head_size)``
        permuted by ``(1, 3, 2, 0, 4)`` with the last two axes merged.
        """
        validate_kv_cache_dims(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        return pallas_mosaic_tpu.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2, 3)

    @staticmethod
    def get_required_kv_cache_layout() -> str | None:
        return "HND"

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """FP8 attention on a TPU without an fp8 MXU; fp8 pages below the sublane packing."""
        reasons = super().backend_reasons(config, platform)
        kv_cache_dtype, block_size = config.kv_cache_dtype, config.block_size
        kind = platform.device_kind if platform is not None and platform.kind == "tpu" else None
        if config.query_quant and kind is not None and kind not in pallas_mosaic_tpu.FP8_QUERY_TPU_KINDS:
            reasons.append(
                f"FP8 attention (query_quant=True) needs a TPU with an fp8 MXU "
                f"{list(pallas_mosaic_tpu.FP8_QUERY_TPU_KINDS)} (Mosaic lowers e4m3 x e4m3 matmuls for TPU v7x "
                f"only); device {kind!r} has none"
            )
        if is_quantized_kv_cache(kv_cache_dtype) and block_size < pallas_mosaic_tpu.FP8_MIN_PAGE_SIZE:
            reasons.append(
                f"kv_cache_dtype={kv_cache_dtype!r} with block_size={block_size}: fp8 pages need "
                f"block_size >= {pallas_mosaic_tpu.FP8_MIN_PAGE_SIZE} (fp8 packs {pallas_mosaic_tpu.FP8_MIN_PAGE_SIZE} "
                "rows per sublane tile)"
            )
        return reasons
