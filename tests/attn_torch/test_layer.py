"""attn_torch.Attention against the float64 oracle on random ragged batches, the in-place
cache contract, and one test per error message."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import attn_torch
from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.testing.workloads import make_ragged_batch
from attn_torch import Attention, bind_kv_cache, build_common_attn_metadata, set_forward_context
from bridge.dlpack import SUPPORTED_DTYPES, BridgeError, to_jax, to_torch
from tests.ops.ragged_checks import check_cache, check_output, make_options

_NAMES = iter(range(10**6))


def _name() -> str:
    return f"test_layer.{next(_NAMES)}"


def common_metadata(batch, as_torch: bool = False) -> CommonAttentionMetadata:
    """The batch's CommonAttentionMetadata; ``as_torch``: device fields as int64 torch tensors."""
    qsl = np.asarray(batch.query_start_loc)
    seq_lens = np.asarray(batch.seq_lens)
    device = {
        "query_start_loc": qsl,
        "seq_lens": seq_lens,
        "block_table_tensor": np.asarray(batch.block_tables),
        "slot_mapping": np.asarray(batch.slot_mapping),
    }
    if as_torch:
        device = {k: torch.from_numpy(v.astype(np.int64)) for k, v in device.items()}
    query_lens = np.diff(qsl)
    return CommonAttentionMetadata(
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=(seq_lens - query_lens).astype(np.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query_lens.max(initial=0)),
        **device,
    )


def torch_copy(array) -> torch.Tensor:
    """A torch-owned copy of a jax array (any bridge dtype)."""
    view = to_torch(array)
    return torch.empty(view.shape, dtype=view.dtype).copy_(view)


CASES = {
    "decode": dict(query_lens=[1, 1, 1], context_lens=[7, 20, 3]),
    "prefill": dict(query_lens=[6, 9], context_lens=[0, 0]),
    "mixed_padded": dict(query_lens=[1, 5, 0, 3], context_lens=[13, 4, 6, 0], num_tokens=16),
    "window_softcap_sinks": dict(
        query_lens=[1, 4], context_lens=[17, 6], options=dict(sliding_window=5, logits_soft_cap=7.0, sinks=True)
    ),
    "bf16": dict(query_lens=[1, 3], context_lens=[9, 2], dtype=torch.bfloat16),
    "fp8_e4m3": dict(query_lens=[1, 2], context_lens=[11, 5], cache_dtype="fp8_e4m3"),
    "encoder_only": dict(query_lens=[5, 3], context_lens=[0, 0], options=dict(causal=False)),
    "torch_int64_metadata": dict(query_lens=[1, 4], context_lens=[6, 2], torch_metadata=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_layer_matches_oracle(case):
    spec = dict(CASES[case])
    dtype = spec.pop("dtype", torch.float32)
    cache_dtype = spec.pop("cache_dtype", "auto")
    torch_metadata = spec.pop("torch_metadata", False)
    opts = spec.pop("options", {})
    num_q_heads, num_kv_heads, head_size, block_size = 4, 2, 16, 4
    batch = make_ragged_batch(
        list(CASES).index(case), spec["query_lens"], spec["context_lens"], num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size, dtype=SUPPORTED_DTYPES[dtype],
        cache_dtype_str=cache_dtype, num_tokens=spec.get("num_tokens"), extra_blocks=2,
    )  # fmt: skip
    options = make_options(batch, **opts)
    layer = Attention(
        num_q_heads, head_size, options["sm_scale"], num_kv_heads, prefix=_name(),
        per_layer_sliding_window=options["sliding_window"], logits_soft_cap=options["logits_soft_cap"],
        attn_type="decoder" if options["causal"] else "encoder_only", block_size=block_size,
        kv_cache_dtype=cache_dtype, dtype=dtype, sinks=options["sinks"],
    )  # fmt: skip
    if batch.k_scale is not None:
        layer.set_kv_scales(batch.k_scale, batch.v_scale)
    cache = torch_copy(batch.kv_cache)
    bind_kv_cache({layer.layer_name: cache})
    pointer = cache.data_ptr()
    q, k, v = (torch_copy(x) for x in (batch.q, batch.k, batch.v))
    with torch.inference_mode(), set_forward_context(common_metadata(batch, as_torch=torch_metadata)):
        out = layer(q.flatten(1), k.flatten(1), v.flatten(1))
    assert out.shape == (q.shape[0], num_q_heads * head_size) and out.dtype == dtype
    assert layer.kv_cache[0] is cache and cache.data_ptr() == pointer, "the cache must be updated in place"
    check_cache(batch, to_jax(cache))
    check_output(batch, options, to_jax(out.unflatten(1, (num_q_heads, head_size)).contiguous()), to_jax(cache))


def test_decode_step_writes_only_the_new_slots():
    """Bytes moved into the cache per decode step: exactly the new tokens' k/v rows."""
    layer = Attention(4, 16, 0.25, 2, prefix=_name(), block_size=4)
    cache = layer.init_kv_cache(16)
    cache.normal_()
    bind_kv_cache({layer.layer_name: cache})
    before = cache.clone()
    md = build_common_attn_metadata([1, 1], [9, 3], np.array([[5, 2, 7], [11, 0, 0]]), block_size=4)
    q, k, v = torch.randn(md.num_tokens, 64), torch.randn(md.num_tokens, 32), torch.randn(md.num_tokens, 32)
    with torch.no_grad(), set_forward_context(md):
        out = layer(q, k, v)
    changed = (cache != before).reshape(2, -1, 2 * 16).any(-1)  # [2, slots]: slot rows that changed
    slots = [7 * 4 + 0, 11 * 4 + 2]  # position 8 -> page 7 offset 0; position 2 -> page 11 offset 2
    assert sorted(torch.nonzero(changed[0]).flatten().tolist()) == slots
    assert sorted(torch.nonzero(changed[1]).flatten().tolist()) == slots
    flat = cache.view(2, -1, 2, 16)
    torch.testing.assert_close(flat[0, slots], k[:2].view(2, 2, 16), rtol=0, atol=0)
    torch.testing.assert_close(flat[1, slots], v[:2].view(2, 2, 16), rtol=0, atol=0)
    assert out.shape == (md.num_tokens, 64)


def test_step_output_is_the_only_new_buffer():
    """The jitted step's only output is f[T, Hq, D]: the cache is read through a view, never copied out."""
    layer = Attention(4, 16, 0.25, 2, prefix=_name(), block_size=4)
    cache = layer.init_kv_cache(4096)  # 4 MiB: large against the step's own buffers
    bind_kv_cache({layer.layer_name: cache})
    md = build_common_attn_metadata([1, 1], [9, 3], np.array([[5, 2, 7], [11, 0, 0]]), block_size=4)
    with set_forward_context(md) as ctx:
        prepared = ctx.prepare(layer.layer_name, layer._jax.metadata_builder, cache.device)
        q = to_jax(torch.zeros(md.num_tokens, 4, 16))
        compiled = layer._step.lower(
            q, to_jax(cache), prepared.backend_metadata, layer._jax.k_scale, layer._jax.v_scale
        )
        stats = compiled.compile().memory_analysis()
    assert stats.output_size_in_bytes == md.num_tokens * 4 * 16 * 4
    assert stats.temp_size_in_bytes < cache.numel() * cache.element_size() // 8


ON_CUDA = torch.cuda.is_available() and any(d.platform == "gpu" for d in jax.devices())
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_CUDA, reason="needs an NVIDIA GPU")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_cache_crosses_once_and_each_step_sees_the_earlier_writes(monkeypatch, device):
    """Decoding token by token equals one prefill of the same tokens, with one cache crossing.

    The cache's JAX view is made once per bound tensor; torch's in-place writes of later
    steps must still be visible through it. Rebinding makes a new view.
    """
    crossed = []

    def counting_to_jax(tensor, *, name="tensor"):
        crossed.append(name)
        return to_jax(tensor, name=name)

    monkeypatch.setattr(attn_torch.layer, "to_jax", counting_to_jax)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, n, generator=gen).to(device) for n in (64, 32, 32))
    table = np.array([[3, 1]])

    def run(layer, steps):
        outs = []
        for start, stop in steps:
            md = build_common_attn_metadata([stop - start], [stop], table, block_size=4)
            pad = (0, 0, 0, md.num_tokens - (stop - start))  # activations padded to the metadata's tokens
            q_, k_, v_ = (torch.nn.functional.pad(x[start:stop], pad) for x in (q, k, v))
            with torch.no_grad(), set_forward_context(md):
                outs.append(layer(q_, k_, v_)[: stop - start])
        return outs

    decoder = Attention(4, 16, 0.25, 2, prefix=_name(), block_size=4)
    bind_kv_cache({decoder.layer_name: decoder.init_kv_cache(4, device)})
    decoded = run(decoder, [(0, 2), (2, 3), (3, 4), (4, 5)])
    assert crossed.count("kv_cache") == 1 and crossed.count("query") == 4

    prefiller = Attention(4, 16, 0.25, 2, prefix=_name(), block_size=4)
    bind_kv_cache({prefiller.layer_name: prefiller.init_kv_cache(4, device)})
    (prefilled,) = run(prefiller, [(0, 5)])
    torch.testing.assert_close(torch.cat(decoded), prefilled, rtol=1e-5, atol=1e-5)

    bind_kv_cache({decoder.layer_name: decoder.init_kv_cache(4, device)})  # a fresh cache: a new view
    run(decoder, [(0, 1)])
    assert crossed.count("kv_cache") == 3


def test_kv_sharing_layer_reads_its_target_cache():
    target = Attention(2, 16, 0.25, 1, prefix=_name(), block_size=4)
    sharer = Attention(2, 16, 0.25, 1, prefix=_name(), block_size=4, kv_sharing_target_layer_name=target.layer_name)
    cache = target.init_kv_cache(8)
    bind_kv_cache({target.layer_name: cache}, {target.layer_name: target, sharer.layer_name: sharer})
    assert sharer.kv_cache[0] is cache
    md = build_common_attn_metadata([3], [3], np.array([[1]]), block_size=4)
    q, k = torch.randn(md.num_tokens, 32), torch.randn(md.num_tokens, 16)
    with torch.no_grad(), set_forward_context(md):
        a = target(q, k, k)
        before = cache.clone()
        b = sharer(q, k + 1, k + 1)  # a sharing layer does not write
    assert torch.equal(cache, before)
    torch.testing.assert_close(a, b)


def test_per_layer_metadata_dict():
    a, b = (Attention(2, 16, 0.25, prefix=_name(), block_size=4) for _ in range(2))
    bind_kv_cache({a.layer_name: a.init_kv_cache(4), b.layer_name: b.init_kv_cache(4)})
    md = build_common_attn_metadata([2], [2], np.array([[0]]), block_size=4)
    x = torch.randn(md.num_tokens, 32)
    with torch.no_grad(), set_forward_context({a.layer_name: md}):
        a(x, x, x)
        with pytest.raises(ValueError, match=rf"no entry for layer '{b.layer_name}'; it has: \['{a.layer_name}'\]"):
            b(x, x, x)


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def bound():
    layer = Attention(4, 16, 0.25, 2, prefix=_name(), block_size=4)
    bind_kv_cache({layer.layer_name: layer.init_kv_cache(8)})
    md = build_common_attn_metadata([1, 2], [5, 2], np.array([[0, 1], [2, 0]]), block_size=4)
    T = md.num_tokens
    return layer, md, torch.randn(T, 64), torch.randn(T, 32), torch.randn(T, 32)


def test_forward_outside_forward_context(bound):
    layer, _, q, k, v = bound
    with pytest.raises(
        RuntimeError, match="outside a forward context: wrap the model call in `with attn_torch.set_forward"
    ):
        layer(q, k, v)


def test_layer_without_bound_cache():
    layer = Attention(2, 16, 0.25, prefix=_name(), block_size=4)
    md = build_common_attn_metadata([1], [1], np.array([[0]]), block_size=4)
    x = torch.randn(md.num_tokens, 32)
    with (
        set_forward_context(md),
        pytest.raises(RuntimeError, match=rf"Layer '{layer.layer_name}' has no bound KV cache"),
    ):
        layer(x, x, x)


def test_non_contiguous_query(bound):
    layer, md, q, k, v = bound
    wide = torch.randn(q.shape[0], 2 * 64)
    with set_forward_context(md), pytest.raises(BridgeError, match="query with shape=.* is not C-contiguous"):
        layer(wide[:, ::2], k, v)


def test_misaligned_query(bound):
    layer, md, q, k, v = bound
    storage = torch.randn(q.numel() + 1)
    misaligned = storage[1:].view(q.shape)
    with set_forward_context(md), pytest.raises(BridgeError, match="query's data pointer .* is not 64-byte aligned"):
        layer(misaligned, k, v)


def test_query_requiring_grad(bound):
    layer, md, q, k, v = bound
    with set_forward_context(md), pytest.raises(BridgeError, match="query requires grad"):
        layer(q.requires_grad_(), k, v)


def test_tensors_on_different_devices(bound):
    layer, md, q, k, v = bound
    with set_forward_context(md), pytest.raises(BridgeError, match="key is on meta but query is on cpu"):
        layer(q, k.to("meta"), v)
    bind_kv_cache({layer.layer_name: layer.init_kv_cache(8, device="meta")})
    with (
        set_forward_context(md),
        pytest.raises(BridgeError, match="query is on cpu but layer .*'s KV cache is on meta"),
    ):
        layer(q, k, v)


def test_kv_dtype_differs_from_query(bound):
    layer, md, q, k, v = bound
    with (
        set_forward_context(md),
        pytest.raises(TypeError, match=r"key.dtype=bfloat16 must equal query.dtype=float32"),
    ):
        layer(q, k.bfloat16(), v)


def test_query_dtype_differs_from_layer(bound):
    layer, md, q, k, v = bound
    with (
        set_forward_context(md),
        pytest.raises(TypeError, match=r"query.dtype=float16 but layer .* for dtype=float32"),
    ):
        layer(q.half(), k.half(), v.half())


def test_cache_dtype_mismatch(bound):
    layer, *_ = bound
    with pytest.raises(
        ValueError,
        match=r"kv_cache.dtype=torch.bfloat16 .* kv_cache_dtype='auto' with activation dtype torch.float32: "
        r"expected torch.float32",
    ):
        bind_kv_cache({layer.layer_name: torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16)})


def test_cache_shape_mismatch(bound):
    layer, *_ = bound
    with pytest.raises(ValueError, match=r"kv_cache.shape=\(2, 8, 4, 4, 16\) .* must be \[2, num_blocks, 4, 2, 16\]"):
        bind_kv_cache({layer.layer_name: torch.zeros(2, 8, 4, 4, 16)})


def test_int64_metadata_out_of_int32_range(bound):
    layer, md, q, k, v = bound
    big = md.slot_mapping.astype(np.int64)
    big[0] = 2**31 + 5
    md = CommonAttentionMetadata(**{**md.__dict__, "slot_mapping": torch.from_numpy(big)})
    with (
        set_forward_context(md),
        pytest.raises(BridgeError, match=r"slot_mapping\[0\]=2147483653 is outside int32's range"),
    ):
        layer(q, k, v)


def test_slot_outside_the_cache(bound):
    layer, md, q, k, v = bound
    slots = md.slot_mapping.copy()
    slots[0] = 8 * 4
    md = CommonAttentionMetadata(**{**md.__dict__, "slot_mapping": slots})
    with set_forward_context(md), pytest.raises(ValueError, match=r"slot_mapping\[0\]=32 is outside \[-1, num_blocks"):
        layer(q, k, v)


def _edited(md, **fields) -> CommonAttentionMetadata:
    """``md`` with some device fields replaced (a hand-edited batch)."""
    return CommonAttentionMetadata(**{**md.__dict__, **fields})


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (8, r"block_tables\[0, 0\]=8 is outside \[0, num_blocks=8\)"),  # a read-only page past the cache
        (-1, r"block_tables\[0, 0\]=-1 is outside \[0, num_blocks=8\)"),
    ],
)
def test_block_ids_are_checked_against_the_bound_cache(bound, entry, message):
    """As the JAX layer does in eager mode (before: clamped to the last block, or zeros for -1)."""
    layer, md, q, k, v = bound
    table = md.block_table_tensor.copy()
    table[0, 0] = entry  # request 0's context page: read, never written
    with set_forward_context(_edited(md, block_table_tensor=table)), pytest.raises(ValueError, match=message):
        layer(q, k, v)


def test_seq_lens_below_query_lens_are_refused(bound):
    layer, md, q, k, v = bound
    seq_lens = md.seq_lens.copy()
    seq_lens[1] = 1  # request 1 has 2 new tokens
    with (
        set_forward_context(_edited(md, seq_lens=seq_lens)),
        pytest.raises(ValueError, match=r"seq_lens\[1\]=1 is less than request 1's query length 2"),
    ):
        layer(q, k, v)


@pytest.mark.parametrize("rows", [17, 2], ids=["more_than_q", "fewer_than_real_tokens"])
def test_key_and_value_rows_must_match_query_rows(bound, rows):
    layer, md, q, _, _ = bound
    k = v = torch.randn(rows, 32)
    with set_forward_context(md), pytest.raises(ValueError, match=rf"key has {rows} token rows but query has 16"):
        layer(q, k, v)


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -1.0])
def test_set_kv_scales_refuses_scales_that_zero_the_cache(bad):
    layer = Attention(2, 16, 0.25, prefix=_name(), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=rf"k_scale={bad!r} must be a finite number > 0"):
        layer.set_kv_scales(bad, 1.0)
    with pytest.raises(ValueError, match=rf"v_scale={bad!r} must be a finite number > 0"):
        layer.set_kv_scales(np.float32(0.5), bad)
    layer.set_kv_scales(np.float32(0.5), 2)  # NumPy scalars and ints are numbers too
    assert (layer._k_scale_float, layer._v_scale_float) == (0.5, 2.0)


def test_non_contiguous_cache_is_refused_at_bind(bound):
    layer, *_ = bound
    cache = layer.init_kv_cache(8).transpose(1, 2).contiguous().transpose(1, 2)  # right shape, wrong strides
    with pytest.raises(BridgeError, match=r"kv_cache with shape=\(2, 8, 4, 2, 16\) and strides=.* is not contiguous"):
        bind_kv_cache({layer.layer_name: cache})


def test_nonfinite_key_reaches_exactly_the_rows_that_see_it():
    """Through the bridge as in the op: k[1] = NaN in a 4-token prefill gives rows [finite, NaN, NaN, NaN]
    (before: 0.0); a padding row's NaN query reaches nothing."""
    layer = Attention(2, 16, 0.25, prefix=_name(), block_size=4)
    bind_kv_cache({layer.layer_name: layer.init_kv_cache(4)})
    md = build_common_attn_metadata([4], [4], np.array([[2]]), block_size=4)
    q, k, v = torch.randn(md.num_tokens, 32), torch.randn(md.num_tokens, 32), torch.randn(md.num_tokens, 32)
    k[1] = float("nan")
    q[5] = float("nan")  # a padding row
    with torch.inference_mode(), set_forward_context(md):
        out = layer(q, k, v)
    assert torch.isnan(out[1:4]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[4:]).all()


def test_token_rows_must_match_metadata(bound):
    layer, md, q, k, v = bound
    with set_forward_context(md), pytest.raises(ValueError, match=r"query has 3 token rows but .* slot_mapping has 16"):
        layer(q[:3], k[:3], v[:3])


def test_bad_query_width(bound):
    layer, md, q, k, v = bound
    with pytest.raises(ValueError, match=r"query.shape=\(16, 60\) must be \[T, 64\] or \[T, 4, 16\]"):
        layer(q[:, :60], k, v)


def test_duplicate_prefix():
    layer = Attention(2, 16, 0.25, prefix=_name())
    with pytest.raises(ValueError, match=f"Duplicate layer name: '{layer.layer_name}'"):
        Attention(2, 16, 0.25, prefix=layer.layer_name)


def test_unsupported_activation_dtype():
    with pytest.raises(TypeError, match="Unsupported activation dtype=torch.float64. Valid dtypes are: torch.float32"):
        Attention(2, 16, 0.25, prefix=_name(), dtype=torch.float64)


def test_quant_config_is_refused():
    with pytest.raises(NotImplementedError, match="quant_config"):
        Attention(2, 16, 0.25, prefix=_name(), quant_config=object())


def test_repr_names_the_backend():
    layer = Attention(2, 16, 0.25, prefix="repr.attn")
    assert "prefix='repr.attn'" in repr(layer) and "backend=XLA" in repr(layer)
    assert attn_torch.Attention is Attention
