"""The Mosaic GPU prefill kernel (``pallas_mosaic_gpu``), its host schedule, and the Pallas k/v write.

Mosaic GPU's interpreter in jax 0.11.2 does not run this kernel (it cannot evaluate the
``run_state`` around the PV matmul), so the kernel itself is checked against the float64
oracle on a GPU only (marker ``gpu``: the cases below, on ragged batches whose unused
cache slots hold NaN). On the CPU: the schedules, the fallback reasons, the backend's
split, the whole op with a split schedule (which the interpreter runs on the Triton
kernel alone) and the write kernel in the Pallas interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.backends import pallas_gpu as pallas_gpu_backend
from attn_jax.kv_cache import write_to_kv_cache
from attn_jax.ops.ragged_paged_attention import kv_write, pallas_mosaic_gpu, pallas_triton
from attn_jax.ops.ragged_paged_attention.config import (
    MOSAIC_GPU_SMEM_BYTES,
    GpuBlockSizes,
    MgpuBlockSizes,
    mgpu_block_sizes,
    mgpu_prefill_available,
)
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import check, make_options, read_back
from tests.oracle import attention_oracle

ON_GPU = jax.default_backend() == "gpu"
ON_HOPPER = ON_GPU and mgpu_prefill_available(jax.devices()[0].device_kind)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (H100/H200) for Mosaic GPU")

TILE = pallas_mosaic_gpu.MgpuBlockSizes().tile  # 128


def _split(batch, block_q, tile=TILE, xp=np, decode_part=False):
    return pallas_gpu_backend.split_schedules(
        xp.asarray(batch.query_start_loc), xp.asarray(batch.seq_lens), num_tokens=batch.q.shape[0],
        block_q=block_q, tile=tile, xp=xp, decode_part=decode_part,
    )  # fmt: skip


_LENS = dict(query_lens=[300, 1, 128, 140, 5, 0, 260], context_lens=[100, 50, 0, 37, 3, 9, 0])
_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16)


def test_split_schedules_cover_every_row_once_and_agree_traced():
    batch = make_ragged_batch(0, **_LENS, **_SHAPE, num_tokens=880)
    mgpu, rest = _split(batch, block_q=8)
    mgpu_t, rest_t = jax.jit(lambda a, b: _split_traced(a, b, 880))(batch.query_start_loc, batch.seq_lens)
    np.testing.assert_array_equal(mgpu, np.asarray(mgpu_t))
    np.testing.assert_array_equal(rest, np.asarray(rest_t))
    qsl, seq = np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens)
    qlens = np.diff(qsl)
    covered = np.zeros(880, int)
    for req, tok, pos, kv_len in mgpu.T:
        if kv_len == 0:
            continue
        assert qsl[req] <= tok and tok + TILE <= qsl[req + 1] and tok % 8 == 0
        assert pos == seq[req] - qlens[req] + (tok - qsl[req]) and kv_len == seq[req]
        covered[tok : tok + TILE] = 1  # overlapping tiles write the same rows
    for s, e in zip(rest[1], rest[2], strict=True):
        covered[s:e] += 1
    assert (covered == 1).all(), "each row is served by exactly one kernel"
    # 8-aligned spans: [0, 296) 3 tiles; [304, 424) is under a tile (Triton); [432, 568) 2; [576, 832) 2.
    assert (mgpu[3] > 0).sum() == 3 + 2 + 2
    assert mgpu.shape[1] == pallas_mosaic_gpu.max_num_tiles(880, 7, TILE)
    lasts = mgpu[2] + TILE * (mgpu[3] > 0)
    assert (np.diff(lasts) <= 0).all(), "longest KV extent first"


def _split_traced(qsl, seq, num_tokens, decode_part=False):
    return pallas_gpu_backend.split_schedules(
        qsl, seq, num_tokens=num_tokens, block_q=8, tile=TILE, xp=jnp, decode_part=decode_part
    )


def test_split_schedules_with_a_decode_part_give_each_decode_its_own_block():
    """A mixed batch's split: the Mosaic GPU tiles as without a decode part, the rest's first
    part without the decodes' rows, then one block per request holding each decode's row."""
    batch = make_ragged_batch(0, **_LENS, **_SHAPE, num_tokens=880)
    num_reqs = len(_LENS["query_lens"])
    mgpu, rest = _split(batch, block_q=8, decode_part=True)
    mgpu_t, rest_t = jax.jit(lambda a, b: _split_traced(a, b, 880, decode_part=True))(
        batch.query_start_loc, batch.seq_lens
    )
    np.testing.assert_array_equal(rest, np.asarray(rest_t))
    np.testing.assert_array_equal(mgpu, np.asarray(mgpu_t))
    np.testing.assert_array_equal(mgpu, _split(batch, block_q=8)[0])
    qsl, seq = np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens)
    covered = np.zeros(880, int)
    for tok in mgpu[1, mgpu[3] > 0]:
        covered[tok : tok + TILE] = 1  # overlapping tiles write the same rows
    for s, e in zip(rest[1], rest[2], strict=True):
        covered[s:e] += 1
    assert (covered == 1).all(), "each row is served by exactly one kernel"
    decodes, first = rest[:, :num_reqs], rest[:, num_reqs:]
    real = decodes[:, decodes[2] > decodes[1]]
    assert list(real[0]) == [1], "the one decode (request 1) in the decode part, alone"
    assert (real[1], real[3], real[4]) == (qsl[1], seq[1] - 1, seq[1])
    assert not (first[0, first[2] > first[1]] == 1).any()
    assert rest.shape[1] == pallas_triton.max_num_q_blocks(880, num_reqs, 8) + 2 * num_reqs


def test_rest_launch_with_a_decode_part_writes_only_its_rows_interpret():
    """The Triton launch of a mixed batch's split, in the interpreter: its rows (the rest and
    the decodes, on decode blocks) match the oracle; the Mosaic GPU tiles' rows of
    ``out_init`` are left as they were."""
    batch = make_ragged_batch(1, query_lens=[130, 1, 3, 1], context_lens=[5, 20, 0, 9], **_SHAPE,
                              dtype=jnp.bfloat16, num_tokens=140)  # fmt: skip
    mgpu, rest = _split(batch, block_q=8, decode_part=True)
    served = np.zeros(140, bool)
    for tok in mgpu[1, mgpu[3] > 0]:
        served[tok : tok + TILE] = True
    assert served.sum() == 128
    sentinel = jnp.full(batch.q.shape, 7.0, batch.q.dtype)
    options = make_options(batch)
    out, cache = pallas_triton.ragged_paged_attention(
        *batch.op_args, **options, block_sizes=GpuBlockSizes(block_q=8, pages_per_tile=1), interpret=True,
        schedule=rest, out_init=sentinel, decode_block_sizes=GpuBlockSizes(block_q=8, pages_per_tile=2),
    )  # fmt: skip
    out = np.asarray(out, np.float64)
    assert (out[served] == 7.0).all(), "the Mosaic GPU kernel's rows are not this launch's"
    q = np.asarray(batch.q, np.float64)
    expected = attention_oracle(q, *read_back(batch, cache), batch.query_lens, **options)
    mine = ~served[: batch.num_actual_tokens]
    np.testing.assert_allclose(out[: batch.num_actual_tokens][mine], expected[mine], rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="out_init needs the schedule"):
        pallas_triton.ragged_paged_attention(*batch.op_args, **options, interpret=True, out_init=sentinel)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(causal=False), "causal only"),
        (dict(sliding_window=8), "no sliding_window"),
        (dict(logits_soft_cap=3.0), "no logits_soft_cap"),
        (dict(alibi_slopes=np.ones(4)), "no alibi_slopes"),
        (dict(sinks=np.ones(4)), "no sinks"),
        (dict(dtype=jnp.float32, cache_dtype=jnp.float32), "bfloat16/float16 activations, not float32"),
        (dict(cache_dtype=jnp.float8_e4m3fn), "cache in the activation dtype"),
        (dict(query_quant=True), "FP8 attention on the Mosaic GPU prefill kernel needs a float8_e4m3fn cache"),
        (dict(query_quant=True, cache_dtype=jnp.float8_e4m3fn, head_size=80), "whole 32-byte tiles, not 80"),
        (dict(head_size=72), r"head sizes \[64, 80, 96, 112, 128, 192, 256\], not 72"),
        (dict(block_sizes=MgpuBlockSizes(block_kv=256, steps_in_flight=4)), r"needs 561152 bytes of shared memory"),
        (dict(page_size=4), "page_size=4 does not tile"),
    ],
)
def test_unsupported_configurations_are_named(kwargs, match):
    base = dict(head_size=128, page_size=16, dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16, causal=True)
    assert pallas_mosaic_gpu.unsupported_reason(**base) is None
    reason = pallas_mosaic_gpu.unsupported_reason(**{**base, **kwargs})
    assert reason is not None and __import__("re").search(match, reason), reason


def test_builder_splits_long_prefills_on_hopper_only():
    from attn_jax.backends.base import AttentionSpec
    from attn_jax.backends.pallas_gpu import PallasGPUMetadataBuilder
    from attn_jax.metadata import build_common_attn_metadata

    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.dtype(jnp.bfloat16), num_q_heads=4)
    tables = np.arange(40, dtype=np.int32).reshape(2, 20)
    prefill = build_common_attn_metadata([200, 130], [200, 130], tables, block_size=16)
    mixed = build_common_attn_metadata([400, 1], [400, 30], np.arange(64, dtype=np.int32).reshape(2, 32),
                                       block_size=16)  # fmt: skip
    decode = build_common_attn_metadata([1, 1], [20, 30], tables, block_size=16)
    hopper = PallasGPUMetadataBuilder(spec, device_kind="NVIDIA H100 80GB HBM3", mgpu_prefill=True)
    md = hopper.build(0, prefill)
    assert md.mgpu_schedule is not None and md.mgpu_block_sizes == pallas_mosaic_gpu.MgpuBlockSizes()
    assert md.rest_schedule is not None  # 130 tokens from row 200: rows 200..207 and the padding
    md = hopper.build(0, mixed)  # the long request on the Mosaic GPU kernel, the decode on decode blocks
    assert md.mgpu_schedule is not None and md.decode_block_sizes is not None
    num_tokens = md.slot_mapping.shape[0]
    assert md.rest_schedule.shape[1] == pallas_triton.max_num_q_blocks(num_tokens, 2, md.block_sizes.block_q) + 4
    small = build_common_attn_metadata([200, 1], [200, 30], tables, block_size=16)
    assert hopper.build(0, small).mgpu_schedule is None, "a bucket under MGPU_SPLIT_MIN_TILES tiles: one launch"
    assert hopper.build(0, decode).mgpu_schedule is None
    a100 = PallasGPUMetadataBuilder(spec, device_kind="NVIDIA A100-SXM4-80GB", mgpu_prefill=True)
    assert a100.build(0, prefill).mgpu_schedule is None


def test_data_shards_build_one_split_structure():
    """A sharded step's shards build their metadata apart: one with a long prompt, one with
    short ones, one idle. The split follows the whole step, so all three share a structure
    (a shard without a long request gets empty tiles), and a step without a long request
    has no split anywhere."""
    import jax

    from attn_jax.backends.base import AttentionSpec
    from attn_jax.backends.pallas_gpu import PallasGPUMetadataBuilder
    from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata

    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.dtype(jnp.bfloat16), num_q_heads=4)
    hopper = PallasGPUMetadataBuilder(spec, device_kind="NVIDIA H100 80GB HBM3", mgpu_prefill=True)
    buckets = MetadataBuckets((512,), (2,), (32,))
    tables = np.arange(64, dtype=np.int32).reshape(2, 32)
    shards = {"long": ([300, 20], [300, 20]), "short": ([40, 9], [40, 9]), "idle": ([], [])}

    def build(query_lens, seq_lens, step):
        md = build_common_attn_metadata(query_lens, seq_lens, tables[: len(query_lens)], 16, buckets)
        return hopper.build_for_jit(md, step_query_lens=np.asarray(step, np.int32))

    step = [n for q, _ in shards.values() for n in q]
    built = {name: build(q, s, step) for name, (q, s) in shards.items()}
    structures = {name: jax.tree.structure(md) for name, md in built.items()}
    assert len(set(structures.values())) == 1, structures
    assert built["long"].mgpu_schedule is not None and (built["long"].mgpu_schedule[3] > 0).any()
    assert not (built["short"].mgpu_schedule[3] > 0).any(), "no long request here: every tile is empty"
    short_step = [n for name, (q, _) in shards.items() if name != "long" for n in q]
    assert build(*shards["short"], short_step).mgpu_schedule is None


def test_mgpu_prefill_is_on_for_hopper_unless_turned_off(monkeypatch):
    from attn_jax.backends.base import AttentionSpec
    from attn_jax.backends.pallas_gpu import MGPU_PREFILL_ENV, PallasGPUMetadataBuilder

    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.dtype(jnp.bfloat16), num_q_heads=4)
    monkeypatch.delenv(MGPU_PREFILL_ENV, raising=False)
    assert PallasGPUMetadataBuilder(spec, device_kind="NVIDIA H100 80GB HBM3").mgpu_prefill
    assert not PallasGPUMetadataBuilder(spec, device_kind="NVIDIA A100-SXM4-80GB").mgpu_prefill
    monkeypatch.setenv(MGPU_PREFILL_ENV, "0")
    assert not PallasGPUMetadataBuilder(spec, device_kind="NVIDIA H100 80GB HBM3").mgpu_prefill


def test_mgpu_block_sizes_come_from_the_tuned_table_and_validate():
    from attn_jax.ops.ragged_paged_attention import config

    for name in config.tuned_tables("gpu_"):
        for entry in config.load_tuned_table(name).get("mgpu_entries", []):
            config.mgpu_entry_block_sizes(entry)
    assert config.mgpu_block_sizes(head_size=128, device_kind="NVIDIA H100 80GB HBM3").block_kv == 128
    assert config.mgpu_block_sizes(head_size=64, device_kind=None) == pallas_mosaic_gpu.MgpuBlockSizes()
    with pytest.raises(ValueError, match="unknown keys"):
        config.mgpu_entry_block_sizes({"head_size": 128, "block_m": 64})
    with pytest.raises(ValueError, match="block_kv=96 must be 64, 128 or 256"):
        pallas_mosaic_gpu.MgpuBlockSizes(block_kv=96)
    with pytest.raises(ValueError, match="num_ctas=0 must be None or an int >= 1"):
        pallas_mosaic_gpu.MgpuBlockSizes(num_ctas=0)


@pytest.mark.parametrize(
    ("head_size", "cache_dtype"),
    [(h, jnp.bfloat16) for h in pallas_mosaic_gpu.SUPPORTED_HEAD_SIZES] + [(64, "fp8"), (96, "fp8"), (128, "fp8")],
)
def test_kernel_lowers_for_cuda_at_every_head_size(head_size, cache_dtype):
    """Mosaic GPU's lowering (layouts, TMA boxes, wgmma shapes on the swizzled tiles: 128-byte
    at 64/128/192/256, 64-byte at 96, 32-byte at 80/112; FP8 attention's e4m3 q and K tiles and
    float16 V blocks) runs here on the CPU; the compile to SASS and the numbers are the marked
    GPU cases'."""
    sds = jax.ShapeDtypeStruct
    tiles = pallas_mosaic_gpu.max_num_tiles(512, 2, TILE)
    fp8 = cache_dtype == "fp8"
    shapes = (sds((512, 8, head_size), jnp.bfloat16),
              sds((2, 64, 16, 2, head_size), jnp.float8_e4m3fn if fp8 else cache_dtype),
              sds((4, tiles), jnp.int32), sds((2, 32), jnp.int32))  # fmt: skip
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25), q_scale=jnp.float32(0.125)) if fp8 else {}
    f = functools.partial(pallas_mosaic_gpu.prefill_attention, sm_scale=head_size**-0.5, **scales)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes)
    assert "mosaic_gpu" in exported.mlir_module()
    swizzle = {64: 128, 80: 32, 96: 64, 112: 32, 128: 128, 192: 128, 256: 128}[head_size]
    assert pallas_mosaic_gpu.swizzle_bytes(head_size * 2) == swizzle


@pytest.mark.parametrize(("head_size", "cache_dtype", "copies"), [(128, jnp.bfloat16, 0), (128, "fp8", 0),
                                                                 (256, jnp.bfloat16, 1)])  # fmt: skip
def test_a_token_count_not_a_multiple_of_8_is_staged_where_it_fits(head_size, cache_dtype, copies):
    """837 tokens: Mosaic GPU's tiled TMA view wants whole 8-row tiles, so q and out go through
    an untiled shared-memory buffer (no pad of q, no slice of out) where it fits beside the K/V
    ring (head 128, FP8 attention's e4m3 tiles too), and q is padded where it does not (head
    256: the buffer would need ``smem_bytes(staged=True)`` over Hopper's budget)."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    fp8 = cache_dtype == "fp8"
    cache_dtype = jnp.float8_e4m3fn if fp8 else cache_dtype
    tiles = pallas_mosaic_gpu.max_num_tiles(837, 2, TILE)
    smem = mgpu_block_sizes(head_size=head_size).smem_bytes(head_size, bf16, cache_dtype, staged=True)
    assert (smem <= MOSAIC_GPU_SMEM_BYTES) == (copies == 0)
    shapes = (sds((837, 8, head_size), bf16), sds((2, 64, 16, 2, head_size), cache_dtype), sds((4, tiles), jnp.int32),
              sds((2, 32), jnp.int32))  # fmt: skip
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25), q_scale=jnp.float32(0.125)) if fp8 else {}
    f = functools.partial(pallas_mosaic_gpu.prefill_attention, sm_scale=head_size**-0.5, **scales)
    module = jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes).mlir_module()
    assert "mosaic_gpu" in module
    assert module.count("stablehlo.pad") == copies and module.count("stablehlo.slice") == copies


@pytest.mark.parametrize(("num_tokens", "head_size"), [(512, 128), (837, 128), (837, 256)])
def test_persistent_grid_lowers_for_cuda(num_tokens, head_size):
    """``num_ctas``: a grid of at most that many CTAs, each looping over its (tile, head)
    items (here 8 heads x 6-8 tiles on 16 CTAs); lowered from the CPU (the numbers are the
    marked GPU cases')."""
    sds = jax.ShapeDtypeStruct
    bs = dataclasses.replace(mgpu_block_sizes(head_size=head_size), num_ctas=16)
    tiles = pallas_mosaic_gpu.max_num_tiles(num_tokens, 2, TILE)
    assert pallas_mosaic_gpu.persistent_ctas(8 * tiles, bs) == 16
    shapes = (sds((num_tokens, 8, head_size), jnp.bfloat16), sds((2, 64, 16, 2, head_size), jnp.bfloat16),
              sds((4, tiles), jnp.int32), sds((2, 32), jnp.int32))  # fmt: skip
    f = functools.partial(pallas_mosaic_gpu.prefill_attention, sm_scale=0.1, block_sizes=bs)
    assert "mosaic_gpu" in jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes).mlir_module()


def test_persistent_grid_only_for_launches_of_few_waves():
    """M1's chunks on an H200 (32 heads x 32 static tiles: 7.8 waves of 132 CTAs) loop on a
    persistent grid; P1 (32 x 132 tiles: 32 waves) and block sizes without ``num_ctas`` keep
    one CTA per (tile, head)."""
    h200 = mgpu_block_sizes(head_size=128, device_kind="NVIDIA H200")
    assert h200.num_ctas == 132
    assert pallas_mosaic_gpu.persistent_ctas(32 * pallas_mosaic_gpu.max_num_tiles(2108, 64, TILE), h200) == 132
    assert pallas_mosaic_gpu.persistent_ctas(32 * pallas_mosaic_gpu.max_num_tiles(16384, 4, TILE), h200) is None
    assert pallas_mosaic_gpu.persistent_ctas(40, h200) == 40
    assert pallas_mosaic_gpu.persistent_ctas(40, pallas_mosaic_gpu.MgpuBlockSizes()) is None


@pytest.mark.parametrize("total,num_ctas", [(4224, 132), (1024, 132), (40, 16), (7, 16)])
def test_persistent_deal_serves_every_item_once_and_balances_a_longest_first_schedule(total, num_ctas):
    """``dealt_item`` over all turns of all CTAs covers the items exactly once (the last wave's
    missing ones invalid); on a longest-first schedule (item costs falling with their index, as
    P1's causal tiles) its heaviest CTA carries less than the in-order deal's would."""
    turns = -(-total // num_ctas)
    i, cta = np.meshgrid(np.arange(turns), np.arange(num_ctas), indexing="ij")
    w, valid = (np.asarray(a) for a in pallas_mosaic_gpu.dealt_item(i, cta, num_ctas=num_ctas, total=total))
    assert sorted(w[valid].tolist()) == list(range(total))
    cost = np.arange(total, 0, -1, dtype=np.float64)  # longest first
    dealt = np.where(valid, cost[w], 0).sum(axis=0)
    in_order = np.bincount(np.arange(total) % num_ctas, weights=cost, minlength=num_ctas)
    assert dealt.max() <= in_order.max()
    if total >= 2 * num_ctas:
        assert dealt.max() - dealt.min() < (in_order.max() - in_order.min()) / 2


def test_split_key_lowers_for_cuda_and_bad_parts_are_named():
    """Keys held as two parts (MLA: ``k_nope`` per head, ``k_pe`` shared) lower as two wgmmas
    over q's column halves; a part or a q of the wrong width is refused naming the shapes."""
    sds = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    q, k, v = sds((1024, 4, 192), bf16), sds((1024, 4, 128), bf16), sds((1024, 4, 128), bf16)
    sched, pages = sds((4, 8), jnp.int32), sds((2, 1), jnp.int32)

    def attend(q, k, v, sched, pages, k_rope):
        return pallas_mosaic_gpu.prefill_attention_kv(q, k, v, sched, pages, page_size=512, sm_scale=0.1,
                                                      k_rope=k_rope)  # fmt: skip

    exported = jax.export.export(jax.jit(attend), platforms=["cuda"])(q, k, v, sched, pages, sds((1024, 64), bf16))
    assert "mosaic_gpu" in exported.mlir_module()
    with pytest.raises(ValueError, match=r"k_rope must be \[N=1024, Dr\].*\(1024, 32\)"):
        jax.eval_shape(attend, sds((1024, 4, 160), bf16), k, v, sched, pages, sds((1024, 32), bf16))
    with pytest.raises(ValueError, match="q's width 192 must be the key's, 128 \\+ 0"):
        jax.eval_shape(attend, q, k, v, sched, pages, None)
    with pytest.raises(ValueError, match="k_rope's dtype float16 must be k's, bfloat16"):
        jax.eval_shape(attend, q, k, v, sched, pages, sds((1024, 64), jnp.float16))


def test_kernel_plan_names_the_kernel_per_batch_kind(monkeypatch):
    from attn_jax.backends.pallas_gpu import MGPU_PREFILL_ENV
    from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend as B

    monkeypatch.setenv(MGPU_PREFILL_ENV, "0")
    assert "turned off" in B.kernel_plan(128, jnp.bfloat16, jnp.bfloat16, 16, "NVIDIA H100 80GB HBM3")[-1]
    monkeypatch.delenv(MGPU_PREFILL_ENV)
    h100 = "NVIDIA H100 80GB HBM3"
    plan = B.kernel_plan(128, jnp.bfloat16, jnp.bfloat16, 16, h100)
    assert "decode and mixed batches: one Triton" in plan[0] and "Mosaic GPU kernel" in plan[-1]
    # the tuned decode entry's 128-key tiles on the mixed entry's 4 warps and 3 stages
    assert "mixed batches' decodes, in the same launch: GpuBlockSizes(block_q=4, pages_per_tile=8, " in "\n".join(plan)
    assert "num_warps=4, num_stages=3" in next(line for line in plan if line.startswith("mixed batches' decodes"))
    assert "no sinks" in B.kernel_plan(128, jnp.bfloat16, jnp.bfloat16, 16, h100, has_sink=True)[-1]
    assert "needs Hopper" in B.kernel_plan(128, jnp.bfloat16, jnp.bfloat16, 16, "NVIDIA A100-SXM4-80GB")[-1]
    assert "persistent" not in plan[-1]  # the H100 table sets no num_ctas
    assert "on a persistent grid of 132 CTAs" in B.kernel_plan(128, jnp.bfloat16, jnp.bfloat16, 16, "NVIDIA H200")[-1]


def test_mgpu_split_leaves_no_rest_when_every_row_is_served():
    from attn_jax.backends.pallas_gpu import mgpu_split

    split = mgpu_split(np.array([0, 256, 384]), np.array([256, 200]), num_tokens=384, block_q=8)
    assert split["rest_schedule"] is None and (split["mgpu_schedule"][3] > 0).sum() == 3
    assert mgpu_split(np.array([0, 100]), np.array([100]), num_tokens=100, block_q=8) == {}


def test_op_with_split_schedules_matches_oracle_interpret():
    """In the interpreter the split falls back to the Triton kernel on the full schedule."""
    batch = make_ragged_batch(1, query_lens=[130, 1, 3], context_lens=[5, 20, 0], **_SHAPE, dtype=jnp.bfloat16)
    bs = GpuBlockSizes(block_q=8, pages_per_tile=1)
    mgpu, rest = _split(batch, block_q=8)
    op = functools.partial(
        pallas_gpu_backend.ragged_paged_attention,
        block_sizes=bs,
        interpret=True,
        mgpu_schedule=mgpu,
        rest_schedule=rest,
    )
    check(batch, make_options(batch), use_jit=True, op=op)


def test_lse_init_goes_with_out_init_and_return_lse():
    batch = make_ragged_batch(1, query_lens=[3, 1], context_lens=[2, 4], **_SHAPE)
    lse_init = jnp.zeros(batch.q.shape[:2], jnp.float32)
    for kwargs in (dict(lse_init=lse_init), dict(out_init=jnp.zeros_like(batch.q), return_lse=True)):
        with pytest.raises(ValueError, match="lse_init goes with out_init and return_lse=True"):
            pallas_triton.ragged_paged_attention(*batch.op_args, **make_options(batch), interpret=True, **kwargs)


# ------------------------------------------------------------------ the k/v write
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_write_kernel_matches_scatter_interpret(cache_dtype):
    batch = make_ragged_batch(2, query_lens=[5, 1, 19], context_lens=[3, 30, 0], num_q_heads=4, num_kv_heads=2,
                              head_size=32, block_size=16, num_tokens=30, cache_dtype_str=cache_dtype,
                              extra_blocks=2)  # fmt: skip
    slots = np.asarray(batch.slot_mapping).copy()
    slots[-1] = batch.kv_cache.shape[1] * 16 + 5  # out of range: dropped, as by the scatter
    kw = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    ref = write_to_kv_cache(batch.kv_cache, batch.k, batch.v, slots, **kw)
    out = kv_write.write_kv(batch.kv_cache, batch.k, batch.v, slots, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))  # NaN where NaN


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_latent_write_kernel_matches_scatter_interpret(cache_dtype):
    """MLA's latent cache through the same kernel with one plane (``write_latents``): rows at
    their slots, -1 and out-of-range slots dropped, the rest of the cache (NaN) untouched."""
    from attn_jax.ops.mla import reference as mla_reference

    rng = np.random.default_rng(3)
    cache = jnp.full((4, 16, 96), jnp.nan, cache_dtype)
    kv_c, k_pe = (jnp.asarray(rng.standard_normal((21, n)), jnp.bfloat16) for n in (64, 32))
    slots = rng.permutation(64)[:21].astype(np.int32)
    slots[3], slots[-1] = -1, 64 + 7
    scale = jnp.float32(0.5) if cache_dtype == jnp.float8_e4m3fn else None
    ref = mla_reference.write_latent_cache(cache, kv_c, k_pe, np.where(slots < 64, slots, -1), kv_lora_rank=64,
                                           k_scale=scale)  # fmt: skip
    out = kv_write.write_latents(cache, jnp.concatenate([kv_c, k_pe], -1), slots, scale, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))  # NaN where NaN


def test_write_kernels_lower_for_cuda_one_store_per_plane():
    """The Triton lowering of the k/v write (two planes) and the latent write (one), for an
    abstract H100 from the CPU: one masked ``tt.store`` of rows per plane, the cache aliased."""
    from tests.ops.triton_lowering import export_for_h100

    sds = jax.ShapeDtypeStruct
    kv = functools.partial(kv_write.write_kv, interpret=False)
    latents = functools.partial(kv_write.write_latents, interpret=False)
    cases = (
        (kv, (sds((2, 64, 16, 8, 128), jnp.float8_e4m3fn), sds((300, 8, 128), jnp.bfloat16),
              sds((300, 8, 128), jnp.bfloat16), sds((300,), jnp.int32)), 2),
        (latents, (sds((64, 64, 576), jnp.bfloat16), sds((300, 576), jnp.bfloat16), sds((300,), jnp.int32)), 1),
    )  # fmt: skip
    for fn, shapes, planes in cases:
        text, modules = export_for_h100(fn, *shapes, donate_argnums=0)
        assert "kv_write_gpu" in text and ("tf.aliasing_output" in text or "jax.buffer_donor" in text)
        stores = [line for m in modules for line in m.splitlines() if "tt.store" in line]
        assert len(stores) == planes, stores


def test_write_kernel_is_in_place_under_donation():
    step = jax.jit(functools.partial(kv_write.write_kv, interpret=True), donate_argnums=0)
    cache = jnp.zeros((2, 4, 16, 2, 32), jnp.float32)
    k = jnp.ones((3, 2, 32), jnp.float32)
    text = step.lower(cache, k, k, jnp.array([0, 17, -1], jnp.int32)).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text


def test_write_kernel_rejects_bad_block_tokens():
    with pytest.raises(ValueError, match="block_tokens=3 must be a power of two"):
        kv_write.write_kv(jnp.zeros((2, 1, 16, 1, 32)), jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 32)),
                          jnp.zeros((1,), jnp.int32), block_tokens=3, interpret=True)  # fmt: skip


# ------------------------------------------------------------------ on a Hopper GPU
GPU_CASES = {
    # name: (make_ragged_batch kwargs, Mosaic GPU block sizes)
    "gqa4_head128_page16": (dict(num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16), (64, 128, 2)),
    "gqa4_head64_page32": (dict(num_q_heads=4, num_kv_heads=1, head_size=64, block_size=32), (64, 64, 3)),
    "mha_head128_page64": (dict(num_q_heads=2, num_kv_heads=2, head_size=128, block_size=64), (64, 128, 2)),
    "head128_page256": (dict(num_q_heads=4, num_kv_heads=2, head_size=128, block_size=256), (64, 128, 2)),
    "float16": (dict(num_q_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=jnp.float16), (64, 128, 2)),
    # Narrow heads: 32-byte (80, 112) and 64-byte (96) swizzled tiles.
    "gqa4_head80_page16": (dict(num_q_heads=8, num_kv_heads=2, head_size=80, block_size=16), (64, 128, 2)),
    "gqa2_head96_page32": (dict(num_q_heads=4, num_kv_heads=2, head_size=96, block_size=32), (64, 64, 3)),
    "mha_head112_page16": (dict(num_q_heads=2, num_kv_heads=2, head_size=112, block_size=16), (64, 128, 2)),
    # Wide heads: 64-key K/V blocks (the default past 128).
    "gqa4_head192_page16": (dict(num_q_heads=8, num_kv_heads=2, head_size=192, block_size=16), (64, 64, 2)),
    "gqa2_head256_page64": (dict(num_q_heads=4, num_kv_heads=2, head_size=256, block_size=64), (64, 64, 2)),
}


@pytest.mark.gpu
@needs_hopper
def test_mgpu_alone_matches_oracle_compiled():
    """Every row served by the Mosaic GPU kernel (rest_schedule None: one launch)."""
    from attn_jax.backends.pallas_gpu import mgpu_split

    batch = make_ragged_batch(3, query_lens=[256, 128], context_lens=[0, 72], num_q_heads=8, num_kv_heads=2,
                              head_size=128, block_size=16, dtype=jnp.bfloat16, extra_blocks=2)  # fmt: skip
    bs = GpuBlockSizes(block_q=16, pages_per_tile=4)
    split = mgpu_split(batch.query_start_loc, batch.seq_lens, num_tokens=384, block_q=16)
    assert split["rest_schedule"] is None
    op = functools.partial(pallas_gpu_backend.ragged_paged_attention, block_sizes=bs, **split)
    check(batch, make_options(batch), use_jit=True, op=op)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_mgpu_split_matches_oracle_compiled(name):
    _check_split(name, num_tokens=880)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", ["gqa4_head128_page16", "gqa2_head256_page64"])
def test_mgpu_split_of_a_token_count_not_a_multiple_of_8_matches_oracle_compiled(name):
    """837 token rows: at head 128 q and out go through the kernel's untiled buffer (no copy
    of either), at head 256 q is padded (that buffer does not fit beside its K/V ring)."""
    _check_split(name, num_tokens=837)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    ("name", "num_tokens"),
    [("gqa4_head128_page16", 880), ("gqa4_head128_page16", 837), ("gqa4_head64_page32", 880),
     ("gqa2_head256_page64", 837), ("gqa4_head192_page16", 880)],
)  # fmt: skip
def test_mgpu_persistent_grid_matches_oracle_compiled(name, num_tokens):
    """Sixteen CTAs looping over every (tile, head), empty tiles among them: the K/V ring,
    its barriers' phases, the schedule barrier and each warpgroup's q/out buffer run on
    from one item into the next (of another request, another head, another causal extent)."""
    _check_split(name, num_tokens=num_tokens, num_ctas=16)


def _check_split(name, num_tokens, num_ctas=None):
    kwargs, mbs = GPU_CASES[name]
    kwargs = {"dtype": jnp.bfloat16, **kwargs}
    batch = make_ragged_batch(0, **_LENS, **kwargs, num_tokens=num_tokens, num_padding_requests=1, extra_blocks=3)
    bs = GpuBlockSizes(block_q=16, pages_per_tile=max(64 // kwargs["block_size"], 1))
    mgpu_bs = pallas_mosaic_gpu.MgpuBlockSizes(*mbs, num_ctas=num_ctas)
    mgpu, rest = _split(batch, block_q=16, tile=mgpu_bs.tile)
    items = kwargs["num_q_heads"] * mgpu.shape[1]
    assert pallas_mosaic_gpu.persistent_ctas(items, mgpu_bs) == num_ctas and (num_ctas is None or items > num_ctas)
    op = functools.partial(pallas_gpu_backend.ragged_paged_attention, block_sizes=bs, mgpu_schedule=mgpu,
                           rest_schedule=rest, mgpu_block_sizes=mgpu_bs)  # fmt: skip
    check(batch, make_options(batch), use_jit=True, op=op)


@pytest.mark.gpu
@needs_hopper
def test_mgpu_split_with_a_decode_part_matches_oracle_compiled():
    """A mixed batch as the builder splits it on Hopper: the Mosaic GPU tiles, then one Triton
    launch writing the other rows and the decodes (on decode blocks) into their output."""
    batch = make_ragged_batch(0, **_LENS, **_SHAPE, dtype=jnp.bfloat16, num_tokens=880, num_padding_requests=1,
                              extra_blocks=3)  # fmt: skip
    mgpu, rest = _split(batch, block_q=16, decode_part=True)
    op = functools.partial(pallas_gpu_backend.ragged_paged_attention, block_sizes=GpuBlockSizes(16, 4),
                           mgpu_schedule=mgpu, rest_schedule=rest, decode_block_sizes=GpuBlockSizes(16, 8))  # fmt: skip
    check(batch, make_options(batch), use_jit=True, op=op)


@pytest.mark.gpu
@needs_hopper
def test_builder_metadata_of_a_mixed_batch_matches_oracle_compiled():
    """The builder's metadata of a mixed batch in a bucket of 4 Mosaic tiles (two long chunks
    on cached context, decodes, a short chunk) on this GPU: the split with its decode part,
    through the backend's op as the layer calls it."""
    from attn_jax.backends.base import AttentionSpec

    batch = make_ragged_batch(5, query_lens=[300, 1, 1, 7, 190, 1], context_lens=[40, 500, 9, 30, 0, 260],
                              **_SHAPE, dtype=jnp.bfloat16, num_tokens=512, extra_blocks=3)  # fmt: skip
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.dtype(jnp.bfloat16), num_q_heads=4)
    builder = pallas_gpu_backend.PallasGPUMetadataBuilder(spec, device_kind=jax.devices()[0].device_kind)
    md = builder.build(0, batch.common_metadata())
    assert md.mgpu_schedule is not None and md.decode_block_sizes is not None
    kwargs = pallas_gpu_backend.PallasGPUAttentionImpl.kernel_kwargs(None, md)
    op = functools.partial(pallas_gpu_backend.ragged_paged_attention, block_sizes=md.block_sizes,
                           schedule=md.schedule, **kwargs)  # fmt: skip
    check(batch, make_options(batch), use_jit=True, op=op)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("split_rows", [True, False], ids=["with_triton_rest", "mgpu_alone"])
def test_mgpu_lse_matches_oracle_compiled(split_rows):
    """``return_lse``: the Mosaic GPU tiles' LSE and the Triton kernel's rows (written into the
    same buffers) against the float64 oracle; padding rows see no key (LSE -inf)."""
    from attn_jax.backends.pallas_gpu import mgpu_split

    if split_rows:
        batch = make_ragged_batch(0, **_LENS, **_SHAPE, dtype=jnp.bfloat16, num_tokens=880, num_padding_requests=1,
                                  extra_blocks=3)  # fmt: skip
    else:
        batch = make_ragged_batch(3, query_lens=[256, 128], context_lens=[0, 72], **_SHAPE, dtype=jnp.bfloat16,
                                  num_tokens=384, extra_blocks=2)  # fmt: skip
    split = mgpu_split(batch.query_start_loc, batch.seq_lens, num_tokens=batch.q.shape[0], block_q=16)
    assert (split["rest_schedule"] is None) != split_rows
    options = make_options(batch)
    out, cache, lse = pallas_gpu_backend.ragged_paged_attention(
        *batch.op_args, **options, block_sizes=GpuBlockSizes(block_q=16, pages_per_tile=4), return_lse=True, **split
    )
    k_seqs, v_seqs = read_back(batch, cache)
    expected_out, expected_lse = attention_oracle(
        np.asarray(batch.q, np.float64), k_seqs, v_seqs, batch.query_lens, **options, return_lse=True
    )
    n = batch.num_actual_tokens
    assert lse.shape == batch.q.shape[:2] and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse[:n]), expected_lse, rtol=1e-3, atol=2e-2)
    np.testing.assert_allclose(np.asarray(out[:n], np.float32), expected_out, rtol=2e-2, atol=2e-2)
    assert np.isneginf(np.asarray(lse[n:])).all()
