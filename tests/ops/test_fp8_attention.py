"""FP8 attention (``q_scale``: e4m3 query, e4m3 cache, fp8 x fp8 dots, f32 accumulation) against
the float64 oracle, in the jnp reference and the Triton kernel (Pallas interpreter on the CPU,
compiled under the ``gpu`` marker), the Triton IR it lowers to for an H100, and its selection.

The bounds, stated once:

- ``FP8_REL_L2 = 3e-2``: relative L2 error against the float64 oracle on the values FP8 attention
  attends over (the query rounded to e4m3 with q_scale, keys and values as the cache holds
  them). What is left is the e4m3 rounding of the softmax weights for ``p @ v`` (about 1.5 %
  on these batches) and the output's rounding to the activation dtype.
- ``FP8_REL_L2_UNQUANTIZED = 6e-2``: against the oracle on the unquantised q, k and v; e4m3
  storage of q, k and v costs about 3.5-4.5 % on standard-normal inputs by itself.

Batches come from ``make_ragged_batch``: unused cache slots hold NaN, padding rows large finite values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.kv_cache import calc_kv_scales
from attn_jax.ops.ragged_paged_attention import common, pallas_triton, reference
from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import make_options, read_back, rel_l2, run_op
from tests.oracle import attention_oracle, cache_contents

FP8_REL_L2 = 3e-2
FP8_REL_L2_UNQUANTIZED = 6e-2

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (jax sees no 'gpu' backend)")

_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_size=32, block_size=16, cache_dtype_str="fp8_e4m3")
BATCHES = {
    "decode": dict(query_lens=[1, 1, 1, 1], context_lens=[40, 12, 70, 3], num_tokens=6, **_SHAPE),
    "prefill": dict(query_lens=[37, 21], context_lens=[0, 0], num_tokens=60, extra_blocks=2, **_SHAPE),
    "mixed": dict(
        query_lens=[1, 19, 1, 6],
        context_lens=[37, 0, 5, 20],
        num_tokens=30,
        num_padding_requests=1,
        extra_blocks=2,
        **_SHAPE,
    ),  # fmt: skip
    # a head that is not a power of two: the transposed key tile's rows past D masked
    "mixed_head_80": dict(query_lens=[1, 11, 3], context_lens=[30, 0, 17], num_tokens=20, **dict(_SHAPE, head_size=80)),
}
ONE_PASS = GpuBlockSizes(block_q=4, pages_per_tile=1)
SPLIT = GpuBlockSizes(block_q=4, pages_per_tile=1, num_kv_splits=3)


def query_scale(batch) -> jax.Array:
    """vLLM's static q_scale rule (max|q| / 200) on the batch's real rows."""
    n = batch.num_actual_tokens
    return calc_kv_scales(batch.q[:n], batch.k[:n], batch.v[:n])[0] if n else jnp.float32(1.0)


def check_fp8_output(batch, options, out, kv_cache, q_scale) -> tuple[float, float]:
    """``out`` against both float64 oracles within the bounds; returns (err, err_unquantized)."""
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype, (out.shape, out.dtype)
    out = np.asarray(out, np.float64)
    n = batch.num_actual_tokens
    assert np.isfinite(out).all(), "non-finite output: an unused (NaN) cache slot or a padding row leaked"
    q64 = np.asarray(batch.q, np.float64)
    q8 = cache_contents(q64, "fp8_e4m3", float(q_scale)) * float(q_scale)
    expected = attention_oracle(q8, *read_back(batch, kv_cache), batch.query_lens, **options)
    unquantized = attention_oracle(q64, batch.k_seqs, batch.v_seqs, batch.query_lens, **options)
    err, err_unquantized = rel_l2(out[:n], expected), rel_l2(out[:n], unquantized)
    assert err <= FP8_REL_L2, f"relative L2 error {err:.3g} > FP8_REL_L2={FP8_REL_L2} vs the quantised-input oracle"
    assert err_unquantized <= FP8_REL_L2_UNQUANTIZED, (
        f"relative L2 error {err_unquantized:.3g} > FP8_REL_L2_UNQUANTIZED={FP8_REL_L2_UNQUANTIZED}"
    )
    return err, err_unquantized


def run_fp8(batch, options, op, use_jit=True):
    q_scale = query_scale(batch)
    out, cache = run_op(batch, options, use_jit, op=functools.partial(op, q_scale=q_scale))
    return out, cache, q_scale


def _triton(bs):
    return functools.partial(pallas_triton.ragged_paged_attention, block_sizes=bs, interpret=True)


# --- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BATCHES))
def test_reference_matches_oracle_within_bound(name):
    batch = make_ragged_batch(0, **BATCHES[name], dtype=jnp.bfloat16)
    options = make_options(batch)
    out, cache, q_scale = run_fp8(batch, options, reference.ragged_paged_attention)
    err, _ = check_fp8_output(batch, options, out, cache, q_scale)
    assert err > 0  # the weights really are quantised (an exact match would mean a bf16 path)


def test_reference_with_window_soft_cap_alibi_sinks():
    batch = make_ragged_batch(1, **BATCHES["mixed"], dtype=jnp.bfloat16)
    options = make_options(batch, sliding_window=9, logits_soft_cap=5.0, alibi=True, sinks=True)
    check_fp8_output(batch, options, *run_fp8(batch, options, reference.ragged_paged_attention))


def test_reference_lse_matches_oracle():
    batch = make_ragged_batch(2, **BATCHES["mixed"], dtype=jnp.float32)
    options = make_options(batch, sinks=True)
    q_scale = query_scale(batch)
    q, k, v, *rest = batch.op_args
    _, cache, lse = reference.ragged_paged_attention(q, k, v, *rest, **options, **batch.op_kwargs, q_scale=q_scale,
                                                     return_lse=True)  # fmt: skip
    q8 = cache_contents(np.asarray(q, np.float64), "fp8_e4m3", float(q_scale)) * float(q_scale)
    _, expected = attention_oracle(q8, *read_back(batch, cache), batch.query_lens, **options, return_lse=True)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(lse)[:n], expected, rtol=1e-4, atol=1e-4)


@st.composite
def _specs(draw):
    num_reqs = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(0, 12), min_size=num_reqs, max_size=num_reqs))
    heads = draw(st.sampled_from([(2, 2), (8, 2), (4, 1)]))
    batch = dict(
        query_lens=query_lens, context_lens=draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs)),
        num_q_heads=heads[0], num_kv_heads=heads[1], head_size=32, block_size=16, cache_dtype_str="fp8_e4m3",
        dtype=jnp.dtype(draw(st.sampled_from(["float32", "bfloat16"]))),
        num_tokens=max(sum(query_lens), 1) + draw(st.integers(0, 3)), extra_blocks=draw(st.integers(0, 2)),
    )  # fmt: skip
    options = dict(causal=draw(st.booleans()), sliding_window=draw(st.none() | st.integers(1, 20)),
                   sinks=draw(st.booleans()))  # fmt: skip
    return draw(st.integers(0, 2**16)), batch, options


@settings(max_examples=2, deadline=None)
@given(spec=_specs())
def test_random_ragged_batches_reference_and_triton_within_bound(spec):
    seed, batch_kwargs, options = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    options = make_options(batch, **options)
    bs = GpuBlockSizes(max(4, 16 // pallas_triton.next_pow2(batch.q.shape[1] // batch.kv_cache.shape[3])), 1)
    for op in (reference.ragged_paged_attention, _triton(bs)):
        check_fp8_output(batch, options, *run_fp8(batch, options, op))


# --- the Triton kernel in the interpreter ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bs"), [("decode", SPLIT), ("prefill", ONE_PASS), ("mixed", ONE_PASS)],
    ids=["decode_split_kv_sinks", "prefill_one_pass", "mixed_one_pass"],
)  # fmt: skip
def test_triton_matches_oracle_within_bound_interpret(name, bs):
    batch = make_ragged_batch(3, **BATCHES[name], dtype=jnp.bfloat16)
    options = make_options(batch, sinks=bs is SPLIT)
    check_fp8_output(batch, options, *run_fp8(batch, options, _triton(bs)))


def test_quantize_fp8_saturates_and_keeps_nan():
    x = jnp.array([1000.0, -1000.0, jnp.nan, 0.5, 0.0], jnp.float32)
    y = np.asarray(common.quantize_fp8(x, 1.0).astype(jnp.float32))
    np.testing.assert_array_equal(y[[0, 1, 3, 4]], [448.0, -448.0, 0.5, 0.0])
    assert np.isnan(y[2])


# --- lowering for an H100 from the CPU -------------------------------------------------------------


def test_triton_kernel_lowers_to_fp8_dots_for_h100():
    """Both dots are ``tt.dot`` on f8E4M3FN operands with an f32 result (FP8 wgmma on Hopper)."""
    from tests.ops.triton_lowering import export_for_h100

    sds = jax.ShapeDtypeStruct

    def f(q, cache, qsl, lens, table, slots):
        return pallas_triton.ragged_paged_attention(
            q, None, None, cache, qsl, lens, table, slots, sm_scale=128**-0.5, interpret=False,
            q_scale=jnp.float32(0.01), k_scale=jnp.float32(0.02), v_scale=jnp.float32(0.03),
        )  # fmt: skip

    shapes = (sds((512, 32, 128), jnp.bfloat16), sds((2, 1100, 16, 8, 128), jnp.float8_e4m3fn), sds((5,), jnp.int32),
              sds((4,), jnp.int32), sds((4, 256), jnp.int32), sds((512,), jnp.int32))  # fmt: skip
    text, modules = export_for_h100(f, *shapes)
    assert "__gpu$xla.gpu.triton" in text
    dots = [line for text in modules for line in text.splitlines() if "tt.dot" in line]
    assert dots, "no tt.dot in the lowered kernel"
    fp8_dots = [d for d in dots if d.count("xf8E4M3FN>") == 2 and "xf32>" in d]
    assert len(fp8_dots) == len(dots), f"every dot must be e4m3 x e4m3 -> f32: {dots}"
    qk = [d for d in fp8_dots if "x128xf8E4M3FN> * tensor<128x" in d]  # q [rows, D] . k^T [D, tile]
    assert qk and len(qk) < len(fp8_dots), "both the QK^T and the PV dots are fp8"
    fp8_transposes = [line for text in modules for line in text.splitlines() if "tt.trans" in line and "f8" in line]
    assert not fp8_transposes, f"the key tile is loaded transposed, never transposed as fp8: {fp8_transposes}"


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e5m2"])
@pytest.mark.parametrize("op", [reference.ragged_paged_attention, _triton(ONE_PASS)], ids=["reference", "triton"])
def test_q_scale_needs_an_e4m3_cache(cache_dtype, op):
    batch = make_ragged_batch(0, **dict(BATCHES["decode"], cache_dtype_str=cache_dtype))
    want = "float32" if cache_dtype == "auto" else "float8_e5m2"
    with pytest.raises(ValueError, match=rf"kv_cache.dtype={want}; FP8 attention needs kv_cache.dtype=float8_e4m3fn"):
        run_op(batch, make_options(batch), False, op=functools.partial(op, q_scale=jnp.float32(1.0)))


def test_q_scale_must_be_a_scalar():
    batch = make_ragged_batch(0, **BATCHES["decode"])
    with pytest.raises(ValueError, match=r"q_scale has shape \(2,\); it must be a scalar"):
        run_op(batch, make_options(batch), False,
               op=functools.partial(reference.ragged_paged_attention, q_scale=jnp.ones(2)))  # fmt: skip


# --- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "lens",
    [([1] * 8, [300] * 8), ([40, 1, 1, 16], [60, 300, 500, 0]), ([128, 64], [0, 0])],
    ids=["decode", "mixed", "prefill"],
)
def test_triton_compiled_fp8_matches_oracle(lens):
    """Compiled (FP8 wgmma on Hopper) at the benchmark's head shape, every row against the oracle
    (lengths the per-row Python oracle checks in seconds; benchmarks/attention_fp8.py checks P1)."""
    batch = make_ragged_batch(5, *lens, num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                              dtype=jnp.bfloat16, cache_dtype_str="fp8_e4m3", extra_blocks=4)  # fmt: skip
    options = make_options(batch)
    op = functools.partial(pallas_triton.ragged_paged_attention, interpret=False)
    err, err_unquantized = check_fp8_output(batch, options, *run_fp8(batch, options, op))
    print(f"rel L2 {err:.3e} vs the quantised-input oracle, {err_unquantized:.3e} vs the unquantised one")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_size", [128, 64])
def test_mosaic_gpu_prefill_fp8_matches_oracle(head_size):
    """A prefill batch on PALLAS_GPU's split: the long requests in the Mosaic GPU kernel (q.k on
    FP8 wgmma, p @ v in float16), the other rows in the Triton kernel; every row against the oracle."""
    from attn_jax.backends import pallas_gpu as backend
    from attn_jax.ops.ragged_paged_attention.config import MgpuBlockSizes, mgpu_prefill_available

    if not mgpu_prefill_available(jax.devices()[0].device_kind):
        pytest.skip("needs a Hopper GPU (H100/H200) for Mosaic GPU")
    batch = make_ragged_batch(7, [300, 1, 140, 5, 260], [100, 50, 37, 3, 0], num_q_heads=8, num_kv_heads=2,
                              head_size=head_size, block_size=16, dtype=jnp.bfloat16, cache_dtype_str="fp8_e4m3",
                              num_tokens=720, num_padding_requests=1, extra_blocks=3)  # fmt: skip
    bs = GpuBlockSizes(block_q=16, pages_per_tile=4)
    split = backend.mgpu_split(batch.query_start_loc, batch.seq_lens, num_tokens=720, block_q=16,
                               mgpu_bs=MgpuBlockSizes())  # fmt: skip
    assert split["rest_schedule"] is not None
    assert backend.uses_mosaic_gpu(batch.q, batch.kv_cache, interpret=False, block_sizes=bs,
                                   mgpu_schedule=split["mgpu_schedule"], mgpu_block_sizes=MgpuBlockSizes(),
                                   query_quant=True)  # fmt: skip
    options = make_options(batch)
    op = functools.partial(backend.ragged_paged_attention, interpret=False, block_sizes=bs, **split)
    err, err_unquantized = check_fp8_output(batch, options, *run_fp8(batch, options, op))
    print(f"rel L2 {err:.3e} vs the quantised-input oracle, {err_unquantized:.3e} vs the unquantised one")


# --- selection and the layer --------------------------------------------------------------------


def test_selection_serves_fp8_attention_on_xla_and_names_what_cannot():
    from attn_jax import explain_attn_backend_selection, get_attn_backend
    from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend
    from attn_jax.platforms import Platform

    cpu = Platform(kind="cpu", device_kind="cpu", num_devices=1)
    assert get_attn_backend(128, jnp.bfloat16, "fp8", query_quant=True, platform=cpu).get_name() == "XLA"
    with pytest.raises(ValueError, match=r"query_quant=True with kv_cache_dtype='auto': .*\['fp8', 'fp8_e4m3'\]"):
        get_attn_backend(128, jnp.bfloat16, "auto", query_quant=True, platform=cpu)
    report = explain_attn_backend_selection(576, jnp.bfloat16, "fp8", use_mla=True, query_quant=True, platform=cpu)
    assert "FP8 attention (query_quant=True) is not supported" in report.row(report.priority[-1]).reasons
    a100 = Platform(kind="gpu", device_kind="NVIDIA A100-SXM4-80GB", num_devices=1)
    h100 = Platform(kind="gpu", device_kind="NVIDIA H100 80GB HBM3", num_devices=1)
    why = PallasGPUAttentionBackend.validate_configuration(128, jnp.bfloat16, "fp8", 16, platform=a100,
                                                           query_quant=True)  # fmt: skip
    assert why == [
        "FP8 attention (query_quant=True) needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
        "device 'NVIDIA A100-SXM4-80GB' has none"
    ]
    assert PallasGPUAttentionBackend.validate_configuration(128, jnp.bfloat16, "fp8", 16, platform=h100,
                                                            query_quant=True) == []  # fmt: skip


@pytest.mark.parametrize("backend", ["XLA", "PALLAS_GPU"])
def test_layer_query_quant_matches_oracle_within_bound(backend):
    from attn_jax import Attention
    from attn_jax.registry import AttentionBackendEnum

    batch = make_ragged_batch(6, **BATCHES["mixed"], dtype=jnp.bfloat16)
    layer = Attention(8, 32, 32**-0.5, 2, block_size=16, kv_cache_dtype="fp8", dtype=jnp.bfloat16,
                      attn_backend=AttentionBackendEnum[backend], query_quant=True)  # fmt: skip
    assert "query_quant=True" in repr(layer) and layer.attn_backend.get_name() == backend
    n = batch.num_actual_tokens
    layer.calc_kv_scales(batch.q[:n], batch.k[:n], batch.v[:n])
    layer.k_scale, layer.v_scale = jnp.float32(batch.k_scale), jnp.float32(batch.v_scale)  # the batch's cache
    out, cache = layer(batch.q, batch.k, batch.v, batch.kv_cache, batch.common_metadata())
    check_fp8_output(batch, make_options(batch), out.reshape(batch.q.shape), cache, layer.q_scale)


def test_info_says_where_fp8_attention_runs(monkeypatch, capsys):
    from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend
    from attn_jax.cli import main

    monkeypatch.setenv("ATTN_STACK_BACKEND", "PALLAS_GPU")
    assert main(["info", "--kv-cache-dtype", "fp8", "--query-quant"]) == 0
    assert "decode and mixed batches on the Triton kernel (p @ v in e4m3" in capsys.readouterr().out
    h100 = PallasGPUAttentionBackend.kernel_plan(
        128, jnp.bfloat16, "fp8", 16, "NVIDIA H100 80GB HBM3", query_quant=True
    )
    assert "on the Mosaic GPU kernel (pallas_mosaic_gpu" in h100[-1], h100
    h80 = PallasGPUAttentionBackend.kernel_plan(80, jnp.bfloat16, "fp8", 16, "NVIDIA H100 80GB HBM3", query_quant=True)
    assert "whole 32-byte tiles, not 80" in h80[-1], h80


# --- the Mosaic TPU kernel: the TPU interpreter and lowering ----------------------------------------


def _tpu_op(block_sizes):
    from tests.ops.test_pallas_mosaic_tpu import tpu_op

    return tpu_op(block_sizes)


def test_tpu_kernel_matches_oracle_within_bound_in_tpu_interpreter():
    batch = make_ragged_batch(7, [1, 9, 1, 4], [21, 0, 5, 12], num_q_heads=8, num_kv_heads=2, head_size=128,
                              block_size=32, dtype=jnp.bfloat16, cache_dtype_str="fp8_e4m3", extra_blocks=1,
                              num_tokens=17)  # fmt: skip
    options = make_options(batch, sinks=True)
    check_fp8_output(batch, options, *run_fp8(batch, options, _tpu_op(None)))


def test_tpu_kernel_lowers_fp8_matmuls_for_tpu(monkeypatch):
    """``jax.export`` for TPU: both matmuls are ``tpu.matmul`` on f8E4M3FN operands (v7x's fp8 MXU)."""
    from jax._src.pallas.mosaic import lowering as mosaic_lowering

    from attn_jax.ops.ragged_paged_attention import pallas_mosaic_tpu

    modules = []
    lower = mosaic_lowering.lower_jaxpr_to_pipelined_module

    def capture(*args, **kwargs):
        module = lower(*args, **kwargs)
        modules.append(module.operation.get_asm())
        return module

    monkeypatch.setattr(mosaic_lowering, "lower_jaxpr_to_pipelined_module", capture)
    sds = jax.ShapeDtypeStruct

    def step(*args):
        return pallas_mosaic_tpu.ragged_paged_attention(
            *args, sm_scale=128**-0.5, interpret=False, k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25),
            q_scale=jnp.float32(0.3), sliding_window=1024, sinks=jnp.zeros(32),
        )  # fmt: skip

    shapes = (sds((256, 32, 128), jnp.bfloat16), sds((256, 8, 128), jnp.bfloat16), sds((256, 8, 128), jnp.bfloat16),
              sds(pallas_mosaic_tpu.kv_cache_shape(4096, 32, 8, 128), jnp.float8_e4m3fn), sds((33,), jnp.int32),
              sds((32,), jnp.int32), sds((32, 128), jnp.int32), sds((256,), jnp.int32))  # fmt: skip
    exported = jax.export.export(jax.jit(step, donate_argnums=3), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
    matmuls = [line for text in modules for line in text.splitlines() if "tpu.matmul" in line]
    assert matmuls, "no tpu.matmul in the lowered kernel"
    assert all(line.count("xf8E4M3FN>") >= 2 and "xf32>" in line for line in matmuls), matmuls


def test_pallas_tpu_refuses_fp8_attention_without_an_fp8_mxu():
    from attn_jax.backends.pallas_tpu import PallasTPUAttentionBackend
    from attn_jax.platforms import Platform

    v6e = Platform(kind="tpu", device_kind="TPU v6 lite", num_devices=1)
    v7x = Platform(kind="tpu", device_kind="TPU7x", num_devices=1)
    why = PallasTPUAttentionBackend.validate_configuration(128, jnp.bfloat16, "fp8", 32, platform=v6e,
                                                           query_quant=True)  # fmt: skip
    assert why == [
        "FP8 attention (query_quant=True) needs a TPU with an fp8 MXU ['TPU7x'] (Mosaic lowers e4m3 x e4m3 matmuls "
        "for TPU v7x only); device 'TPU v6 lite' has none"
    ]
    assert PallasTPUAttentionBackend.validate_configuration(128, jnp.bfloat16, "fp8", 32, platform=v7x,
                                                            query_quant=True) == []  # fmt: skip


@pytest.mark.parametrize("op", ["triton"])
def test_cascade_with_fp8_attention_within_bound(op):
    """The shared prefix read once and merged by LSE: both parts FP8 attention (q_scale in op_kwargs)."""
    from attn_jax.ops.ragged_paged_attention.cascade import cascade_ragged_paged_attention

    batch = make_ragged_batch(8, query_lens=[1, 3, 1], context_lens=[40, 33, 36], num_tokens=6, **_SHAPE,
                              dtype=jnp.bfloat16).with_shared_prefix(32)  # fmt: skip
    options = make_options(batch, sinks=True)
    del options["sliding_window"], options["alibi_slopes"], options["causal"]
    ops = {"reference": reference.ragged_paged_attention, "triton": _triton(ONE_PASS)}
    q_scale = query_scale(batch)
    out, cache = cascade_ragged_paged_attention(*batch.op_args, prefix_len=32, op=ops[op], **options,
                                                **batch.op_kwargs, q_scale=q_scale)  # fmt: skip
    check_fp8_output(batch, {**options, "causal": True}, out, cache, q_scale)


# NONFINITE_ENTRIES with NaN only: an fp8 cache saturates inf to +-448 (quantize_to_cache), NaN stays NaN.
_NAN_ENTRIES = (("q", 0, 0, np.nan), ("k", 3, 0, np.nan), ("v", 10, 1, np.nan), ("v_cached", (0, 2), 1, np.nan),
                ("v_cached", (2, 1), 0, np.nan), ("q", 13, 1, np.nan), ("k", 12, 0, np.nan))  # fmt: skip


@pytest.mark.parametrize("op", ["reference", "triton"])
def test_nan_inputs_reach_exactly_the_rows_that_see_them(op):
    """A NaN in a request's own q, k or v reaches the FP8 output rows that see it (through the e4m3
    quantisation of q and the weights), never the others; a window hides one."""
    from tests.ops.ragged_checks import NONFINITE_BATCH, with_nonfinite_entries

    batch = with_nonfinite_entries(make_ragged_batch(9, **NONFINITE_BATCH, cache_dtype_str="fp8_e4m3"), _NAN_ENTRIES)
    options = make_options(batch, sliding_window=4)
    ops = {"reference": reference.ragged_paged_attention, "triton": _triton(GpuBlockSizes(8, 1))}
    q_scale = jnp.float32(0.02)  # max|q| / 200 on the finite rows: NaN would poison calc_kv_scales
    out, _ = run_op(batch, options, True, op=functools.partial(ops[op], q_scale=q_scale))
    out = np.asarray(out, np.float64)
    n = batch.num_actual_tokens
    with np.errstate(invalid="ignore"):
        expected = attention_oracle(np.asarray(batch.q, np.float64), batch.k_seqs, batch.v_seqs, batch.query_lens,
                                    **options)  # fmt: skip
    bad_expected = ~np.isfinite(expected).all(-1)
    assert bad_expected.any() and not bad_expected.all()
    np.testing.assert_array_equal(~np.isfinite(out[:n]).all(-1), bad_expected, err_msg="non-finite rows differ")
    assert np.isfinite(out[n:]).all(), "padding rows must be finite"
    assert rel_l2(out[:n][~bad_expected], expected[~bad_expected]) <= FP8_REL_L2_UNQUANTIZED
