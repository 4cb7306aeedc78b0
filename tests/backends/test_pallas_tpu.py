"""The PALLAS_TPU backend: selection on a (mocked) TPU, its reasons, its cache layout,
its builder, and the Attention layer running its kernel in the TPU interpreter."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import Attention, build_common_attn_metadata
from attn_jax.backends import pallas_tpu
from attn_jax.backends.base import AttentionSpec
from attn_jax.backends.pallas_tpu import (
    PallasTPUAttentionBackend,
    PallasTPUAttentionImpl,
    PallasTPUAttentionMetadata,
    PallasTPUMetadataBuilder,
)
from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.kv_cache import allocate_kv_cache
from attn_jax.metadata import MetadataBuckets
from attn_jax.platforms import Platform
from attn_jax.registry import AttentionBackendEnum as ABE
from attn_jax.selector import explain_attn_backend_selection, get_attn_backend, global_force_attn_backend

TPU = Platform("tpu", "TPU v6 lite", 8)
CPU = Platform("cpu", "cpu", 1)


def test_selected_on_tpu_platforms():
    assert get_attn_backend(128, jnp.bfloat16, platform=TPU) is PallasTPUAttentionBackend
    assert get_attn_backend(64, jnp.float32, "fp8_e5m2", 32, has_sink=True, platform=TPU) is PallasTPUAttentionBackend
    assert get_attn_backend(128, jnp.bfloat16, platform=CPU) is XLAAttentionBackend


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(head_size=112), "head_size=112 is not supported; supported: [64, 80, 96, 128, 192, 256]"),
        (dict(block_size=8), "block_size=8 is not supported; supported: [16, 32, 64, 128, 256]"),
        (dict(dtype=jnp.float16), "dtype=float16 is not supported; supported: ['float32', 'bfloat16']"),
        (dict(kv_cache_dtype="float16"), "kv_cache_dtype='float16' is not supported"),
        (
            dict(kv_cache_dtype="fp8_e4m3", block_size=16),
            "kv_cache_dtype='fp8_e4m3' with block_size=16: fp8 pages need block_size >= 32",
        ),
    ],
)
def test_unsupported_configurations_are_reasons_and_forced_errors(kwargs, reason):
    args = dict(head_size=128, dtype=jnp.bfloat16, kv_cache_dtype="auto", block_size=16) | kwargs
    report = explain_attn_backend_selection(**args, platform=TPU)
    assert report.chosen is ABE.XLA  # the fallback on a TPU
    assert any(r.startswith(reason) for r in report.row(ABE.PALLAS_TPU).reasons), report.row(ABE.PALLAS_TPU).reasons
    global_force_attn_backend(ABE.PALLAS_TPU)
    with pytest.raises(ValueError, match=re.escape("Forced attention backend PALLAS_TPU cannot serve")) as e:
        get_attn_backend(**args, platform=TPU)
    assert reason in str(e.value)


def test_cache_shape_layout_and_allocation():
    shape = PallasTPUAttentionBackend.get_kv_cache_shape(7, 16, 8, 128, "fp8")
    assert shape == (7, 8, 16, 256)
    assert PallasTPUAttentionBackend.get_kv_cache_stride_order() == (0, 1, 2, 3)
    assert PallasTPUAttentionBackend.get_required_kv_cache_layout() == "HND"
    cache = allocate_kv_cache(PallasTPUAttentionBackend, 7, 16, 8, 128, "fp8_e5m2")
    assert cache.shape == shape and cache.dtype == jnp.float8_e5m2
    with pytest.raises(ValueError, match="num_blocks"):
        PallasTPUAttentionBackend.get_kv_cache_shape(0, 16, 8, 128)


def _layer(backend, **kw):
    return Attention(8, 128, 128**-0.5, num_kv_heads=2, block_size=16, attn_backend=backend, **kw)


def _batch(num_blocks=8):
    query_lens = np.array([1, 7, 0, 2], np.int32)
    seq_lens = np.array([20, 7, 5, 18], np.int32)
    table = np.arange(8, dtype=np.int32).reshape(4, 2) % num_blocks
    buckets = MetadataBuckets(token_buckets=(16,), blocks_per_request_buckets=(2,))  # small: a quick interpreter
    md = build_common_attn_metadata(query_lens, seq_lens, table, 16, buckets)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((md.num_tokens, 8 * 128), np.float32))
    k = jnp.asarray(rng.standard_normal((md.num_tokens, 2 * 128), np.float32))
    v = jnp.asarray(rng.standard_normal((md.num_tokens, 2 * 128), np.float32))
    cache = jnp.asarray(rng.standard_normal((2, num_blocks, 16, 2, 128), np.float32))  # reference layout
    return md, q, k, v, cache


def test_layer_forced_on_cpu_runs_the_interpreter_and_matches_xla(caplog):
    md, q, k, v, ref_cache = _batch()
    with caplog.at_level(logging.WARNING, logger="attn_jax.backends.pallas"):
        layer = _layer(PallasTPUAttentionBackend, sinks=np.linspace(-1, 1, 8), per_layer_sliding_window=9)
    assert layer.impl.interpret and "runs in the TPU interpreter" in caplog.text
    xla = _layer(XLAAttentionBackend, sinks=np.linspace(-1, 1, 8), per_layer_sliding_window=9)
    expected, expected_cache = xla(q, k, v, ref_cache, md)
    step = jax.jit(layer.__call__, donate_argnums=3)  # the builder runs traced inside
    out, cache = step(q, k, v, pallas_tpu.from_reference_layout(ref_cache), md)
    n = md.num_actual_tokens
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(expected)[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(pallas_tpu.to_reference_layout(cache)), np.asarray(expected_cache))


def test_builder_computes_schedule_and_block_sizes_on_the_host():
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=jnp.bfloat16)
    builder = PallasTPUMetadataBuilder(spec, device_kind="TPU v6 lite")
    md = build_common_attn_metadata([1, 1, 1], [30, 4, 9], np.zeros((3, 2), np.int32), 16)
    built = builder.build(0, md)
    assert isinstance(built, PallasTPUAttentionMetadata)
    assert isinstance(built.schedule, np.ndarray)  # host-side: no device work per step
    assert built.block_sizes.q_tokens_per_block == 16  # decode-only: one bf16 sublane tile of tokens
    bq = built.block_sizes.q_tokens_per_block
    expected = pallas_tpu.pallas_mosaic_tpu.tpu_schedule(md.query_start_loc, md.num_tokens, bq, xp=np)
    np.testing.assert_array_equal(built.schedule, expected)
    leaves, treedef = jax.tree_util.tree_flatten(built)
    assert len(leaves) == 5  # block sizes are static: part of the jit key, not a leaf
    mixed = builder.build(0, build_common_attn_metadata([1, 40], [30, 40], np.zeros((2, 3), np.int32), 16))
    assert mixed.block_sizes.q_tokens_per_block == 64  # mixed, no long prefill


def test_builder_rejects_buckets_over_smem_capacity():
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=jnp.float32)
    buckets = MetadataBuckets(request_buckets=(512,), blocks_per_request_buckets=(512,))
    md = build_common_attn_metadata([1], [5], np.zeros((1, 1), np.int32), 16, buckets)
    with pytest.raises(ValueError, match=r"needs \d+ bytes of SMEM .* SMEM_SCALAR_PREFETCH_LIMIT_BYTES=524288"):
        PallasTPUMetadataBuilder(spec).build(0, md)


def test_impl_rejects_other_metadata_and_bad_head_sizes():
    impl = PallasTPUAttentionImpl(8, 128, 0.1, 2, interpret=True)
    md, q, k, v, cache = _batch()
    with pytest.raises(TypeError, match="PALLAS_TPU needs PallasTPUAttentionMetadata"):
        impl.forward(q.reshape(-1, 8, 128), k.reshape(-1, 2, 128), v.reshape(-1, 2, 128), cache, md)
    with pytest.raises(ValueError, match=re.escape("head_size=112 is not supported by the TPU kernel")):
        PallasTPUAttentionImpl(8, 112, 0.1, 2, interpret=True)


def test_layer_rejects_a_reference_layout_cache():
    md, q, k, v, ref_cache = _batch()
    layer = _layer(PallasTPUAttentionBackend)
    with pytest.raises(ValueError, match="PALLAS_TPU"):  # the layer's shape check or the kernel's layout check
        layer(q, k, v, ref_cache, md)
