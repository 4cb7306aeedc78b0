"""Cascade attention through the layer: the builder decides (``use_cascade_attention``), builds
with the common prefix, and the impl reads the prefix once; against the float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import Attention
from attn_jax.backends import pallas_tpu
from attn_jax.backends.xla import XLAMetadataBuilder
from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes
from attn_jax.ops.ragged_paged_attention.pallas_triton import gpu_schedule
from attn_jax.registry import AttentionBackendEnum as ABE
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import TOLERANCES, make_options, read_back
from tests.oracle import attention_oracle

PREFIX = 256
_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16)


def _batch():
    query_lens = [1, 3, 1, 1, 2, 1, 1, 4]
    context_lens = [PREFIX + n for n in (5, 0, 17, 1, 30, 9, 16, 2)]
    return make_ragged_batch(0, query_lens, context_lens, **_SHAPE, num_tokens=16).with_shared_prefix(PREFIX)


@pytest.mark.parametrize("backend, prefix_splits", [(ABE.XLA, None), (ABE.PALLAS_GPU, None), (ABE.PALLAS_GPU, 4)])
def test_builder_chooses_cascade_and_the_layer_matches_the_oracle(backend, prefix_splits):
    batch = _batch()
    options = make_options(batch, logits_soft_cap=10.0, sinks=True)
    layer = Attention(4, 32, options["sm_scale"], 2, logits_soft_cap=10.0, sinks=options["sinks"],
                      attn_backend=backend, block_size=16)  # fmt: skip
    builder = layer.metadata_builder
    args = dict(query_lens=batch.query_lens, num_query_heads=4, num_kv_heads=2, num_sms=132)
    assert builder.use_cascade_attention(PREFIX, use_alibi=False, use_sliding_window=False, **args)
    assert not builder.use_cascade_attention(PREFIX - 16, use_alibi=False, use_sliding_window=False, **args)
    assert not builder.use_cascade_attention(PREFIX, use_alibi=True, use_sliding_window=False, **args)
    md = builder.build(PREFIX + 7, batch.common_metadata())  # rounded down to whole pages
    assert int(md.cascade_prefix_len) == PREFIX
    if prefix_splits:  # the prefix part's KV range split (flash-decoding), as a decode batch's on a GPU
        prefix_bs = GpuBlockSizes(16, 1, num_kv_splits=prefix_splits)
        md = builder.with_cascade_blocks(md, prefix_bs, md.cascade_suffix_block_sizes)
    T = batch.q.shape[0]
    out, cache = layer(batch.q.reshape(T, -1), batch.k.reshape(T, -1), batch.v.reshape(T, -1), batch.kv_cache, md)
    expected = attention_oracle(np.asarray(batch.q), *read_back(batch, cache), batch.query_lens, **options)
    n = batch.num_actual_tokens
    tol = TOLERANCES["float32"]
    np.testing.assert_allclose(np.asarray(out[:n]).reshape(expected.shape), expected, rtol=tol.rtol, atol=tol.atol)


def test_pallas_gpu_cascade_blocks_of_a_decode_batch():
    """The prefix part of 64 decodes over 2048 shared tokens is 4 q-blocks in bfloat16: its KV
    range is split until the programs fill the GPU (a prefill batch's many q-blocks are not
    split); the suffix part of a decode batch reads 32-key tiles with 4 warps (a mixed batch's
    keeps the batch's blocks). In float32 (FMA dots) the prefix part's q-blocks keep a decode
    block's 16 rows: 16 q-blocks, split fewer ways."""
    builder = Attention(9, 64, 0.125, 3, attn_backend=ABE.PALLAS_GPU, block_size=16,
                        dtype=jnp.bfloat16).metadata_builder  # fmt: skip
    decode = builder.cascade_block_sizes(num_tokens=64, pages_per_req=144)
    assert decode.block_q == 16 and decode.num_kv_splits == 18  # 4 q-blocks x 3 heads; 36 tiles of 64 keys / 2
    prefill = builder.cascade_block_sizes(num_tokens=4096, pages_per_req=144)
    assert prefill.num_kv_splits == 1
    f32 = Attention(9, 64, 0.125, 3, attn_backend=ABE.PALLAS_GPU, block_size=16, dtype=jnp.float32).metadata_builder
    decode = f32.cascade_block_sizes(num_tokens=64, pages_per_req=144)
    assert decode.rows(3) == 16 and decode.num_kv_splits == 5  # 16 q-blocks x 3 heads = 48 programs: 264 // 48
    fp8 = Attention(9, 64, 0.125, 3, attn_backend=ABE.PALLAS_GPU, block_size=16, dtype=jnp.float32,
                    kv_cache_dtype="fp8", query_quant=True).metadata_builder  # fmt: skip
    assert fp8.cascade_block_sizes(num_tokens=64, pages_per_req=144).block_q == 16  # e4m3 dots: tensor cores
    batch = GpuBlockSizes(block_q=4, pages_per_tile=4, num_kv_splits=2, num_warps=8)
    suffix = builder.cascade_suffix_block_sizes(batch, "decode")
    assert (suffix.block_q, suffix.tile(16), suffix.num_warps, suffix.num_kv_splits) == (4, 32, 4, 1)
    assert builder.cascade_suffix_block_sizes(batch, "mixed") == batch
    wide_pages = Attention(9, 64, 0.125, 3, attn_backend=ABE.PALLAS_GPU, block_size=128).metadata_builder
    assert wide_pages.cascade_suffix_block_sizes(batch, "decode").tile(128) == 32  # part of a page


def _s1_builder(dtype, **kwargs):
    """PALLAS_GPU's builder for SmolLM2-135M's attention (9 / 3 heads, head 64, page 16) on an H100."""
    builder = Attention(9, 64, 0.125, 3, attn_backend=ABE.PALLAS_GPU, block_size=16, dtype=dtype,
                        **kwargs).metadata_builder  # fmt: skip
    builder.device_kind = "NVIDIA H100 80GB HBM3"
    return builder


def _decides(builder, prefix, num_reqs, seq_len, **kwargs):
    return builder.use_cascade_attention(
        prefix, np.ones(num_reqs, np.int32), 9, 3, False, False, 132, seq_lens=np.full(num_reqs, seq_len), **kwargs
    )


def test_pallas_gpu_cascade_rule_weighs_float32_dot_work():
    """Issue 49: S1 scaled to 16 x (1024 shared + 32 own) tokens, 128 new. bfloat16 (tensor
    cores; the saving is the prefix's bytes): 15 x 1024 tokens of 768 bytes a layer (11.25 MiB)
    are under ``CASCADE_MIN_SAVED_BYTES`` (measured on an H200: cascade 1.12x slower), S1's own
    64 x 2048 (94.5 MiB) over it; FP8 caches save half as many bytes. float32
    (FMA dots; a program's time is rows x keys): cascade while the model puts its two launches
    at most the plain one (2,576 against 4,240 at the first decode step, 4,384 against 4,736
    at the end), not once the requests' own tokens outgrow the prefix (16 x (1024 + 476):
    9,120 against 4,800); at S1's own 64 x (2048 + 64) always."""
    bf16, f32 = _s1_builder(jnp.bfloat16), _s1_builder(jnp.float32)
    assert not bf16.fma_dots and f32.fma_dots
    assert bf16.cascade_saved_bytes(1024, 16) == 15 * 1024 * 768
    for seq_len in (1057, 1184):
        assert not _decides(bf16, 1024, 16, seq_len) and _decides(bf16, 1024, 16, seq_len, performance_model=False)
    assert _decides(bf16, 2048, 64, 2113)
    assert f32.cascade_fma_model(1024, np.ones(16), seq_lens=np.full(16, 1057)) == (2576, 4240)
    # plain: 16 requests x 3 heads x 4 splits in one wave, 16 rows over 265 keys; cascade: the
    # prefix part's 4 q-blocks x 3 heads x 8 splits over 128 keys, then the suffix's 16 rows over 33
    assert _decides(f32, 1024, 16, 1057) and _decides(f32, 1024, 16, 1184)
    assert f32.cascade_fma_model(1024, np.ones(16), seq_lens=np.full(16, 1184)) == (4384, 4736)
    assert f32.cascade_fma_model(1024, np.ones(16), seq_lens=np.full(16, 1500)) == (9120, 4800)
    assert not _decides(f32, 1024, 16, 1500)
    assert _decides(f32, 1024, 16, 1500, performance_model=False)  # the thresholds alone
    assert not _decides(f32, 128, 16, 1500, performance_model=False)  # ... still hold
    for seq_len in (2113, 2240):  # S1: 64 x (2048 + 64), 128 new: the prefix dominates
        assert _decides(f32, 2048, 64, seq_len)
    # FP8 attention quantises a float32 model's query to e4m3: tensor-core dots, the bytes rule
    fp8 = _s1_builder(jnp.float32, kv_cache_dtype="fp8", query_quant=True)
    assert not fp8.fma_dots and fp8.cascade_saved_bytes(2048, 64) == 63 * 2048 * 384
    assert not _decides(fp8, 1024, 16, 1184) and _decides(fp8, 2048, 64, 2113)
    # without seq_lens the suffix is the new tokens alone
    assert f32.use_cascade_attention(1024, np.ones(16, np.int32), 9, 3, False, False, 0)
    assert "float32 layers (FMA dots)" in f32.cascade_summary()


def test_the_float32_prefix_part_lowers_to_decode_sized_fma_dots():
    """What issue 49's float32 cascade ran, lowered for an abstract H100 from the CPU: the
    prefix part's dots were 64 x 64 x 64 at IEEE precision (FMA loops: no float32 MMA), 4x
    the rows of the plain decode path's; now they are the plain path's 16 rows. bfloat16
    keeps its 64-row MMA tiles."""
    from tests.ops.triton_lowering import export_for_h100

    n, prefix = 16, 1024
    shapes = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        shape = dict(num_q_heads=9, num_kv_heads=3, head_size=64, block_size=16)
        batch = make_ragged_batch(0, [1] * n, [prefix + 64] * n, **shape, dtype=dtype, shuffle_blocks=False)
        batch = batch.with_shared_prefix(prefix)
        layer = Attention(9, 64, 0.125, 3, block_size=16, dtype=dtype, attn_backend=ABE.PALLAS_GPU)
        layer.impl.interpret = False
        md = layer.metadata_builder.build(prefix, batch.common_metadata())
        q, k, v = (x.reshape(n, -1) for x in (batch.q, batch.k, batch.v))
        _, modules = export_for_h100(lambda q, k, v, c, md=md, layer=layer: layer(q, k, v, c, md), q, k, v,
                                     jnp.asarray(batch.kv_cache))  # fmt: skip
        kernels = [m for m in modules if "ragged_paged_attention_gpu" in m]
        assert len(kernels) == 2  # the prefix part, then the suffix part
        dots = [line for line in kernels[0].splitlines() if "tt.dot" in line]
        shapes[dtype] = {line.split(": tensor<")[1].split("x")[0] for line in dots}  # the rows of q
        if dtype == jnp.float32:
            assert all("inputPrecision" not in line for line in dots)  # IEEE: FMA loops
    assert shapes == {jnp.float32: {"16"}, jnp.bfloat16: {"64"}}


def test_pallas_tpu_cascade_matches_its_own_non_cascade_output_in_tpu_interpreter():
    """PALLAS_TPU chooses cascade with the XLA thresholds; both parts on the Mosaic TPU kernel
    (TPU interpreter, its own cache layout) give the non-cascade layer's output and the oracle's.
    The kernels run on a 2-page prefix (the interpreter is slow); the thresholds on the 256-token one."""
    prefix = 32
    batch = make_ragged_batch(0, [1, 3, 1, 2], [prefix + n for n in (5, 0, 17, 9)], num_q_heads=4, num_kv_heads=2,
                              head_size=64, block_size=16, num_tokens=9).with_shared_prefix(prefix)  # fmt: skip
    options = make_options(batch, logits_soft_cap=10.0, sinks=True)
    layer = Attention(4, 64, options["sm_scale"], 2, logits_soft_cap=10.0, sinks=options["sinks"],
                      attn_backend=ABE.PALLAS_TPU, block_size=16)  # fmt: skip
    builder = layer.metadata_builder
    args = dict(query_lens=_batch().query_lens, num_query_heads=4, num_kv_heads=2, num_sms=132)
    assert builder.use_cascade_attention(PREFIX, use_alibi=False, use_sliding_window=False, **args)
    assert not builder.use_cascade_attention(PREFIX - 16, use_alibi=False, use_sliding_window=False, **args)
    assert not builder.use_cascade_attention(PREFIX, use_alibi=False, use_sliding_window=True, **args)
    assert not builder.use_cascade_attention(PREFIX, **{**args, "query_lens": np.ones(7)}, use_alibi=False,
                                             use_sliding_window=False)  # fmt: skip
    md = builder.build(prefix + 7, batch.common_metadata())  # rounded down to whole pages
    assert int(md.cascade_prefix_len) == prefix
    plain = builder.build(0, batch.common_metadata())
    assert plain.cascade_prefix_len is None
    T = batch.q.shape[0]
    qkv = (batch.q.reshape(T, -1), batch.k.reshape(T, -1), batch.v.reshape(T, -1))
    cache = pallas_tpu.from_reference_layout(batch.kv_cache)
    out, new_cache = layer(*qkv, cache, md)
    expected_out, expected_cache = layer(*qkv, cache, plain)
    n = batch.num_actual_tokens
    tol = TOLERANCES["float32"]
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(expected_cache))
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(expected_out[:n]), rtol=tol.rtol, atol=tol.atol)
    expected = attention_oracle(
        np.asarray(batch.q), *read_back(batch, pallas_tpu.to_reference_layout(new_cache)), batch.query_lens, **options
    )
    np.testing.assert_allclose(np.asarray(out[:n]).reshape(expected.shape), expected, rtol=tol.rtol, atol=tol.atol)


def test_builders_without_cascade_refuse_a_common_prefix():
    class NoCascadeBuilder(XLAMetadataBuilder):
        supports_cascade = False

    layer = Attention(4, 64, 0.1, 2, attn_backend=ABE.XLA, block_size=16)
    builder = NoCascadeBuilder(layer.metadata_builder.kv_cache_spec)
    md = _batch().common_metadata()
    assert not builder.use_cascade_attention(PREFIX, np.ones(8), 4, 2, False, False, 132)
    assert NoCascadeBuilder.cascade_summary().startswith("never")
    with pytest.raises(ValueError, match=r"common_prefix_len=256: NoCascadeBuilder has no cascade"):
        builder.build(PREFIX, md)


def test_pallas_gpu_builds_both_parts_once_per_step_and_advances_the_suffix():
    """The builder derives each part's q-blocks and the suffix's tables once (not every
    layer's call), as the op would; a multi-step decode moves the suffix's q-blocks as
    building the later batch would and keeps the prefix part's."""
    layer = Attention(4, 32, 0.2, 2, attn_backend=ABE.PALLAS_GPU, block_size=16)
    builder = layer.metadata_builder
    tables = np.concatenate([np.tile([[7, 3]], (3, 1)), 10 + np.arange(9).reshape(3, 3)], axis=1).astype(np.int32)
    seq_lens, prefix = np.array([40, 50, 70]), 32
    buckets = MetadataBuckets((16,), (4,), (5,))

    def built(lens):
        md = build_common_attn_metadata(np.ones(3, np.int32), lens.astype(np.int32), tables, 16, buckets)
        return md, builder.build_for_jit(md, common_prefix_len=prefix + 5)

    md, first = built(seq_lens)
    assert int(first.cascade_prefix_len) == prefix
    qsl = np.asarray(md.query_start_loc)
    want_prefix = gpu_schedule(
        np.array([0, 3]), np.array([prefix]), num_tokens=16, block_q=first.cascade_block_sizes.block_q, xp=np
    )
    want_suffix = gpu_schedule(
        qsl, np.asarray(md.seq_lens) - prefix, num_tokens=16, block_q=first.cascade_suffix_block_sizes.block_q, xp=np
    )
    np.testing.assert_array_equal(first.cascade_schedule, want_prefix)
    np.testing.assert_array_equal(first.cascade_suffix_schedule, want_suffix)
    np.testing.assert_array_equal(first.cascade_suffix_tables[:3, :3], tables[:, 2:])
    steps, active = np.array([3, 0, 2]), np.array([True, False, True])
    moved = builder.advance_decode(first, jnp.asarray(np.pad(steps, (0, 1))), jnp.asarray(np.pad(active, (0, 1))))
    _, later = built(seq_lens + steps)

    def columns(schedule):  # the q-blocks may come in another order
        return sorted(map(tuple, np.asarray(schedule).T.tolist()))

    assert columns(moved.cascade_suffix_schedule) == columns(later.cascade_suffix_schedule)
    np.testing.assert_array_equal(moved.cascade_schedule, later.cascade_schedule)
    np.testing.assert_array_equal(moved.cascade_suffix_tables, later.cascade_suffix_tables)
