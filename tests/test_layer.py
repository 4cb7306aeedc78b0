"""The JAX Attention layer: construction, selection, errors, jit with a donated cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from attn_jax.backends.pallas_tpu import PallasTPUAttentionBackend
from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.layer import Attention, CacheConfig, debug_checks_enabled, set_debug_checks
from attn_jax.metadata import CommonAttentionMetadata, MetadataBuckets, build_common_attn_metadata
from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.testing.workloads import make_ragged_batch
from tests.oracle import attention_oracle

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 32
BUCKETS = MetadataBuckets(token_buckets=(8, 16, 32), request_buckets=(2, 4), blocks_per_request_buckets=(4, 8))


def make_layer(**kwargs) -> Attention:
    args = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS)
    args.update(kwargs)
    args.setdefault("block_size", BLOCK_SIZE)
    args.setdefault("dtype", jnp.float32)
    return Attention(**args)


def make_batch(rng, query_lens, seq_lens, buckets=BUCKETS):
    """Metadata with each request's pages drawn at random, plus q/k/v for its tokens."""
    query_lens = np.asarray(query_lens, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    pages = -(-seq_lens // BLOCK_SIZE)
    perm = rng.permutation(NUM_BLOCKS)
    table = np.zeros((len(seq_lens), max(int(pages.max()), 1)), np.int32)
    start = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[start : start + n]
        start += n
    md = build_common_attn_metadata(query_lens, seq_lens, table, BLOCK_SIZE, buckets=buckets)
    t = md.num_tokens
    q = jnp.asarray(rng.normal(size=(t, NUM_HEADS * HEAD_SIZE)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(t, NUM_KV_HEADS * HEAD_SIZE)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(t, NUM_KV_HEADS * HEAD_SIZE)), jnp.float32)
    return md, q, k, v


def run_reference(layer, q, k, v, kv_cache, md, **options):
    t = q.shape[0]
    out, cache = ragged_paged_attention(
        q.reshape(t, NUM_HEADS, HEAD_SIZE), k.reshape(t, NUM_KV_HEADS, HEAD_SIZE),
        v.reshape(t, NUM_KV_HEADS, HEAD_SIZE), kv_cache, md.query_start_loc, md.seq_lens,
        md.block_table_tensor, md.slot_mapping, sm_scale=layer.scale, **options,
    )  # fmt: skip
    return out.reshape(t, -1), cache


def test_selects_xla_on_cpu_and_allocates_its_cache():
    layer = make_layer(prefix="model.layers.0.attn")
    assert layer.attn_backend is XLAAttentionBackend
    cache = layer.init_kv_cache(NUM_BLOCKS)
    assert cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert cache.dtype == jnp.float32
    text = repr(layer)
    for part in ("prefix='model.layers.0.attn'", "num_heads=4", "num_kv_heads=2", "head_size=8", "backend=XLA"):
        assert part in text


@pytest.mark.parametrize(
    ("cache_dtype", "expected"),
    [("auto", jnp.bfloat16), ("float32", jnp.float32), ("fp8", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2)],
)
def test_cache_config_sets_cache_dtype_and_block_size(cache_dtype, expected):
    layer = make_layer(cache_config=CacheConfig(block_size=8, cache_dtype=cache_dtype), dtype=jnp.bfloat16)
    cache = layer.init_kv_cache(3)
    assert cache.shape == (2, 3, 8, NUM_KV_HEADS, HEAD_SIZE)
    assert cache.dtype == expected


def test_per_layer_sliding_window_wins_over_cache_config():
    layer = make_layer(cache_config=CacheConfig(block_size=BLOCK_SIZE, sliding_window=64), per_layer_sliding_window=8)
    assert layer.sliding_window == 8
    assert "sliding_window=8" in repr(layer)


def test_layer_matches_the_op_on_flat_and_head_shaped_inputs():
    rng = np.random.default_rng(0)
    layer = make_layer(logits_soft_cap=5.0, per_layer_sliding_window=6)
    md, q, k, v = make_batch(rng, [1, 5, 3], [9, 5, 12])
    cache = layer.init_kv_cache(NUM_BLOCKS, fill=np.nan)
    expected, expected_cache = run_reference(layer, q, k, v, cache, md, logits_soft_cap=5.0, sliding_window=6)
    out, new_cache = layer(q, k, v, cache, md)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(new_cache, expected_cache)
    t = q.shape[0]
    out3, _ = layer(q.reshape(t, NUM_HEADS, HEAD_SIZE), k.reshape(t, NUM_KV_HEADS, HEAD_SIZE),
                    v.reshape(t, NUM_KV_HEADS, HEAD_SIZE), cache, md)  # fmt: skip
    np.testing.assert_array_equal(out3, expected)


def test_kv_sharing_layer_reads_but_never_writes():
    rng = np.random.default_rng(1)
    owner = make_layer(prefix="layers.0")
    sharer = make_layer(prefix="layers.1", kv_sharing_target_layer_name="layers.0")
    md, q, k, v = make_batch(rng, [2, 1], [2, 7])
    cache = jnp.asarray(rng.normal(size=owner.init_kv_cache(NUM_BLOCKS).shape), jnp.float32)
    _, cache = owner(q, k, v, cache, md)
    out, after = sharer(q, k * 100, v * 100, cache, md)
    np.testing.assert_array_equal(after, cache)
    expected, _ = owner(q, k, v, cache, md)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_jit_donates_the_cache_and_compiles_once_per_bucket():
    rng = np.random.default_rng(2)
    layer = make_layer()
    traces = []

    def step(q, k, v, kv_cache, md):
        traces.append(q.shape)
        return layer(q, k, v, kv_cache, md)

    jitted = jax.jit(step, donate_argnums=3)
    cache = layer.init_kv_cache(NUM_BLOCKS)
    md, q, k, v = make_batch(rng, [1, 4, 2], [6, 4, 10])
    old = cache
    out, cache = jitted(q, k, v, cache, md)
    assert old.is_deleted()
    md2, q2, k2, v2 = make_batch(rng, [3, 2, 1], [3, 12, 9])  # new values, same buckets
    _, cache = jitted(q2, k2, v2, cache, md2)
    assert len(traces) == 1 and jitted._cache_size() == 1
    hlo = jitted.lower(q, k, v, cache, md).compile().as_text()
    assert "input_output_alias" in hlo  # the cache's buffer is reused: updated in place
    md3, q3, k3, v3 = make_batch(rng, [9, 1, 1], [9, 2, 3])  # more tokens: the next bucket
    jitted(q3, k3, v3, layer.init_kv_cache(NUM_BLOCKS), md3)
    assert jitted._cache_size() == 2


def test_padding_to_a_bucket_never_changes_real_rows():
    rng = np.random.default_rng(3)
    layer = make_layer(per_layer_sliding_window=5)
    query_lens, seq_lens = [1, 6, 2], [13, 6, 4]
    tight = MetadataBuckets(token_buckets=(9,), request_buckets=(3,), blocks_per_request_buckets=(4,))
    md_tight, q, k, v = make_batch(rng, query_lens, seq_lens, buckets=tight)
    md_wide = build_common_attn_metadata(
        np.asarray(query_lens, np.int32), np.asarray(seq_lens, np.int32),
        np.asarray(md_tight.block_table_tensor), BLOCK_SIZE,
        buckets=MetadataBuckets(token_buckets=(32,), request_buckets=(8,), blocks_per_request_buckets=(8,)),
    )  # fmt: skip
    pad = md_wide.num_tokens - 9

    def padded(x, fill):
        return jnp.concatenate([x, jnp.full((pad, x.shape[1]), fill, x.dtype)])

    cache = layer.init_kv_cache(NUM_BLOCKS, fill=np.nan)  # unused slots hold NaN
    # The requests' cached context holds finite keys and values (a request's own NaN would reach its rows).
    table = np.asarray(md_tight.block_table_tensor)
    context = [table[r, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
               for r, (n, s) in enumerate(zip(query_lens, seq_lens, strict=True)) for p in range(s - n)]  # fmt: skip
    kv = jnp.asarray(rng.normal(size=(len(context), NUM_KV_HEADS * HEAD_SIZE)), jnp.float32)
    cache = layer.write_to_kv_cache(cache, kv, kv, jnp.asarray(context, jnp.int32))
    out_tight, cache_tight = layer(q, k, v, cache, md_tight)
    out_a, cache_a = layer(padded(q, 1e4), padded(k, 1e4), padded(v, 1e4), cache, md_wide)
    out_b, cache_b = layer(padded(q, -3.0), padded(k, 7.0), padded(v, 0.5), cache, md_wide)
    # Same bucket, different padding: real rows and the cache are bit-for-bit the same.
    np.testing.assert_array_equal(out_a[:9], out_b[:9])
    np.testing.assert_array_equal(cache_a, cache_b)
    assert np.isfinite(out_a).all() and np.isfinite(out_b).all()
    # Another bucket: the same values up to float32 summation order.
    np.testing.assert_allclose(out_a[:9], out_tight, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cache_a, cache_tight)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "chunk", "window"),
    [
        ([4, 10, 5], [2, 7, 4], 4, None),  # vLLM's worked example, with block_size 2
        ([1, 7, 3, 0], [9, 0, 13, 5], 4, None),  # decode, prefill, chunked prefill, empty
        ([6, 1], [5, 11], 8, 3),  # a window inside the chunk
    ],
)
def test_chunked_local_attention_matches_the_oracle(query_lens, context_lens, chunk, window):
    batch = make_ragged_batch(
        0, query_lens, context_lens, num_q_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE, block_size=2, num_tokens=sum(query_lens) + 3, num_padding_requests=1,
    )  # fmt: skip
    qsl, seq_lens = np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens)
    md = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, query_start_loc_cpu=qsl,
        seq_lens=batch.seq_lens, seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=seq_lens - np.diff(qsl), num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(np.diff(qsl).max()),
        block_table_tensor=batch.block_tables, slot_mapping=batch.slot_mapping,
    )  # fmt: skip
    layer = make_layer(block_size=2, attention_chunk_size=chunk, per_layer_sliding_window=window)
    out, _ = layer(batch.q, batch.k, batch.v, batch.kv_cache, md)
    expected = attention_oracle(
        batch.q, batch.k_seqs, batch.v_seqs, batch.query_lens, sm_scale=layer.scale,
        sliding_window=window, attention_chunk_size=chunk,
    )  # fmt: skip
    real = batch.num_actual_tokens
    np.testing.assert_allclose(out[:real].reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    assert np.isfinite(out).all()


def test_chunked_local_attention_needs_host_built_metadata_under_jit():
    rng = np.random.default_rng(5)
    layer = make_layer(attention_chunk_size=2 * BLOCK_SIZE)
    md, q, k, v = make_batch(rng, [1, 2], [5, 2])
    cache = layer.init_kv_cache(NUM_BLOCKS)
    with pytest.raises(ValueError, match="attention_chunk_size=8.*outside jax.jit"):
        jax.jit(layer.__call__)(q, k, v, cache, md)
    local_md = layer.metadata_builder.build(0, md)
    out, _ = jax.jit(layer.__call__)(q, k, v, cache, local_md)
    np.testing.assert_allclose(out, layer(q, k, v, cache, md)[0], rtol=1e-6)


def test_encoder_only_attends_both_ways():
    rng = np.random.default_rng(6)
    layer = make_layer(attn_type="encoder_only")
    md, q, k, v = make_batch(rng, [3, 2], [3, 2])
    cache = layer.init_kv_cache(NUM_BLOCKS, fill=np.nan)
    out, _ = layer(q, k, v, cache, md)
    expected, _ = run_reference(layer, q, k, v, cache, md, causal=False)
    np.testing.assert_array_equal(out, expected)
    causal, _ = make_layer()(q, k, v, cache, md)
    assert not np.allclose(out[:3], causal[:3])


def test_cross_attention_reads_encoder_kv_written_by_the_caller():
    # Two decoder requests (3 and 1 query tokens) over encoder outputs of 5 and 2 tokens.
    batch = make_ragged_batch(
        0, [3, 1], [5, 2], num_q_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=2
    )  # context = the encoder tokens, already in the cache
    enc_lens = np.array([5, 2], np.int32)
    qsl = np.asarray(batch.query_start_loc)
    md = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=enc_lens, seq_lens_cpu=enc_lens,
        num_computed_tokens_cpu=enc_lens, num_reqs=2, num_actual_tokens=4, max_query_len=3,
        block_table_tensor=batch.block_tables, slot_mapping=np.full(4, -1, np.int32),
    )  # fmt: skip
    layer = make_layer(attn_type="encoder_decoder", block_size=2)
    out, cache = layer(batch.q, None, None, batch.kv_cache, md)
    np.testing.assert_array_equal(np.isnan(cache), np.isnan(batch.kv_cache))
    encoder_k = [ks[:n] for ks, n in zip(batch.k_seqs, enc_lens, strict=True)]
    encoder_v = [vs[:n] for vs, n in zip(batch.v_seqs, enc_lens, strict=True)]
    # Non-causal: each decoder token sees its request's whole encoder output.
    expected = attention_oracle(batch.q, encoder_k, encoder_v, [3, 1], sm_scale=layer.scale, causal=False)
    np.testing.assert_allclose(out.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="encoder_decoder' takes key=None"):
        layer(batch.q, batch.k, batch.v, batch.kv_cache, md)


def test_calculate_kv_scales_sets_scales_from_the_first_batch():
    rng = np.random.default_rng(7)
    layer = make_layer(cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="fp8", calculate_kv_scales=True))
    md, q, k, v = make_batch(rng, [2, 1], [2, 3])
    cache = layer.init_kv_cache(NUM_BLOCKS)
    with pytest.raises(ValueError, match="calc_kv_scales"):
        jax.jit(layer.__call__)(q, k, v, cache, md)
    layer(q, k, v, cache, md)
    assert float(layer.k_scale) == pytest.approx(float(jnp.abs(k).max()) / 200.0)
    assert float(layer.v_scale) == pytest.approx(float(jnp.abs(v).max()) / 100.0)
    assert not layer.calculate_kv_scales


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(num_kv_heads=3), ValueError, r"num_heads=4 must be divisible by num_kv_heads=3"),
        (dict(use_mla=True), NotImplementedError, r"use_mla=True"),
        (dict(use_sparse=True), NotImplementedError, r"use_sparse=True"),
        (dict(kv_cache_dtype="int8"), ValueError, r"'int8'.*auto, bfloat16"),
        (dict(attn_type="cross"), ValueError, r"'cross'.*'decoder'"),
        (dict(attention_chunk_size=6), ValueError, r"attention_chunk_size=6.*block_size=4"),
        (dict(head_size=0), ValueError, r"head_size=0"),
        (dict(prefix="a", kv_sharing_target_layer_name="a"), ValueError, r"'a' names this layer"),
        (dict(attn_backend=PallasTPUAttentionBackend), ValueError, r"PALLAS_TPU cannot serve.*head_size=8 is not"),
        (dict(alibi_slopes=[1.0, 2.0]), ValueError, r"alibi_slopes.*\(4,\)"),
        (dict(per_layer_sliding_window=0), ValueError, r"sliding_window=0 must be None \(no window\) or a positive"),
        (dict(per_layer_sliding_window=-3), ValueError, r"sliding_window=-3 must be None"),
        (dict(cache_config=CacheConfig(4, "auto", 0, False)), ValueError, r"sliding_window=0 must be None"),
        (dict(scale=0.0), ValueError, r"scale=0.0 must be a finite number > 0 \(the softmax scale"),
        (dict(scale=-0.1), ValueError, r"scale=-0.1 must be a finite number > 0"),
        (dict(scale=float("inf")), ValueError, r"scale=inf must be a finite number > 0"),
        (dict(scale=float("nan")), ValueError, r"scale=nan must be a finite number > 0"),
        (dict(scale=None), ValueError, r"scale=None must be a finite number > 0"),
        (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap=0.0 must be None \(no cap\) or a finite number > 0"),
        (dict(logits_soft_cap=-2.0), ValueError, r"logits_soft_cap=-2.0 must be None"),
        (dict(logits_soft_cap=float("nan")), ValueError, r"logits_soft_cap=nan must be None"),
        (dict(dtype="floatx"), TypeError, r"Unsupported activation dtype: 'floatx'. Valid dtypes are: float32"),
        (dict(attention_chunk_size="64"), ValueError, r"attention_chunk_size='64' must be a positive integer"),
        (dict(per_layer_sliding_window=4.0), ValueError, r"sliding_window=4.0 must be None \(no window\)"),
    ],
)
def test_constructor_errors_name_the_value(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make_layer(**kwargs)


def test_numpy_scalars_are_accepted_wherever_python_numbers_are():
    layer = make_layer(num_heads=np.int64(NUM_HEADS), num_kv_heads=np.int32(NUM_KV_HEADS), scale=np.float32(0.125),
                       per_layer_sliding_window=np.int64(4), logits_soft_cap=np.float64(30.0),
                       block_size=np.int64(BLOCK_SIZE), attention_chunk_size=np.int64(2 * BLOCK_SIZE))  # fmt: skip
    assert (layer.scale, layer.sliding_window, layer.logits_soft_cap) == (0.125, 4, 30.0)
    assert type(layer.scale) is float and type(layer.sliding_window) is int and type(layer.block_size) is int


def test_x64_default_dtype_asks_for_dtype():
    with jax.enable_x64(True), pytest.raises(TypeError, match=r"float64 with jax_enable_x64 on.*pass dtype="):
        Attention(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS)
    with jax.enable_x64(True):
        assert Attention(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, dtype=jnp.float32).dtype == np.float32


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_activations_of_another_dtype_are_refused(use_jit):
    """The torch layer's rule: no silent bfloat16 through a float32 layer (the backend was chosen for float32)."""
    layer = make_layer()
    md, q, k, v = make_batch(np.random.default_rng(11), [1, 3], [4, 3])
    call = jax.jit(layer.__call__) if use_jit else layer.__call__
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with pytest.raises(TypeError, match=r"query.dtype=bfloat16 but layer '' was built .* for dtype=float32"):
        call(*bf16, layer.init_kv_cache(NUM_BLOCKS), md)
    with pytest.raises(TypeError, match=r"value.dtype=bfloat16 must equal query.dtype=float32"):
        call(q, k, bf16[2], layer.init_kv_cache(NUM_BLOCKS), md)


def test_key_rows_must_match_query_rows():
    layer = make_layer()
    md, q, k, v = make_batch(np.random.default_rng(12), [1, 3], [4, 3])
    with pytest.raises(ValueError, match=r"key has 4 token rows but query has 8: key and value hold one row per"):
        layer(q, k[:4], v, layer.init_kv_cache(NUM_BLOCKS), md)


def test_metadata_given_as_python_lists_is_converted():
    layer = make_layer()
    md, q, k, v = make_batch(np.random.default_rng(13), [1, 3], [4, 3])
    fields = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "query_start_loc_cpu")
    as_lists = CommonAttentionMetadata(**{**md.__dict__, **{f: getattr(md, f).tolist() for f in fields}})
    assert all(isinstance(getattr(as_lists, f), np.ndarray) and getattr(as_lists, f).dtype == np.int32 for f in fields)
    want, _ = layer(q, k, v, layer.init_kv_cache(NUM_BLOCKS), md)
    got, _ = layer(q, k, v, layer.init_kv_cache(NUM_BLOCKS), as_lists)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.fixture
def debug_checks():
    set_debug_checks(True)
    yield
    set_debug_checks(False)


def _edited(md, **fields):
    return CommonAttentionMetadata(**{**md.__dict__, **fields})


def _bad_metadata(md, case):
    table, seq_lens, slots = md.block_table_tensor.copy(), md.seq_lens.copy(), md.slot_mapping.copy()
    if case == "block_id":
        table[0, 0] = NUM_BLOCKS + 3  # request 0's context page
        return _edited(
            md, block_table_tensor=table
        ), rf"block_tables\[0, 0\]={NUM_BLOCKS + 3} is outside \[0, num_blocks=32\)"
    if case == "seq_len":
        seq_lens[1] = 1  # request 1 has 3 new tokens
        return _edited(md, seq_lens=seq_lens), r"seq_lens\[1\]=1 is less than request 1's query length 3"
    slots[2] = NUM_BLOCKS * BLOCK_SIZE
    return _edited(md, slot_mapping=slots), r"slot_mapping\[2\]=128 is outside \[-1, num_blocks \* block_size=128\)"


@pytest.mark.parametrize("case", ["block_id", "seq_len", "slot"])
def test_checked_mode_turns_metadata_checks_into_errors_under_jit(case, debug_checks):
    layer = make_layer()
    md, q, k, v = make_batch(np.random.default_rng(14), [1, 3], [6, 3])
    bad, message = _bad_metadata(md, case)
    with pytest.raises(ValueError, match=message):  # eager: the host checks, as always
        layer(q, k, v, layer.init_kv_cache(NUM_BLOCKS), bad)
    checked = checkify.checkify(jax.jit(layer.__call__))
    err, _ = checked(q, k, v, layer.init_kv_cache(NUM_BLOCKS), bad)
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()
    err, (out, _) = checked(q, k, v, layer.init_kv_cache(NUM_BLOCKS), md)  # good metadata, same compiled step
    assert err.get() is None and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match="not functionalized"):  # on but not checkified: never runs unchecked
        jax.jit(layer.__call__)(q, k, v, layer.init_kv_cache(NUM_BLOCKS), bad)


def test_default_jitted_path_is_check_free():
    layer = make_layer()
    md, q, k, v = make_batch(np.random.default_rng(15), [1, 3], [6, 3])
    assert not debug_checks_enabled()
    jaxpr = str(jax.make_jaxpr(layer.__call__)(q, k, v, layer.init_kv_cache(NUM_BLOCKS), md))
    assert "check" not in jaxpr
    bad, _ = _bad_metadata(md, "block_id")
    jax.jit(layer.__call__)(q, k, v, layer.init_kv_cache(NUM_BLOCKS), bad)  # unchecked: runs (documented)


def test_call_rejects_misshaped_query():
    rng = np.random.default_rng(8)
    layer = make_layer()
    md, q, k, v = make_batch(rng, [1], [1])
    with pytest.raises(ValueError, match=r"query.shape=\(8, 31\) must be \[T, 32\] or \[T, 4, 8\]"):
        layer(q[:, :31], k, v, layer.init_kv_cache(NUM_BLOCKS), md)


def test_call_rejects_a_cache_of_another_dtype():
    rng = np.random.default_rng(9)
    layer = make_layer()  # float32 activations, "auto" cache: float32
    md, q, k, v = make_batch(rng, [1], [1])
    cache = layer.init_kv_cache(NUM_BLOCKS).astype(jnp.float16)
    with pytest.raises(TypeError, match=r"kv_cache.dtype=float16 but this layer's cache holds float32"):
        layer(q, k, v, cache, md)


def test_call_names_a_cache_with_other_kv_heads():
    rng = np.random.default_rng(10)
    layer = make_layer()
    md, q, k, v = make_batch(rng, [1], [1])
    other = make_layer(num_heads=4, num_kv_heads=1).init_kv_cache(NUM_BLOCKS)
    with pytest.raises(ValueError, match=r"kv_cache.shape=.* does not match this layer's XLA cache .*num_kv_heads=2"):
        layer(q, k, v, other, md)


def test_write_to_kv_cache_uses_the_backends_layout():
    from attn_jax.backends import pallas_tpu

    rng = np.random.default_rng(11)
    k, v = (jnp.asarray(rng.normal(size=(3, NUM_KV_HEADS * 128)), jnp.float32) for _ in range(2))
    slots = np.array([5, -1, 17], np.int32)
    caches = {}
    for backend in (XLAAttentionBackend, PallasTPUAttentionBackend):
        layer = make_layer(head_size=128, scale=0.1, block_size=16, attn_backend=backend)
        caches[backend] = layer.write_to_kv_cache(layer.init_kv_cache(4), k, v, slots)
    as_reference = pallas_tpu.to_reference_layout(caches[PallasTPUAttentionBackend])
    np.testing.assert_array_equal(np.asarray(as_reference), np.asarray(caches[XLAAttentionBackend]))
    flat = np.asarray(caches[XLAAttentionBackend]).reshape(2, -1, NUM_KV_HEADS, 128)
    np.testing.assert_array_equal(flat[0, 17], np.asarray(k)[2].reshape(NUM_KV_HEADS, 128))
