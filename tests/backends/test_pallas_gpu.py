"""The PALLAS_GPU backend: selection on a (mocked) GPU, its reasons, its builder, and the
Attention layer running its kernel in the Pallas interpreter against the XLA backend."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import Attention, build_common_attn_metadata
from attn_jax.backends import pallas_gpu
from attn_jax.backends.base import AttentionSpec
from attn_jax.backends.pallas_gpu import (
    PallasGPUAttentionBackend,
    PallasGPUAttentionImpl,
    PallasGPUAttentionMetadata,
    PallasGPUMetadataBuilder,
)
from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.metadata import MetadataBuckets
from attn_jax.ops.ragged_paged_attention import pallas_triton
from attn_jax.platforms import Platform
from attn_jax.registry import AttentionBackendEnum as ABE
from attn_jax.selector import explain_attn_backend_selection, get_attn_backend, global_force_attn_backend

GPU = Platform("gpu", "NVIDIA H100 80GB HBM3", 1)
CPU = Platform("cpu", "cpu", 1)


def test_selected_on_gpu_platforms_with_every_feature():
    assert get_attn_backend(128, jnp.bfloat16, platform=GPU) is PallasGPUAttentionBackend
    args = (64, jnp.float16, "fp8_e4m3", 32)
    assert get_attn_backend(*args, has_sink=True, attn_type="encoder_only", platform=GPU) is PallasGPUAttentionBackend
    assert get_attn_backend(128, jnp.bfloat16, platform=CPU) is XLAAttentionBackend


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(head_size=100), "head_size=100 is not supported; supported: multiples of 8 up to 256"),
        (dict(block_size=24), "block_size=24 is not supported; supported: [1, 2, 4, 8, 16, 32, 64, 128, 256]"),
        (dict(use_mla=True), "MLA is not supported"),
    ],
)
def test_unsupported_configurations_are_reasons_and_forced_errors(kwargs, reason):
    args = dict(head_size=128, dtype=jnp.bfloat16, kv_cache_dtype="auto", block_size=16) | kwargs
    report = explain_attn_backend_selection(**args, platform=GPU)
    assert reason in report.row(ABE.PALLAS_GPU).reasons
    if not kwargs.get("use_mla"):
        assert report.chosen is ABE.XLA  # the fallback, with PALLAS_GPU's reason in the report
    global_force_attn_backend(ABE.PALLAS_GPU)
    with pytest.raises(ValueError, match=re.escape("Forced attention backend PALLAS_GPU cannot serve")) as e:
        get_attn_backend(**args, platform=GPU)
    assert reason in str(e.value)


def test_builder_plans_on_the_host_per_mode():
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.float32, num_q_heads=8)
    builder = PallasGPUMetadataBuilder(spec, device_kind=None)
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    buckets = MetadataBuckets(token_buckets=(8, 64), request_buckets=(4,), blocks_per_request_buckets=(4,))
    decode = build_common_attn_metadata([1, 1, 1], [5, 20, 33], tables, block_size=16, buckets=buckets)
    mixed = build_common_attn_metadata([1, 7, 1], [5, 20, 33], tables, block_size=16, buckets=buckets)
    md_decode, md_mixed = builder.build(0, decode), builder.build(0, mixed)
    assert isinstance(md_decode, PallasGPUAttentionMetadata) and isinstance(md_decode.schedule, np.ndarray)
    assert md_decode.block_sizes.block_q * 4 == 16  # decode: 16 rows of one token x group 4
    assert md_mixed.block_sizes.block_q * 4 == 64
    # A mixed batch's decodes: the decode bucket's blocks on the launch's warps and stages, a block each.
    assert md_decode.decode_block_sizes is None
    dbs, bs = md_mixed.decode_block_sizes, md_mixed.block_sizes
    assert dbs.block_q * 4 == 16
    assert (dbs.num_warps, dbs.num_stages, dbs.num_kv_splits) == (bs.num_warps, bs.num_stages, 1)
    num_tokens, num_reqs = md_mixed.slot_mapping.shape[0], md_mixed.block_tables.shape[0]
    assert md_mixed.schedule.shape[1] == pallas_triton.max_num_q_blocks(num_tokens, num_reqs, bs.block_q) + num_reqs
    traced = jax.jit(lambda md: builder.build(0, md).schedule)(mixed)
    np.testing.assert_array_equal(np.asarray(traced), md_mixed.schedule)
    small = MetadataBuckets(token_buckets=(4,), request_buckets=(4,), blocks_per_request_buckets=(4,))
    decode_small = build_common_attn_metadata([1, 1, 1], [5, 20, 33], tables, block_size=16, buckets=small)
    sizes = []
    jax.jit(lambda md: sizes.append(builder.build(0, md).block_sizes))(decode_small)
    assert sizes[0].block_q * 4 == 16, "traced, a bucket with T <= R takes decode block sizes"


def test_forced_on_cpu_warns_and_interprets(caplog, monkeypatch):
    monkeypatch.setattr(pallas_gpu, "current_platform", lambda: CPU)
    with caplog.at_level(logging.WARNING, logger="attn_jax.backends.pallas"):
        impl = PallasGPUAttentionImpl(8, 64, 0.125, 2)
    assert impl.interpret
    assert "PALLAS_GPU runs in the Pallas interpreter" in caplog.text


def test_impl_rejects_other_metadata():
    impl = PallasGPUAttentionImpl(8, 64, 0.125, 2, interpret=True)
    with pytest.raises(TypeError, match="PALLAS_GPU needs PallasGPUAttentionMetadata"):
        impl.forward(None, None, None, None, object())


def test_a_prefill_batch_shares_the_mixed_program():
    """A prefill batch is built as a mixed batch, its decode part empty: one compile key per
    bucket for both (issue 46), with the Mosaic GPU split (a long request in a bucket of at
    least ``MGPU_SPLIT_MIN_TILES`` tiles on Hopper) or without it (a smaller bucket, no
    Hopper GPU). A mixed batch with no long request takes no split: a key of its own."""
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=np.dtype(jnp.bfloat16), num_q_heads=4)
    tables = np.arange(32, dtype=np.int32).reshape(2, 16)
    hopper = PallasGPUMetadataBuilder(spec, device_kind="NVIDIA H100 80GB HBM3", mgpu_prefill=True)
    a100 = PallasGPUMetadataBuilder(spec, device_kind="NVIDIA A100-SXM4-80GB", mgpu_prefill=True)
    tile_tokens = PallasGPUMetadataBuilder.MGPU_SPLIT_MIN_TILES * 128
    for tokens, builder, split in [(256, hopper, False), (tile_tokens, hopper, True), (tile_tokens, a100, False)]:
        buckets = MetadataBuckets((tokens,), (2,), (16,))
        prefill = build_common_attn_metadata([200, 30], [200, 30], tables, block_size=16, buckets=buckets)
        mixed = build_common_attn_metadata([200, 1], [200, 30], tables, block_size=16, buckets=buckets)
        short = build_common_attn_metadata([100, 1], [100, 30], tables, block_size=16, buckets=buckets)
        md_prefill, md_mixed, md_short = (builder.build_for_jit(x) for x in (prefill, mixed, short))
        assert (md_prefill.mgpu_schedule is not None) == split, (tokens, builder.device_kind)
        assert jax.tree.structure(md_prefill) == jax.tree.structure(md_mixed), (tokens, builder.device_kind)
        assert (jax.tree.structure(md_short) != jax.tree.structure(md_mixed)) == split
        assert md_prefill.decode_block_sizes is not None
        assert not (md_prefill.schedule[4, :2] > 0).any(), "the decode part holds no block"
        if split:
            assert not (md_prefill.rest_schedule[4, :2] > 0).any(), "nor the rest's decode part"
            assert (md_mixed.rest_schedule[4, :2] > 0).sum() == 1, "the mixed batch's decode is there"


@pytest.mark.parametrize("options", [dict(), dict(per_layer_sliding_window=5, logits_soft_cap=3.0, sinks=True)])
@pytest.mark.parametrize("query_lens", [(1, 9, 1), (4, 9, 2)], ids=["mixed", "prefill"])
def test_layer_matches_the_xla_layer_under_jit(options, query_lens):
    rng = np.random.default_rng(0)
    sinks = rng.normal(size=8).astype(np.float32) if options.pop("sinks", False) else None
    kwargs = dict(num_heads=8, head_size=32, scale=32**-0.5, num_kv_heads=2, block_size=16, dtype=jnp.float32)
    layers = [Attention(**kwargs, **options, sinks=sinks, attn_backend=b)
              for b in (PallasGPUAttentionBackend, XLAAttentionBackend)]  # fmt: skip
    assert layers[0].attn_backend is PallasGPUAttentionBackend
    query_lens, seq_lens = np.array(query_lens, np.int32), np.array([30, 12, 3], np.int32)
    tables = rng.permutation(12).astype(np.int32).reshape(3, 4)
    md = build_common_attn_metadata(query_lens, seq_lens, tables, block_size=16)
    T = md.num_tokens
    q = jnp.asarray(rng.normal(size=(T, 8 * 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(T, 2 * 32)), jnp.float32) for _ in range(2))
    cache = jnp.asarray(rng.normal(size=XLAAttentionBackend.get_kv_cache_shape(12, 16, 2, 32)), jnp.float32)
    outs = []
    for layer in layers:
        step = jax.jit(layer.__call__)
        out, new_cache = step(q, k, v, cache, layer.metadata_builder.build(0, md))
        outs.append((np.asarray(out)[: int(query_lens.sum())], np.asarray(new_cache)))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
