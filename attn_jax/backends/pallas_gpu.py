"""The Pallas GPU backend: ragged paged attention as Pallas kernels (pallas_triton.py, pallas_mosaic_gpu.py).

One Triton-lowered kernel serves every batch; on Hopper GPUs (unless ``MGPU_PREFILL_ENV``
is 0) the long prefill requests of a batch run in a Mosaic GPU kernel instead (TMA,
warpgroup MMA; ``pallas_mosaic_gpu``) when the layer's configuration allows it (causal, no
window / soft cap / ALiBi / sinks, 16-bit activations and cache, head size 64 or 128),
and new keys and values are written by a Pallas kernel (``kv_write``). The dispatch
between the two lowerings is ``ragged_paged_attention`` here.

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
import functools
import logging
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.base import AttentionConfig
from attn_jax.backends.pallas import PallasKernelImpl
from attn_jax.backends.xla import XLAAttentionBackend, XLAMetadataBuilder
from attn_jax.ops.ragged_paged_attention import pallas_mosaic_gpu, pallas_triton
from attn_jax.ops.ragged_paged_attention.cascade import prefix_part_lens, shifted_block_tables
from attn_jax.ops.ragged_paged_attention.config import (
    FMA_DOT_ROWS,
    H100_NUM_SMS,
    GpuBlockChoice,
    GpuBlockSizes,
    MgpuBlockSizes,
    decode_part_block_sizes,
    fma_dots,
    gpu_batch_mode,
    gpu_block_choice,
    mgpu_block_sizes,
    mgpu_prefill_available,
    next_pow2,
)
from attn_jax.ops.ragged_paged_attention.validate import is_concrete
from attn_jax.platforms import Platform, current_platform

Array = Any
logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class PallasGPUAttentionMetadata:
    """What the GPU kernel needs for one batch: the index arrays, the q-block schedule
    (``pallas_triton.gpu_schedule``, on the host when the metadata is concrete) and the
    bucket's block sizes (static: part of the jit key)."""

    query_start_loc: Array  # i32[R + 1]
    seq_lens: Array  # i32[R]
    block_tables: Array  # i32[R, pages_per_req]
    slot_mapping: Array  # i32[T]
    schedule: Array  # i32[5, NB]: per q-block request, token range, first position, kv length
    block_sizes: GpuBlockSizes = dataclasses.field(metadata=dict(static=True))
    # A mixed batch's decodes on decode blocks in the same launch (``schedule`` from
    # ``pallas_triton.mixed_schedule``), else None.
    decode_block_sizes: GpuBlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))
    # The Mosaic GPU prefill split (``mgpu_split``), else None: its q-tiles, and the q-blocks
    # of the rows it leaves over (None: it serves every row).
    mgpu_schedule: Array | None = None  # i32[4, NT]
    rest_schedule: Array | None = None  # i32[5, NB]
    mgpu_block_sizes: MgpuBlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))
    cascade_prefix_len: Array | None = None  # i32[]: as ``XLAAttentionMetadata``'s
    # Cascade attention's prefix part (every row as one request over the prefix's pages): its
    # blocks (``PallasGPUMetadataBuilder.cascade_block_sizes``) and q-blocks; the suffix part's
    # blocks (``cascade_suffix_block_sizes``), q-blocks (KV lengths less the prefix) and tables
    # (moved left by the prefix's pages): built once per step, not in every layer's call.
    cascade_block_sizes: GpuBlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))
    cascade_schedule: Array | None = None  # i32[5, cdiv(T, block_q) + 2]
    cascade_suffix_block_sizes: GpuBlockSizes | None = dataclasses.field(default=None, metadata=dict(static=True))
    cascade_suffix_schedule: Array | None = None  # i32[5, NB]
    cascade_suffix_tables: Array | None = None  # i32[R, pages_per_req]


def launch_mode(query_lens) -> str:
    """The Triton launch's mode (a ``GPU_LAUNCH_MODES`` entry, the key of its blocks) for a batch of
    these i32[R] query lengths: "decode", else "mixed". A prefill batch runs the mixed
    batches' launch, its decode part empty, with or without the Mosaic GPU split: one program
    per bucket for both, not two (issue 46)."""
    return "decode" if gpu_batch_mode(np.asarray(query_lens)) == "decode" else "mixed"


def split_schedules(
    query_start_loc, seq_lens, *, num_tokens: int, block_q: int, tile: int, xp=jnp, decode_part: bool = False
):  # fmt: skip
    """(mgpu_schedule, rest_schedule): the Mosaic GPU prefill's q-tiles (requests of at least
    ``tile`` 8-aligned new tokens) and the Triton kernel's q-blocks for every other row:
    other requests, the unaligned rows at either end of a served request, and the padding.
    With ``decode_part`` (a mixed batch) the decodes' rows leave the first part of the rest
    for a decode part (``pallas_triton.decode_part``: a block per request before the NB blocks)."""
    mgpu, (lo, hi) = pallas_mosaic_gpu.mgpu_schedule(query_start_loc, seq_lens, num_tokens=num_tokens, tile=tile, xp=xp)
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc.astype(np.int32)
    first = qsl[:-1]
    if decode_part:
        # A decode's row (never the Mosaic GPU kernel's: lo == hi == its end) leaves both segments empty.
        decodes, first = pallas_triton.decode_part(query_start_loc, seq_lens, xp=xp)
    reqs = xp.arange(num_reqs, dtype=np.int32)
    segments = (  # each request's rows before and after the Mosaic GPU span [lo, hi), then the padding
        xp.concatenate([reqs, reqs, xp.full((1,), num_reqs, np.int32)]),
        xp.concatenate([first, hi, qsl[-1:]]),
        xp.concatenate([lo, qsl[1:], xp.full((1,), num_tokens, np.int32)]),
    )
    rest = pallas_triton.gpu_schedule(
        query_start_loc, seq_lens, num_tokens=num_tokens, block_q=block_q, xp=xp, segments=segments
    )
    if decode_part:
        rest = xp.concatenate([decodes, rest], axis=1).astype(np.int32)
    return mgpu, rest


def mgpu_split(
    query_start_loc, seq_lens, *, num_tokens: int, block_q: int, mgpu_bs: MgpuBlockSizes | None = None,
    step_query_lens=None, decode_part: bool = False,
) -> dict:  # fmt: skip
    """The Mosaic GPU prefill split as metadata fields, or {} when no request is long
    enough: ``mgpu_schedule``, ``rest_schedule`` (None when the Mosaic GPU kernel serves
    every row) and ``mgpu_block_sizes``; ``decode_part``: the rest schedule ends in a mixed
    batch's decode part (``split_schedules``).

    With ``step_query_lens`` (i32[N], the whole step's query lengths when data shards build
    their metadata separately) the fields follow the step, so every shard has the same
    structure: present when a request of the step has at least ``tile + 14`` new tokens
    (an 8-aligned span of a whole tile wherever it starts), with ``rest_schedule`` always
    there; a shard with no such request gets tiles that are all empty (skipped).

    Traced metadata (``jnp`` arrays under ``jit``) always gets the structure, computed with
    jnp: which requests are long is only known on the device."""
    bs = mgpu_bs or MgpuBlockSizes()
    if not is_concrete(query_start_loc, seq_lens):
        mgpu, rest = split_schedules(
            jnp.asarray(query_start_loc), jnp.asarray(seq_lens), num_tokens=num_tokens, block_q=block_q, tile=bs.tile,
            decode_part=decode_part,
        )  # fmt: skip
        return dict(mgpu_schedule=mgpu, rest_schedule=rest, mgpu_block_sizes=bs)
    if step_query_lens is not None and not (np.asarray(step_query_lens) >= bs.tile + 14).any():
        return {}
    mgpu, rest = split_schedules(
        np.asarray(query_start_loc), np.asarray(seq_lens), num_tokens=num_tokens, block_q=block_q, tile=bs.tile,
        xp=np, decode_part=decode_part,
    )  # fmt: skip
    if step_query_lens is not None:
        return dict(mgpu_schedule=mgpu, rest_schedule=rest, mgpu_block_sizes=bs)
    if not (mgpu[3] > 0).any():
        return {}
    rest_empty = not (rest[2] > rest[1]).any()
    return dict(mgpu_schedule=mgpu, rest_schedule=None if rest_empty else rest, mgpu_block_sizes=bs)


def uses_mosaic_gpu(
    q, kv_cache, *, interpret: bool, block_sizes: GpuBlockSizes | None, mgpu_schedule,
    mgpu_block_sizes: MgpuBlockSizes | None, causal: bool = True, sliding_window=None,
    logits_soft_cap=None, alibi_slopes=None, sinks=None, query_quant: bool = False,
) -> bool:  # fmt: skip
    """Whether ``ragged_paged_attention`` runs a batch's long prefills on the Mosaic GPU kernel:
    a Mosaic GPU split was built, the kernels are compiled (not interpreted), the Triton blocks
    are unsplit and ``pallas_mosaic_gpu.unsupported_reason`` accepts the configuration."""
    return (
        mgpu_schedule is not None and not interpret
        and (block_sizes is None or block_sizes.num_kv_splits == 1)
        and pallas_mosaic_gpu.unsupported_reason(
            head_size=q.shape[-1], page_size=kv_cache.shape[2], dtype=q.dtype, cache_dtype=kv_cache.dtype,
            causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            alibi_slopes=alibi_slopes, sinks=sinks, block_sizes=mgpu_block_sizes,
            query_quant=query_quant,
        ) is None
    )  # fmt: skip


def ragged_paged_attention(
    q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, *, sm_scale: float,
    causal: bool = True, sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None,
    k_scale=None, v_scale=None, interpret: bool | None = None, block_sizes: GpuBlockSizes | None = None,
    schedule=None, mgpu_schedule=None, rest_schedule=None,
    mgpu_block_sizes: MgpuBlockSizes | None = None, return_lse: bool = False, q_scale=None, state_init=None,
    return_states: bool = False, decode_block_sizes: GpuBlockSizes | None = None,
):  # fmt: skip
    """PALLAS_GPU's op: ``pallas_triton.ragged_paged_attention``'s contract, with a prefill
    batch's long requests on the Mosaic GPU kernel.

    With ``mgpu_schedule`` (``mgpu_split``: i32[4, NT] q-tiles, ``rest_schedule`` i32[5, NB]
    the rows they leave over or None when they serve every row) compiled on a GPU, and a
    configuration ``pallas_mosaic_gpu.unsupported_reason`` accepts, the new k/v are written,
    the Mosaic GPU kernel computes its tiles and the Triton kernel the other rows into the
    same buffer (with ``return_lse``, their LSE too); otherwise the Triton kernel serves every
    row on ``schedule`` (and so with ``return_states`` and ``state_init``, cascade attention's
    fused merge), a mixed batch's decodes on ``decode_block_sizes`` when given.
    FP8 attention (``q_scale``, an e4m3 cache) splits the same way (``FP8_PLAN``).
    """
    features = dict(
        causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
        sinks=sinks,
    )  # fmt: skip
    kwargs = dict(sm_scale=sm_scale, **features)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    use_mgpu = state_init is None and not return_states and uses_mosaic_gpu(
        q, kv_cache, interpret=interpret, block_sizes=block_sizes, mgpu_schedule=mgpu_schedule,
        mgpu_block_sizes=mgpu_block_sizes, query_quant=q_scale is not None, **features,
    )  # fmt: skip
    triton = functools.partial(
        pallas_triton.ragged_paged_attention, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=block_tables, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
        interpret=interpret, block_sizes=block_sizes, **kwargs, **({} if q_scale is None else {"q_scale": q_scale}),
    )  # fmt: skip
    if not use_mgpu:
        return triton(
            q, k, v, kv_cache, schedule=schedule, return_lse=return_lse, state_init=state_init,
            return_states=return_states, decode_block_sizes=decode_block_sizes,
        )  # fmt: skip
    pallas_triton.validate_inputs(
        q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, block_sizes=block_sizes, **kwargs
    )
    kv_cache = pallas_triton.write_new_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale, interpret=False)
    out = pallas_mosaic_gpu.prefill_attention(
        q, kv_cache, jnp.asarray(mgpu_schedule, jnp.int32), jnp.asarray(block_tables), sm_scale=sm_scale,
        block_sizes=mgpu_block_sizes, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale,
    )  # fmt: skip
    out, lse = out if return_lse else (out, None)
    if rest_schedule is None:  # every row is the Mosaic GPU kernel's: no second launch
        return (out, kv_cache, lse) if return_lse else (out, kv_cache)
    return triton(
        q, None, None, kv_cache, schedule=rest_schedule, out_init=out, lse_init=lse, return_lse=return_lse,
        decode_block_sizes=decode_block_sizes,
    )  # fmt: skip


TRACED_METADATA_COST = (
    "on an H100, write + attend per step through the layer, traced vs host metadata built once and reused: "
    "D1 0.500 vs 0.485 ms, D2 0.532 vs 0.459, P1 1.208 vs 1.160, mixed batches M1 0.460-0.505 vs 0.409-0.471, "
    "M2 0.379-0.482 vs 0.409-0.432; against host metadata rebuilt every step (layer.prepare(md) in the loop, "
    "0.16-0.24 ms of host time a batch) traced was faster: M1 0.46 vs 0.91, D1 0.50 vs 0.63 "
    "(BENCHMARKS.md, 2026-11-27)"
)
_traced_warned = False


def _warn_traced_once(device_kind: str | None) -> None:
    """Logs, once per process on a GPU, what traced metadata costs against ``layer.prepare(md)``."""
    global _traced_warned
    if _traced_warned or device_kind is None:
        return
    _traced_warned = True
    logger.warning(
        "PALLAS_GPU got CommonAttentionMetadata traced under jit: the batch mode, the q-block "
        "schedule and the Mosaic GPU split are then derived on the device from the bucket's shapes "
        "(%s). Where the host has the time (its work overlapped with the device's, or one build "
        "serving several calls), build the metadata with layer.prepare(md) and pass that into the "
        "jitted step, as the serving engine does.",
        TRACED_METADATA_COST,
    )


def mgpu_prefill_setting() -> bool:
    """``ATTN_STACK_MGPU_PREFILL`` (``MGPU_PREFILL_ENV``): read by the builder when it is made
    and by ``kernel_plan``, the backend's edge; nothing under ``ops/`` reads it."""
    return os.environ.get(MGPU_PREFILL_ENV, "1") != "0"


NO_FP8_DOT_GPUS = ("A100", "A800", "A10", "A10G", "A30", "A40", "V100", "T4", "P100", "P40", "RTX 3090", "RTX 3080")
"""GPUs (words of ``jax.Device.device_kind``) with no fp8 tensor cores (compute capability below 8.9),
where Triton's ``tl.dot`` takes no e4m3 operands: PALLAS_GPU refuses FP8 attention there."""

FP8_PLAN = (
    "FP8 attention (query_quant): the query quantised to e4m3 in the kernel, q.k on e4m3 x e4m3 dots with "
    "float32 accumulation (FP8 wgmma on Hopper); decode and mixed batches on the Triton kernel (p @ v in e4m3 "
    "too), the long requests of prefill batches on Hopper on the Mosaic GPU kernel (p @ v in float16 over V "
    "converted exactly from e4m3)"
)
"""What ``kernel_plan`` (``attn-stack info --query-quant``) says for FP8 attention layers."""

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
    schedule are computed on the host. Traced metadata (``build`` inside ``jit``, as when
    ``CommonAttentionMetadata`` is passed into ``jax.jit(layer.__call__)``) derives the
    schedule with jnp and the mode from the bucket's shapes: "decode" when it has no more
    tokens than requests, else "mixed", with the Mosaic GPU split (computed with jnp) when
    the bucket averages a whole Mosaic tile per request. Block sizes depend only on the
    bucket's shapes, the mode and the dtypes (``config.gpu_block_choice``: tuned entry or
    heuristic, fitted to the device's shared memory). Host metadata of a prefill batch is
    built as a mixed batch's (its decode part empty), so a bucket compiles at most three
    times: decode, mixed, and mixed with the split.

    With ``mgpu_prefill`` (the argument, else on unless ``ATTN_STACK_MGPU_PREFILL=0``, see
    ``MGPU_PREFILL_ENV``) on Hopper GPUs (``config.mgpu_prefill_available``), host
    metadata of a batch with a long request (prefill or mixed) in a bucket of at least
    ``MGPU_SPLIT_MIN_TILES`` Mosaic tiles gets the Mosaic GPU split (``mgpu_split``): the
    kernel then runs the long requests in ``pallas_mosaic_gpu`` when the layer's
    configuration allows it (``pallas_mosaic_gpu.unsupported_reason``) and everything in the
    Triton kernel otherwise. The Triton launch after it takes the other rows and, on the
    bucket's decode blocks (``decode_part_block_sizes``), the decodes, writing them into the
    Mosaic GPU kernel's output: on an H200, DESIGN.md's M1 (4 chunks of 512 + 60 decodes)
    took 0.282 ms of device time with its k/v write against 0.341 ms in one Triton launch
    (BENCHMARKS.md, stop 64). Whether the split is there is part of the jit key. Without it,
    a mixed batch's one Triton launch runs its decodes on the decode blocks beside the other
    rows' q-blocks, so they stream their KV as a decode batch does.

    Cascade attention (``use_cascade_attention``): the XLA builder's thresholds, and for
    float32 layers, whose dots run on FMA units (``config.fma_dots``), a performance model as
    well (``cascade_fma_model``): there the kernel's time is its dots' work, not the bytes
    cascade saves, and the prefix part's q-blocks keep a decode block's rows (``FMA_DOT_ROWS``).
    """

    reads_live_pages_only = True  # the kernels loop over each request's own KV length

    CASCADE_FMA_MAX_RATIO = 1.0
    """Float32 layers (FMA dots) take cascade attention only where ``cascade_fma_model`` puts
    its two launches at most this fraction of the plain launch. Measured (H200, S1 scaled to
    16 x (1024 + 32), 128 new; BENCHMARKS.md): with a margin of 0.75 the builder took cascade
    in 6 of 16 decode calls, 0.993x the plain step; cascade in every call (the model's ratio
    0.61 -> 0.93 over the run) 0.926x: no margin is needed there."""

    CASCADE_MIN_SAVED_BYTES = 16 << 20
    """Tensor-core layers (16-bit, FP8) take cascade attention only where reading the shared
    prefix once saves at least this many KV bytes per layer over reading it once per
    request: cascade's second launch and merge cost a few microseconds a layer, about what
    16 MiB take at an H200's bandwidth. Measured (H200, bfloat16, SmolLM2 shape): at 16 x
    (1024 + 32) tokens (11.3 MiB saved) cascade made the decode step 1.12x slower; S1's
    64 x (2048 + 64) (94.5 MiB) ran its attention 4x faster (H100; BENCHMARKS.md)."""

    MGPU_SPLIT_MIN_TILES = 4
    """Host metadata takes the Mosaic GPU split only for buckets of at least this many of its
    q-tiles (512 tokens): a smaller bucket's prefill runs on the mixed batches' Triton launch,
    where its attention is a few microseconds and a second launch would cost about what the
    split saves (not measured), and its bucket compiles one program less (issue 46)."""

    def __init__(self, kv_cache_spec, device_kind: str | None = None, mgpu_prefill: bool | None = None) -> None:
        super().__init__(kv_cache_spec)
        if device_kind is None:
            platform = current_platform()
            device_kind = platform.device_kind if platform.kind == "gpu" else None
        self.device_kind = device_kind
        if mgpu_prefill is None:  # read once, here at the edge (never under ops/)
            mgpu_prefill = mgpu_prefill_setting()
        self.mgpu_prefill = mgpu_prefill and mgpu_prefill_available(device_kind)
        self._block_choices: dict[tuple[int, int, str], GpuBlockChoice] = {}

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return self._with_cascade(*self._build(common_attn_metadata), common_prefix_len)

    def build_for_jit(self, common_attn_metadata, step_query_lens=None, common_prefix_len=0):
        return self._with_cascade(*self._build(common_attn_metadata, step_query_lens), common_prefix_len)

    def _with_cascade(self, md: PallasGPUAttentionMetadata, mode: str, common_prefix_len) -> PallasGPUAttentionMetadata:
        cascade = self.cascade_prefix_len(common_prefix_len)
        if cascade is None:
            return md
        num_tokens, pages_per_req = md.slot_mapping.shape[0], md.block_tables.shape[1]
        return self.with_cascade_blocks(
            dataclasses.replace(md, cascade_prefix_len=cascade),
            self.cascade_block_sizes(num_tokens=num_tokens, pages_per_req=pages_per_req),
            self.cascade_suffix_block_sizes(md.block_sizes, mode),
        )

    def with_cascade_blocks(
        self, md: PallasGPUAttentionMetadata, prefix_bs: GpuBlockSizes, suffix_bs: GpuBlockSizes
    ) -> PallasGPUAttentionMetadata:
        """``md`` (with its ``cascade_prefix_len``) running cascade's parts on these blocks: each
        part's q-blocks built for them and the suffix's tables, once (NumPy on the host when
        ``md`` is concrete). The builder's choice goes through here; so does a block sweep."""
        prefix_len, num_tokens = md.cascade_prefix_len, md.slot_mapping.shape[0]
        xp = np if is_concrete(md.query_start_loc, md.seq_lens, md.block_tables) else jnp
        qsl, seq_lens = xp.asarray(md.query_start_loc), xp.asarray(md.seq_lens)
        prefix_schedule = pallas_triton.gpu_schedule(
            *prefix_part_lens(qsl, prefix_len, xp=xp), num_tokens=num_tokens, block_q=prefix_bs.block_q, xp=xp
        )
        suffix_schedule = pallas_triton.gpu_schedule(
            qsl, seq_lens - prefix_len, num_tokens=num_tokens, block_q=suffix_bs.block_q, xp=xp
        )
        pages = int(prefix_len) // self.kv_cache_spec.block_size
        return dataclasses.replace(
            md, cascade_block_sizes=prefix_bs, cascade_schedule=prefix_schedule,
            cascade_suffix_block_sizes=suffix_bs, cascade_suffix_schedule=suffix_schedule,
            cascade_suffix_tables=shifted_block_tables(xp.asarray(md.block_tables), pages, xp=xp),
        )  # fmt: skip

    def cascade_block_sizes(self, *, num_tokens: int, pages_per_req: int) -> GpuBlockSizes:
        """Blocks for cascade attention's prefix part: the bucket's ``num_tokens`` rows as one
        request over at most ``pages_per_req`` pages. A mixed batch's q-blocks (tuned entry or
        heuristic), and unless the entry sets it, the KV range split (flash-decoding) while
        the q-blocks times the KV heads do not fill twice the SMs and each split keeps at
        least 2 tiles: a decode batch's prefix part is a few q-blocks over a long range. (At
        S1's decode step on an H100, 2 tiles a split beat 4 by 1.7 us a layer, the suffix
        part's fold of twice the splits included: BENCHMARKS.md.) Where the dots run on FMA
        units (float32, ``config.fma_dots``) the q-blocks hold at most ``FMA_DOT_ROWS`` rows
        (a decode block's), so a program's dots are the plain decode path's, and the KV range
        splits over the more programs that makes: the mixed blocks' 64 rows (16 tokens x a
        head group padded to 4) made the float32 prefix part a few programs of 64 x 64 x 64
        FMA dots each (issue 49)."""
        bs = self.block_choice(num_reqs=1, pages_per_req=pages_per_req, mode="mixed").block_sizes
        if self.fma_dots:  # a decode block's rows: the mixed blocks' 64 make FMA dots 4x the work a program
            spec = self.kv_cache_spec
            group = next_pow2((spec.num_q_heads or spec.num_kv_heads) // spec.num_kv_heads)
            bs = dataclasses.replace(bs, block_q=min(bs.block_q, max(FMA_DOT_ROWS // group, 1)))
        if bs.num_kv_splits != 1:
            return bs
        programs = -(-num_tokens // bs.block_q) * self.kv_cache_spec.num_kv_heads
        tiles = pages_per_req * self.kv_cache_spec.block_size // bs.tile(self.kv_cache_spec.block_size)
        return dataclasses.replace(bs, num_kv_splits=max(1, min(2 * H100_NUM_SMS // programs, tiles // 2)))

    def cascade_suffix_block_sizes(self, block_sizes: GpuBlockSizes, mode: str) -> GpuBlockSizes:
        """Blocks for cascade attention's suffix part: the batch's (``block_sizes``), except
        that a decode batch's, whose requests each read only their own few pages after the
        prefix, take 32-key tiles, 4 warps and no KV split (at S1's decode step on an H100
        9.5 us a layer with the batch's 64-key tiles and 8 warps, 7.8 with these:
        BENCHMARKS.md)."""
        if mode != "decode":
            return block_sizes
        page_size = self.kv_cache_spec.block_size
        return dataclasses.replace(
            block_sizes, pages_per_tile=max(32 // page_size, 1), keys_per_tile=32 if page_size > 32 else None,
            num_warps=4, num_kv_splits=1,
        )  # fmt: skip

    @property
    def fma_dots(self) -> bool:
        """Whether this builder's layers' Triton dots run on FMA units (``config.fma_dots``: float32)."""
        return fma_dots(self.kv_cache_spec.dtype, query_quant=self.kv_cache_spec.query_quant)

    @classmethod
    def cascade_summary(cls) -> str:
        return (
            f"{super().cascade_summary()}; for float32 layers (FMA dots) only where the builder's model of the "
            f"kernels' dot work puts cascade at <= {cls.CASCADE_FMA_MAX_RATIO} of the plain launch, for the others "
            f"only where it reads >= {cls.CASCADE_MIN_SAVED_BYTES >> 20} MiB of KV less per layer"
        )

    def use_cascade_attention(
        self, common_prefix_len, query_lens, num_query_heads, num_kv_heads, use_alibi, use_sliding_window, num_sms,
        *, min_prefix_len=None, min_requests=None, seq_lens=None, performance_model=True,
    ) -> bool:  # fmt: skip
        """The XLA builder's tests (thresholds, no ALiBi / window / chunks); then, unless
        ``performance_model`` is False: for float32 layers (``fma_dots``) cascade only where
        ``cascade_fma_model`` puts it at most ``CASCADE_FMA_MAX_RATIO`` of the plain path, for
        the others only where it saves ``CASCADE_MIN_SAVED_BYTES`` a layer.

        Why the rule depends on the dtype: 16-bit (and FP8) dots run on tensor cores, so a
        decode batch's attention is bound by the KV bytes it reads, and reading the shared
        prefix once instead of once per request is the saving (S1 on an H100: attention
        kernels 2,099 -> 505 us a step, BENCHMARKS.md), against a second launch a layer.
        Float32 dots are FMA loops, so a program's time is its rows times its keys: the plain
        path already spreads each request's prefix over its KV splits, and cascade's saving
        is the plain path's padded rows (a decode q-block's 16 rows hold one token's head
        group) against a second launch after the first (issue 49: at 16 x (1024 + 32) tokens
        the old 64-row prefix part made the decode step 4.4x slower)."""
        base = super().use_cascade_attention(
            common_prefix_len, query_lens, num_query_heads, num_kv_heads, use_alibi, use_sliding_window, num_sms,
            min_prefix_len=min_prefix_len, min_requests=min_requests,
        )  # fmt: skip
        if not base or not performance_model:
            return base
        if not self.fma_dots:
            return self.cascade_saved_bytes(common_prefix_len, len(query_lens)) >= self.CASCADE_MIN_SAVED_BYTES
        cascade, plain = self.cascade_fma_model(common_prefix_len, query_lens, seq_lens=seq_lens, num_sms=num_sms)
        return cascade <= self.CASCADE_FMA_MAX_RATIO * plain

    def cascade_saved_bytes(self, common_prefix_len: int, num_reqs: int) -> int:
        """KV bytes per layer cascade does not read: the shared prefix's keys and values once
        instead of once per request."""
        spec = self.kv_cache_spec
        itemsize = np.dtype(spec.cache_dtype or spec.dtype).itemsize
        return (num_reqs - 1) * int(common_prefix_len) * 2 * spec.num_kv_heads * spec.head_size * itemsize

    def cascade_fma_model(self, common_prefix_len: int, query_lens, *, seq_lens=None, num_sms: int = 0):
        """(cascade, plain): modelled times of a batch's attention launches where the dots run
        on FMA units (float32), in rows x keys: a program's time is the rows of its q-block
        times the keys it reads (FMA dots compute every row, padding included), a launch's
        is its longest program's times its waves (``2 * num_sms`` programs at a time; 0:
        ``H100_NUM_SMS``), with the blocks this builder would choose:

        - plain: one launch on the batch's blocks (``block_choice``), each request's q-blocks
          x KV-head programs x KV splits, each over ceil(longest context / splits) keys;
        - cascade: the prefix part (``cascade_block_sizes``: ceil(tokens / block_q) q-blocks
          over ceil(prefix / splits) keys each), then the suffix part
          (``cascade_suffix_block_sizes``: each request's q-blocks over the keys after the
          prefix, unsplit).

        ``query_lens`` i32[R]; ``seq_lens`` i32[R] each request's keys in the step (its cached
        context and its new tokens; None: the prefix and the new tokens only, the shortest
        suffix there can be). Pages per request are the longest context's (the engine's
        bucket may be wider, which changes the plain path's splits a little).

        Example (S1 scaled to 16 x (1024 + 32) tokens, SmolLM2's heads, float32, as the
        engine asks at its first decode step)::

            builder.cascade_fma_model(1024, np.ones(16), seq_lens=np.full(16, 1057))  # (2576, 4240)
        """
        spec = self.kv_cache_spec
        sms = num_sms or H100_NUM_SMS
        group = (spec.num_q_heads or spec.num_kv_heads) // spec.num_kv_heads
        q_lens = np.asarray(query_lens, np.int64)
        lens = common_prefix_len + q_lens if seq_lens is None else np.asarray(seq_lens, np.int64)
        longest = max(int(lens.max(initial=0)), common_prefix_len + 1)
        pages = -(-longest // spec.block_size)
        mode = launch_mode(q_lens)
        plain = self.block_choice(num_reqs=len(q_lens), pages_per_req=pages, mode=mode).block_sizes
        prefix = self.cascade_block_sizes(num_tokens=max(int(q_lens.sum()), 1), pages_per_req=pages)
        suffix = self.cascade_suffix_block_sizes(plain, mode)

        def launch(bs: GpuBlockSizes, q_blocks: int, keys: int) -> int:
            programs = q_blocks * -(-spec.num_kv_heads // bs.kv_heads_per_program) * bs.num_kv_splits
            return -(-programs // (2 * sms)) * bs.rows(group) * -(-keys // bs.num_kv_splits)

        def q_blocks(bs: GpuBlockSizes) -> int:
            return int((-(-q_lens // bs.block_q)).sum())

        tokens = max(int(q_lens.sum()), 1)
        cascade = launch(prefix, -(-tokens // prefix.block_q), common_prefix_len)
        cascade += launch(suffix, q_blocks(suffix), longest - common_prefix_len)
        return cascade, launch(plain, q_blocks(plain), longest)

    def advance_decode(self, metadata, steps, active):
        """The XLA builder's move, plus each real q-block's first position and KV length
        (a decode batch's q-block holds one request's token)."""
        out = super().advance_decode(metadata, steps, active)
        out = dataclasses.replace(out, schedule=_advance_schedule(metadata.schedule, steps))
        if metadata.cascade_suffix_schedule is None:  # the prefix part's q-blocks stay: its keys do not move
            return out
        suffix = _advance_schedule(metadata.cascade_suffix_schedule, steps)
        return dataclasses.replace(out, cascade_suffix_schedule=suffix)

    def block_choice(self, *, num_reqs: int, pages_per_req: int, mode: str):
        """``config.gpu_block_choice`` for this builder's layers, device and a bucket's shapes,
        made once per (bucket, mode): a serving loop builds metadata every step."""
        key = (num_reqs, pages_per_req, mode)
        choice = self._block_choices.get(key)
        if choice is None:
            spec = self.kv_cache_spec
            num_q_heads = spec.num_q_heads or spec.num_kv_heads
            choice = self._block_choices[key] = gpu_block_choice(
                num_reqs=num_reqs, pages_per_req=pages_per_req, page_size=spec.block_size, head_size=spec.head_size,
                num_kv_heads=spec.num_kv_heads, group=num_q_heads // spec.num_kv_heads, mode=mode,
                q_dtype=spec.dtype, kv_dtype=spec.cache_dtype, device_kind=self.device_kind,
            )  # fmt: skip
        return choice

    def decode_part_block_sizes(self, *, num_reqs: int, pages_per_req: int, block_sizes: GpuBlockSizes):
        """``config.decode_part_block_sizes`` for a mixed bucket launched on ``block_sizes``."""
        spec = self.kv_cache_spec
        decode = self.block_choice(num_reqs=num_reqs, pages_per_req=pages_per_req, mode="decode").block_sizes
        return decode_part_block_sizes(
            block_sizes, decode, group=(spec.num_q_heads or spec.num_kv_heads) // spec.num_kv_heads,
            page_size=spec.block_size, device_kind=self.device_kind, head_size=spec.head_size,
            q_dtype=spec.dtype, kv_dtype=spec.dtype if spec.cache_dtype is None else spec.cache_dtype,
        )  # fmt: skip

    @classmethod
    def takes_mgpu_split(cls, mode: str, num_tokens: int) -> bool:
        """Whether host metadata of a batch of ``launch_mode`` ``mode`` in a bucket of
        ``num_tokens`` tokens gets the Mosaic GPU split (where ``mgpu_prefill`` is on and a
        request holds an aligned tile): a mixed launch in a bucket of at least
        ``MGPU_SPLIT_MIN_TILES`` tiles."""
        return mode == "mixed" and num_tokens >= cls.MGPU_SPLIT_MIN_TILES * MgpuBlockSizes().tile

    def _build(self, common_attn_metadata, step_query_lens=None) -> tuple[PallasGPUAttentionMetadata, str]:
        base = super().build(0, common_attn_metadata)
        num_tokens = base.slot_mapping.shape[0]
        num_reqs, pages_per_req = base.block_tables.shape
        concrete = is_concrete(base.query_start_loc, base.seq_lens)
        tile = MgpuBlockSizes().tile
        if concrete:
            own = np.diff(np.asarray(base.query_start_loc))
            mode = launch_mode(own if step_query_lens is None else step_query_lens)
            split_here = self.takes_mgpu_split(mode, num_tokens)
        else:  # traced: only the bucket's shapes are known
            _warn_traced_once(self.device_kind)
            mode = "decode" if num_tokens <= num_reqs else "mixed"
            # A bucket averaging a Mosaic tile per request is a long prefill's (P1: 4096),
            # a mixed batch's is not (M1: 33), as host metadata would have it.
            split_here = num_tokens >= tile * max(num_reqs, 1)
        # A bucket holds at most one request per token: the engine pads requests to its slot
        # count, and the blocks are chosen for the requests the tokens can hold.
        num_reqs = min(num_reqs, max(num_tokens, 1))
        bs = self.block_choice(num_reqs=num_reqs, pages_per_req=pages_per_req, mode=mode).block_sizes
        decode_bs = None
        if mode == "mixed":
            decode_bs = self.decode_part_block_sizes(num_reqs=num_reqs, pages_per_req=pages_per_req, block_sizes=bs)
        split = {}
        if split_here and self.mgpu_prefill:
            mbs = mgpu_block_sizes(head_size=self.kv_cache_spec.head_size, device_kind=self.device_kind)
            split = mgpu_split(
                base.query_start_loc, base.seq_lens, num_tokens=num_tokens, block_q=bs.block_q, mgpu_bs=mbs,
                step_query_lens=step_query_lens, decode_part=decode_bs is not None,
            )  # fmt: skip
        xp = np if concrete else jnp
        make_schedule = pallas_triton.gpu_schedule if decode_bs is None else pallas_triton.mixed_schedule
        schedule = make_schedule(
            xp.asarray(base.query_start_loc), xp.asarray(base.seq_lens), num_tokens=num_tokens,
            block_q=bs.block_q, xp=xp,
        )  # fmt: skip
        md = PallasGPUAttentionMetadata(
            query_start_loc=base.query_start_loc, seq_lens=base.seq_lens, block_tables=base.block_tables,
            slot_mapping=base.slot_mapping, schedule=schedule, block_sizes=bs, decode_block_sizes=decode_bs, **split,
        )  # fmt: skip
        return md, mode


def _advance_schedule(schedule, steps):
    """A decode batch's q-blocks ``steps`` tokens on: each real block's first position and KV
    length move by its request's steps."""
    schedule = jnp.asarray(schedule)
    delta = jnp.where(schedule[4] > 0, steps[schedule[0]], 0).astype(schedule.dtype)
    return schedule.at[3].add(delta).at[4].add(delta)


class PallasGPUAttentionImpl(PallasKernelImpl):
    """Calls ``ragged_paged_attention`` (the Triton / Mosaic GPU dispatch) with the layer's
    hyperparameters; compiled on a GPU platform, the Pallas interpreter elsewhere (with a
    logged warning)."""

    backend_name = "PALLAS_GPU"
    platform_kind = "gpu"
    interpreter = "Pallas interpreter"
    op = staticmethod(ragged_paged_attention)
    metadata_cls = PallasGPUAttentionMetadata

    def kernel_kwargs(self, md) -> dict:
        return dict(
            mgpu_schedule=md.mgpu_schedule, rest_schedule=md.rest_schedule, mgpu_block_sizes=md.mgpu_block_sizes,
            decode_block_sizes=md.decode_block_sizes,
        )  # fmt: skip

    def cascade_kwargs(self, md) -> dict:
        """Both parts' blocks, q-blocks and the suffix's tables from the builder, and the merge
        fused into the suffix part's kernel."""
        return dict(
            fuse_merge=True, suffix_block_tables=md.cascade_suffix_tables,
            prefix_kwargs=dict(block_sizes=md.cascade_block_sizes, schedule=md.cascade_schedule),
            suffix_kwargs=dict(block_sizes=md.cascade_suffix_block_sizes, schedule=md.cascade_suffix_schedule),
        )  # fmt: skip


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
        return pallas_triton.SUPPORTED_HEAD_SIZES

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return pallas_triton.SUPPORTED_PAGE_SIZES

    @classmethod
    def kernel_plan(
        cls, head_size: int, dtype, kv_cache_dtype, block_size: int, device_kind: str | None, *, causal: bool = True,
        sliding_window=None, logits_soft_cap=None, has_alibi: bool = False, has_sink: bool = False,
        num_kv_heads: int = 8, group: int = 4, query_quant: bool = False,
    ) -> list[str]:  # fmt: skip
        """Which kernel serves which batches for this layer configuration, and the Triton
        kernel's block sizes per batch mode with where they came from, in words (for
        ``attn-stack info``; the blocks for a bucket of 64 requests of up to 4096 tokens)."""
        cache_dtype = (
            cls.kv_cache_dtype_for(kv_cache_dtype, dtype) if isinstance(kv_cache_dtype, str) else kv_cache_dtype
        )
        lines = [
            "decode and mixed batches: one Triton-lowered Pallas launch (pallas_triton)",
            "k/v write: a Pallas kernel storing whole token rows in place (kv_write)",
        ]
        choices = {
            mode: gpu_block_choice(
                num_reqs=64, pages_per_req=-(-4096 // block_size), page_size=block_size, head_size=head_size,
                num_kv_heads=num_kv_heads, group=group, mode=mode, q_dtype=dtype, kv_dtype=cache_dtype,
                device_kind=device_kind,
            )
            for mode in ("decode", "mixed")  # a prefill batch runs the mixed launch (launch_mode)
        }  # fmt: skip
        for mode, choice in choices.items():
            lines.append(f"Triton {mode} blocks (group {group}): {choice.block_sizes} from {choice.source}")
        part = decode_part_block_sizes(
            choices["mixed"].block_sizes, choices["decode"].block_sizes, group=group, page_size=block_size,
            device_kind=device_kind, head_size=head_size, q_dtype=dtype, kv_dtype=cache_dtype,
        )  # fmt: skip
        lines.append(
            "mixed batches' decodes: the mixed blocks (they split the KV range)" if part is None
            else f"mixed batches' decodes, in the same launch: {part} (decode blocks on the launch's warps, stages)"
        )  # fmt: skip
        if query_quant:
            lines.append(FP8_PLAN)
        if not mgpu_prefill_available(device_kind):
            lines.append(
                f"prefill batches: the Triton kernel (Mosaic GPU prefill needs Hopper; device {device_kind!r})"
            )
            return lines
        if not mgpu_prefill_setting():
            lines.append(f"prefill batches: the Triton kernel (Mosaic GPU prefill turned off: {MGPU_PREFILL_ENV}=0)")
            return lines
        reason = pallas_mosaic_gpu.unsupported_reason(
            head_size=head_size, page_size=block_size, dtype=dtype, cache_dtype=cache_dtype, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            alibi_slopes=True if has_alibi else None, sinks=True if has_sink else None,
            block_sizes=(mgpu_bs := mgpu_block_sizes(head_size=head_size, device_kind=device_kind)),
            query_quant=query_quant,
        )  # fmt: skip
        tile = MgpuBlockSizes().tile
        if reason is None:
            grid = (
                f"; launches of at most {pallas_mosaic_gpu.PERSISTENT_MAX_WAVES} waves of (tile, head) items on a "
                f"persistent grid of {mgpu_bs.num_ctas} CTAs"
                if mgpu_bs.num_ctas is not None and not query_quant
                else ""
            )
            lines.append(
                f"prefill batches: requests with >= {tile} 8-aligned new tokens on the Mosaic GPU kernel "
                f"(pallas_mosaic_gpu: TMA per page, wgmma{grid}), the other rows on the Triton kernel"
            )
        else:
            lines.append(f"prefill batches: the Triton kernel ({reason})")
        return lines

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return None  # runs everywhere: compiled on a GPU, in the interpreter elsewhere (forced only)

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """FP8 attention on a GPU without fp8 tensor cores."""
        reasons = super().backend_reasons(config, platform)
        kind = platform.device_kind if platform is not None and platform.kind == "gpu" else None
        words = f" {kind} ".replace("-", " ")
        if config.query_quant and kind is not None and any(f" {k} " in words for k in NO_FP8_DOT_GPUS):
            reasons.append(
                f"FP8 attention (query_quant=True) needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper, "
                f"Blackwell); device {kind!r} has none"
            )
        return reasons
