"""The Pallas GPU backend: ragged paged attention as Pallas kernels (kernel_gpu.py, kernel_mgpu.py).

One Triton-lowered kernel serves every batch; on Hopper GPUs (unless ``MGPU_PREFILL_ENV``
is 0) the long prefill requests of a batch run in a Mosaic GPU kernel instead (TMA,
warpgroup MMA; ``kernel_mgpu``) when the layer's configuration allows it (causal, no
window / soft cap / ALiBi / sinks, 16-bit activations and cache, head size 64 or 128),
and new keys and values are written by a Pallas kernel (``kv_write``).

The default on GPU platforms. Forced where no GPU exists (``global_force_attn_backend``
or ``ATTN_STACK_BACKEND=PALLAS_GPU``), it runs the same kernel in the Pallas interpreter
(``interpret=True``): correct and slow, with a logged warning.

Its KV cache is the XLA backend's NHD layout ``[2, num_blocks, block_size, Hkv, D]``, so
new keys and values go through ``attn_jax.kv_cache.write_to_kv_cache`` (a scatter XLA
runs in place when the cache is donated) and caches move between XLA and PALLAS_GPU
unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.pallas import PallasKernelImpl
from attn_jax.backends.xla import XLAAttentionBackend, XLAMetadataBuilder
from attn_jax.ops.ragged_paged_attention import kernel_gpu, kernel_mgpu
from attn_jax.ops.ragged_paged_attention.config import (
    GpuBlockSizes,
    gpu_batch_mode,
    gpu_block_sizes,
    mgpu_block_sizes,
    mgpu_prefill_available,
)
from attn_jax.ops.ragged_paged_attention.validate import is_concrete
from attn_jax.platforms import Platform, current_platform

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class PallasGPUAttentionMetadata:
    """What the GPU kernel needs for one batch: the index arrays, the q-block schedule
    (``kernel_gpu.gpu_schedule``, on the host when the metadata is concrete) and the
    bucket's block sizes (static: part of the jit key)."""

    query_start_loc: Array  # i32[R + 1]
    seq_lens: Array  # i32[R]
    block_tables: Array  # i32[R, pages_per_req]
    slot_mapping: Array  # i32[T]
    schedule: Array  # i32[5, NB]: per q-block request, token range, first position, kv length
    block_sizes: GpuBlockSizes = dataclasses.field(metadata=dict(static=True))
    # The Mosaic GPU prefill split (``mgpu_split``), else None: its q-tiles, and the q-blocks
    # of the rows it leaves over (None: it serves every row).
    mgpu_schedule: Array | None = None  # i32[4, NT]
    rest_schedule: Array | None = None  # i32[5, NB]
    mgpu_block_sizes: kernel_mgpu.MgpuBlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))


def mgpu_split(
    query_start_loc, seq_lens, *, num_tokens: int, block_q: int, mgpu_bs: kernel_mgpu.MgpuBlockSizes | None = None,
    step_query_lens=None,
) -> dict:  # fmt: skip
    """Host metadata's Mosaic GPU prefill split as metadata fields, or {} when no request is
    long enough: ``mgpu_schedule``, ``rest_schedule`` (None when the Mosaic GPU kernel
    serves every row) and ``mgpu_block_sizes``.

    With ``step_query_lens`` (i32[N], the whole step's query lengths when data shards build
    their metadata separately) the fields follow the step, so every shard has the same
    structure: present when a request of the step has at least ``tile + 14`` new tokens
    (an 8-aligned span of a whole tile wherever it starts), with ``rest_schedule`` always
    there; a shard with no such request gets tiles that are all empty (skipped)."""
    bs = mgpu_bs or kernel_mgpu.MgpuBlockSizes()
    if step_query_lens is not None and not (np.asarray(step_query_lens) >= bs.tile + 14).any():
        return {}
    mgpu, rest = kernel_gpu.split_schedules(
        np.asarray(query_start_loc), np.asarray(seq_lens), num_tokens=num_tokens, block_q=block_q, tile=bs.tile,
        xp=np,
    )  # fmt: skip
    if step_query_lens is not None:
        return dict(mgpu_schedule=mgpu, rest_schedule=rest, mgpu_block_sizes=bs)
    if not (mgpu[3] > 0).any():
        return {}
    rest_empty = not (rest[2] > rest[1]).any()
    return dict(mgpu_schedule=mgpu, rest_schedule=None if rest_empty else rest, mgpu_block_sizes=bs)


MGPU_PREFILL_ENV = "ATTN_STACK_MGPU_PREFILL"
"""``0`` turns the Mosaic GPU prefill split off in ``PallasGPUMetadataBuilder`` (read when a
builder is made); on by default on Hopper. On the H100 it took P1's attention from 1.81
to 1.03 ms, and whole prefill steps in the serving engine were as fast or faster (up to
3x for one 8000-token SmolLM2 prompt; level, within one run's noise, at 4 x 4096 on the
Llama-3-8B shape); with the real SmolLM2 weights its greedy tokens equal the Triton
path's in bf16 up to the near-ties bf16 flips on any path (BENCHMARKS.md, 2026-11-24)."""


class PallasGPUMetadataBuilder(XLAMetadataBuilder):
    """Builds ``PallasGPUAttentionMetadata``: the XLA builder's arrays (virtual batches for
    chunked local attention included) plus block sizes and the schedule.

    With concrete (NumPy) metadata the batch mode (decode / prefill / mixed) and the
    schedule are computed on the host; traced metadata (``build`` inside ``jit``) derives
    the schedule with jnp and uses the "mixed" block sizes. Block sizes depend only on the
    bucket's shapes and the mode, so a bucket compiles at most three times.

    With ``mgpu_prefill`` (the argument, else on unless ``ATTN_STACK_MGPU_PREFILL=0``, see
    ``MGPU_PREFILL_ENV``) on Hopper GPUs (``config.mgpu_prefill_available``), host
    metadata of a prefill batch (no decodes) gets the Mosaic GPU split (``mgpu_split``): the kernel then runs the long
    requests in ``kernel_mgpu`` when the layer's configuration allows it
    (``kernel_mgpu.unsupported_reason``) and everything in the Triton kernel otherwise.
    Mixed batches stay on the Triton kernel alone: on the H100, DESIGN.md's M1 (4 chunks of
    512 + 60 decodes) took 0.369 ms there against 0.388 ms split in two launches
    (BENCHMARKS.md), its time being the decodes' KV reads. Whether the split is there is
    part of the jit key: a prefill bucket compiles once more.
    """

    def __init__(self, kv_cache_spec, device_kind: str | None = None, mgpu_prefill: bool | None = None) -> None:
        super().__init__(kv_cache_spec)
        if device_kind is None:
            platform = current_platform()
            device_kind = platform.device_kind if platform.kind == "gpu" else None
        self.device_kind = device_kind
        if mgpu_prefill is None:  # read once, here at the edge (never under ops/)
            mgpu_prefill = os.environ.get(MGPU_PREFILL_ENV, "1") != "0"
        self.mgpu_prefill = mgpu_prefill and mgpu_prefill_available(device_kind)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return self._build(common_attn_metadata)

    def build_for_jit(self, common_attn_metadata, step_query_lens=None):
        return self._build(common_attn_metadata, step_query_lens)

    def advance_decode(self, metadata, steps, active):
        """The XLA builder's move, plus each real q-block's first position and KV length
        (a decode batch's q-block holds one request's token)."""
        out = super().advance_decode(metadata, steps, active)
        schedule = jnp.asarray(metadata.schedule)
        delta = jnp.where(schedule[4] > 0, steps[schedule[0]], 0).astype(schedule.dtype)
        return dataclasses.replace(out, schedule=schedule.at[3].add(delta).at[4].add(delta))

    def _build(self, common_attn_metadata, step_query_lens=None) -> PallasGPUAttentionMetadata:
        base = super().build(0, common_attn_metadata)
        spec = self.kv_cache_spec
        num_tokens = base.slot_mapping.shape[0]
        num_reqs, pages_per_req = base.block_tables.shape
        concrete = is_concrete(base.query_start_loc, base.seq_lens)
        if concrete:
            own = np.diff(np.asarray(base.query_start_loc))
            mode = gpu_batch_mode(own if step_query_lens is None else np.asarray(step_query_lens))
        else:  # traced: only shapes are known; a bucket with no more tokens than requests is decode
            mode = "decode" if num_tokens <= num_reqs else "mixed"
        num_q_heads = spec.num_q_heads or spec.num_kv_heads
        bs = gpu_block_sizes(
            num_reqs=num_reqs, pages_per_req=pages_per_req, page_size=spec.block_size, head_size=spec.head_size,
            num_kv_heads=spec.num_kv_heads, group=num_q_heads // spec.num_kv_heads, mode=mode,
            device_kind=self.device_kind,
        )  # fmt: skip
        xp = np if concrete else jnp
        schedule = kernel_gpu.gpu_schedule(
            xp.asarray(base.query_start_loc), xp.asarray(base.seq_lens), num_tokens=num_tokens,
            block_q=bs.block_q, xp=xp,
        )  # fmt: skip
        split = {}
        if concrete and mode == "prefill" and self.mgpu_prefill:
            mbs = mgpu_block_sizes(head_size=spec.head_size, device_kind=self.device_kind)
            split = mgpu_split(
                base.query_start_loc, base.seq_lens, num_tokens=num_tokens, block_q=bs.block_q, mgpu_bs=mbs,
                step_query_lens=step_query_lens,
            )  # fmt: skip
        return PallasGPUAttentionMetadata(
            query_start_loc=base.query_start_loc, seq_lens=base.seq_lens, block_tables=base.block_tables,
            slot_mapping=base.slot_mapping, schedule=schedule, block_sizes=bs, **split,
        )  # fmt: skip


class PallasGPUAttentionImpl(PallasKernelImpl):
    """Calls ``kernel_gpu.ragged_paged_attention`` with the layer's hyperparameters; compiled on
    a GPU platform, the Pallas interpreter elsewhere (with a logged warning)."""

    backend_name = "PALLAS_GPU"
    platform_kind = "gpu"
    interpreter = "Pallas interpreter"
    kernel = kernel_gpu
    metadata_cls = PallasGPUAttentionMetadata

    def kernel_kwargs(self, md) -> dict:
        return dict(
            mgpu_schedule=md.mgpu_schedule, rest_schedule=md.rest_schedule, mgpu_block_sizes=md.mgpu_block_sizes
        )


class PallasGPUAttentionBackend(XLAAttentionBackend):
    """Ragged paged attention as one Pallas kernel on GPU (Triton lowering); every feature of
    the op; the XLA backend's cache layout."""

    supports_sink = True
    supported_dtypes: ClassVar[tuple[np.dtype, ...]] = (
        np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16),
    )  # fmt: skip

    @staticmethod
    def get_name() -> str:
        return "PALLAS_GPU"

    @staticmethod
    def get_impl_cls() -> type[PallasGPUAttentionImpl]:
        return PallasGPUAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[PallasGPUAttentionMetadata]:
        return PallasGPUAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[PallasGPUMetadataBuilder]:
        return PallasGPUMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return kernel_gpu.SUPPORTED_HEAD_SIZES

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return kernel_gpu.SUPPORTED_PAGE_SIZES

    @classmethod
    def kernel_plan(
        cls, head_size: int, dtype, kv_cache_dtype, block_size: int, device_kind: str | None, *, causal: bool = True,
        sliding_window=None, logits_soft_cap=None, has_alibi: bool = False, has_sink: bool = False,
    ) -> list[str]:  # fmt: skip
        """Which kernel serves which batches for this layer configuration, in words (for ``attn-stack info``)."""
        lines = [
            "decode and mixed batches: one Triton-lowered Pallas launch (kernel_gpu)",
            "k/v write: a Pallas kernel storing whole token rows in place (kv_write)",
        ]
        if not mgpu_prefill_available(device_kind):
            lines.append(
                f"prefill batches: the Triton kernel (Mosaic GPU prefill needs Hopper; device {device_kind!r})"
            )
            return lines
        if os.environ.get(MGPU_PREFILL_ENV, "1") == "0":
            lines.append(f"prefill batches: the Triton kernel (Mosaic GPU prefill turned off: {MGPU_PREFILL_ENV}=0)")
            return lines
        reason = kernel_mgpu.unsupported_reason(
            head_size=head_size, page_size=block_size, dtype=dtype, cache_dtype=kv_cache_dtype, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            alibi_slopes=True if has_alibi else None, sinks=True if has_sink else None,
        )  # fmt: skip
        tile = kernel_mgpu.MgpuBlockSizes().tile
        if reason is None:
            lines.append(
                f"prefill batches: requests with >= {tile} 8-aligned new tokens on the Mosaic GPU kernel "
                "(kernel_mgpu: TMA per page, wgmma), the other rows on the Triton kernel"
            )
        else:
            lines.append(f"prefill batches: the Triton kernel ({reason})")
        return lines

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return None  # runs everywhere: compiled on a GPU, in the interpreter elsewhere (forced only)
