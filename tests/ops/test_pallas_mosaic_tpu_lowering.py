"""The Pallas TPU kernel lowered for TPU from the CPU, its shared tile math, bad inputs,
layout helpers, schedule, tuned tables and sharding.

``jax.export`` lowers the kernel for TPU at production shapes (Pallas -> Mosaic), so a
kernel that cannot be lowered fails CI; the exported module must hold the Mosaic custom
call. The interpreter runs against the oracle are in test_pallas_mosaic_tpu.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.ragged_paged_attention import common, pallas_mosaic_tpu
from attn_jax.ops.ragged_paged_attention.config import TpuBlockSizes, load_tuned_table, tuned_tables
from attn_jax.testing.workloads import make_ragged_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
_G4 = dict(num_q_heads=8, num_kv_heads=2)  # GQA ratio 4
_MIXED = dict(query_lens=[1, 9, 1, 4], context_lens=[21, 0, 5, 12])


# --- lowering for TPU from the CPU ------------------------------------------------------------


def _export(*, num_tokens, num_reqs, pages_per_req, page_size, head_size, cache_dtype, block_sizes=None,
            num_q_heads=32, num_kv_heads=8, dtype=jnp.bfloat16, **options):  # fmt: skip
    sds = jax.ShapeDtypeStruct
    shapes = (
        sds((num_tokens, num_q_heads, head_size), dtype),
        sds((num_tokens, num_kv_heads, head_size), dtype),
        sds((num_tokens, num_kv_heads, head_size), dtype),
        sds(pallas_mosaic_tpu.kv_cache_shape(4096, page_size, num_kv_heads, head_size), cache_dtype),
        sds((num_reqs + 1,), jnp.int32),
        sds((num_reqs,), jnp.int32),
        sds((num_reqs, pages_per_req), jnp.int32),
        sds((num_tokens,), jnp.int32),
    )
    fp8 = jnp.dtype(cache_dtype).itemsize == 1
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25)) if fp8 else {}

    def step(*args):
        return pallas_mosaic_tpu.ragged_paged_attention(
            *args, sm_scale=head_size**-0.5, interpret=False, block_sizes=block_sizes, **scales, **options
        )

    return jax.export.export(jax.jit(step, donate_argnums=3), platforms=["tpu"])(*shapes)


def _table_entry(name: str, index: int) -> tuple[dict, TpuBlockSizes]:
    entry = load_tuned_table(name)["entries"][index]
    bs = TpuBlockSizes(entry["q_tokens_per_block"], entry["kv_pages_per_block"])
    return entry, bs


EXPORTS = {
    "bf16_h128_p16_heuristic": dict(num_tokens=512, num_reqs=64, pages_per_req=256, page_size=16, head_size=128,
                                    cache_dtype=jnp.bfloat16),
    "fp8_e4m3_h64_p32_features": dict(num_tokens=256, num_reqs=32, pages_per_req=128, page_size=32, head_size=64,
                                      cache_dtype=jnp.float8_e4m3fn, sliding_window=1024, logits_soft_cap=30.0,
                                      sinks=jnp.zeros(32, jnp.float32)),
    "fp8_e5m2_h128_p64_non_causal_alibi": dict(num_tokens=128, num_reqs=8, pages_per_req=64, page_size=64,
                                               head_size=128, cache_dtype=jnp.float8_e5m2, causal=False,
                                               alibi_slopes=jnp.ones(32, jnp.float32),
                                               block_sizes=TpuBlockSizes(16, 4, kv_heads_per_block=2)),
    "bf16_h80": dict(num_tokens=128, num_reqs=8, pages_per_req=32, page_size=16, head_size=80,
                              cache_dtype=jnp.bfloat16, num_q_heads=8, num_kv_heads=2),
    "fp8_h96_sinks": dict(num_tokens=128, num_reqs=8, pages_per_req=32, page_size=32, head_size=96,
                          cache_dtype=jnp.float8_e4m3fn, num_q_heads=8, num_kv_heads=2, sinks=jnp.zeros(8)),
    "bf16_h192_window": dict(num_tokens=128, num_reqs=8, pages_per_req=32, page_size=16, head_size=192,
                             cache_dtype=jnp.bfloat16, num_q_heads=8, num_kv_heads=2, sliding_window=64),
    "bf16_h256_f32_queries": dict(num_tokens=64, num_reqs=4, pages_per_req=16, page_size=128, head_size=256,
                                  cache_dtype=jnp.bfloat16, dtype=jnp.float32, num_q_heads=8, num_kv_heads=2),
    # return_lse (cascade attention's parts): a third, lane-broadcast f32 output.
    "bf16_h128_lse_sinks": dict(num_tokens=256, num_reqs=32, pages_per_req=64, page_size=16, head_size=128,
                                cache_dtype=jnp.bfloat16, sinks=jnp.zeros(32, jnp.float32), return_lse=True),
    "bf16_h64_lse_non_causal_one_request": dict(num_tokens=64, num_reqs=1, pages_per_req=128, page_size=16,
                                                head_size=64, cache_dtype=jnp.bfloat16, causal=False,
                                                return_lse=True),
}  # fmt: skip
# Entries of the tuned tables at their own shapes: (table, entry index).
TABLE_EXPORTS = [("tpu_v5e", 0), ("tpu_v6e", 25), ("tpu_v7x", 59)]


@pytest.mark.parametrize("name", list(EXPORTS))
def test_exports_for_tpu_with_mosaic_custom_call(name):
    exported = _export(**EXPORTS[name])
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()
    if EXPORTS[name].get("return_lse"):  # (out, kv_cache, lse f32[T, Hq])
        num_q_heads = EXPORTS[name].get("num_q_heads", 32)
        assert exported.out_avals[2] == jax.core.ShapedArray((EXPORTS[name]["num_tokens"], num_q_heads), jnp.float32)


@pytest.mark.parametrize(("table", "index"), TABLE_EXPORTS)
def test_tuned_table_entries_export_for_tpu(table, index):
    entry, bs = _table_entry(table, index)
    page_size = entry["page_size"]
    exported = _export(
        num_tokens=entry["max_num_tokens"], num_reqs=16, pages_per_req=entry["max_model_len"] // page_size,
        page_size=page_size, head_size=entry["head_size"], cache_dtype=jnp.dtype(entry["kv_dtype"]),
        block_sizes=dataclasses.replace(bs, kv_pages_per_block=min(bs.kv_pages_per_block,
                                                                   entry["max_model_len"] // page_size)),
    )  # fmt: skip
    assert "tpu_custom_call" in exported.mlir_module()


def test_cost_estimate_is_attached():
    text = (
        jax.jit(lambda *a: pallas_mosaic_tpu.ragged_paged_attention(*a, sm_scale=0.1, interpret=False))
        .trace(*_zeros(num_tokens=32, num_reqs=2, pages_per_req=4, page_size=16, head_size=128))
        .jaxpr.pretty_print()
    )
    assert "cost_estimate=CostEstimate(flops=" in text


def _zeros(*, num_tokens, num_reqs, pages_per_req, page_size, head_size, num_blocks=16):
    return (
        jnp.zeros((num_tokens, 8, head_size), jnp.bfloat16),
        jnp.zeros((num_tokens, 2, head_size), jnp.bfloat16),
        jnp.zeros((num_tokens, 2, head_size), jnp.bfloat16),
        jnp.zeros(pallas_mosaic_tpu.kv_cache_shape(num_blocks, page_size, 2, head_size), jnp.bfloat16),
        jnp.zeros((num_reqs + 1,), jnp.int32),
        jnp.zeros((num_reqs,), jnp.int32),
        jnp.zeros((num_reqs, pages_per_req), jnp.int32),
        jnp.full((num_tokens,), -1, jnp.int32),
    )


# --- one set of tile math ------------------------------------------------------------------


SHARED = (
    "dequantize", "visible_mask", "transform_scores", "init_softmax_state", "online_softmax_update",
    "finalize_softmax_state", "log_sum_exp",
)  # fmt: skip


def _common_calls(module) -> set[str]:
    return set(re.findall(r"\bcommon\.([a-z_]+)\(", inspect.getsource(module)))


def test_tpu_and_gpu_kernels_call_the_same_common_functions():
    from attn_jax.ops.ragged_paged_attention import pallas_triton

    assert pallas_mosaic_tpu.common is common and pallas_triton.common is common  # one module, not copies
    tpu_calls, gpu_calls = _common_calls(pallas_mosaic_tpu), _common_calls(pallas_triton)
    assert set(SHARED) <= tpu_calls, set(SHARED) - tpu_calls
    assert set(SHARED) <= gpu_calls, set(SHARED) - gpu_calls
    for module in (pallas_mosaic_tpu, pallas_triton):  # and neither keeps a private copy of the math
        source = inspect.getsource(module)
        for name in SHARED:
            assert f"def {name}(" not in source, f"{module.__name__} defines its own {name}"
        assert "jnp.exp(" not in source and "jnp.tanh(" not in source, module.__name__


# --- bad inputs ----------------------------------------------------------------------------


def _small_args(head_size=128, page_size=16, cache_dtype=jnp.float32, num_reqs=2, pages_per_req=2, num_tokens=8):
    args = list(_zeros(num_tokens=num_tokens, num_reqs=num_reqs, pages_per_req=pages_per_req, page_size=page_size,
                       head_size=head_size))  # fmt: skip
    args[:3] = [a.astype(jnp.float32) for a in args[:3]]
    args[3] = args[3].astype(cache_dtype)
    return args


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(head_size=112),
            "head_size=112 is not supported by the TPU kernel; supported: [64, 80, 96, 128, 192, 256]",
        ),
        (dict(page_size=8), "page_size=8 is not supported by the TPU kernel; supported: [16, 32, 64, 128, 256]"),
        (dict(cache_dtype=jnp.float8_e4m3fn), "page_size=16 with an fp8 cache (float8_e4m3fn) is not supported"),
    ],
)
def test_unsupported_shapes_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pallas_mosaic_tpu.ragged_paged_attention(*_small_args(**kwargs), sm_scale=0.1, interpret=True)


@pytest.mark.parametrize(
    ("block_sizes", "message"),
    [
        (TpuBlockSizes(3, 1), "q_tokens_per_block=3 x group=4 = 12 rows must be a multiple of 8"),
        (TpuBlockSizes(8, 1, kv_heads_per_block=3), "kv_heads_per_block=3 must divide num_kv_heads=2"),
        (
            TpuBlockSizes(8, 1, kv_heads_per_block=1),
            "kv_heads_per_block=1 x group=4 = 4 query heads per block must be a multiple of 8 or all 8 query heads",
        ),
        (TpuBlockSizes(8, 4), "kv_pages_per_block=4 exceeds the bucket's pages_per_req=2"),
        (TpuBlockSizes(0, 1), "q_tokens_per_block=0 must be a positive int"),
    ],
)
def test_bad_block_sizes_raise(block_sizes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pallas_mosaic_tpu.ragged_paged_attention(*_small_args(), sm_scale=0.1, block_sizes=block_sizes, interpret=True)


def test_two_dimensional_q_is_named():
    q, *rest = _small_args()
    with pytest.raises(ValueError, match=re.escape("q.shape=(8, 1024) must be [num_tokens, num_q_heads, head_size]")):
        pallas_mosaic_tpu.ragged_paged_attention(q.reshape(q.shape[0], -1), *rest, sm_scale=0.1, interpret=True)


def test_zero_tokens_give_an_empty_result_and_an_unchanged_cache():
    q, k, v, cache, *rest = _small_args(num_tokens=0)
    out, new_cache = pallas_mosaic_tpu.ragged_paged_attention(q, k, v, cache, *rest, sm_scale=0.1, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(cache))


def test_reference_layout_cache_is_a_clear_error():
    batch = make_ragged_batch(0, [1, 2], [3, 0], **_G4, head_size=128, block_size=16)
    with pytest.raises(ValueError, match=re.escape("is not the PALLAS_TPU layout [num_blocks, num_kv_heads, "
                                                   "block_size, 2 * head_size=256]")) as e:  # fmt: skip
        pallas_mosaic_tpu.ragged_paged_attention(*batch.op_args, sm_scale=0.1)
    assert "convert it with from_reference_layout" in str(e.value)
    cache = pallas_mosaic_tpu.from_reference_layout(batch.kv_cache)
    q, k, v, _, *rest = batch.op_args
    with pytest.raises(ValueError, match=re.escape(f"kv_cache.shape={cache.shape[:3] + (128,)} is not the PALLAS_TPU")):
        pallas_mosaic_tpu.ragged_paged_attention(q, k, v, cache[..., :128], *rest, sm_scale=0.1)


def test_metadata_over_smem_capacity_names_the_limit():
    limit = pallas_mosaic_tpu.SMEM_SCALAR_PREFETCH_LIMIT_BYTES
    with pytest.raises(ValueError, match=f"SMEM_SCALAR_PREFETCH_LIMIT_BYTES={limit}") as e:
        pallas_mosaic_tpu.check_smem_capacity(num_reqs=1024, pages_per_req=2048, num_tokens=8192, q_tokens_per_block=32)
    assert "num_reqs=1024, pages_per_req=2048" in str(e.value) and "block_tables=8388608 B" in str(e.value)
    # The op checks before tracing the kernel: a 256 x 512 block table is 512 KiB.
    args = _small_args(num_reqs=256, pages_per_req=512)
    with pytest.raises(ValueError, match="more than the TPU kernel's limit SMEM_SCALAR_PREFETCH_LIMIT_BYTES"):
        pallas_mosaic_tpu.ragged_paged_attention(*args, sm_scale=0.1, interpret=True, block_sizes=TpuBlockSizes(8, 1))
    assert pallas_mosaic_tpu.check_smem_capacity(
        num_reqs=256, pages_per_req=128, num_tokens=8192, q_tokens_per_block=32
    )


# --- layout and schedule -----------------------------------------------------------------------


def test_layout_round_trip_and_write_path_match_the_reference():
    from attn_jax.kv_cache import write_to_kv_cache

    batch = make_ragged_batch(4, **_MIXED, **_G4, head_size=64, block_size=16, cache_dtype_str="fp8_e5m2",
                              num_tokens=18)  # fmt: skip
    tpu = pallas_mosaic_tpu.from_reference_layout(batch.kv_cache)
    assert tpu.shape == pallas_mosaic_tpu.kv_cache_shape(batch.kv_cache.shape[1], 16, 2, 64)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731  (NaN == NaN for assert_array_equal)
    np.testing.assert_array_equal(f32(pallas_mosaic_tpu.to_reference_layout(tpu)), f32(batch.kv_cache))
    written = pallas_mosaic_tpu.write_to_tpu_kv_cache(tpu, batch.k, batch.v, batch.slot_mapping, **batch.op_kwargs)
    expected = write_to_kv_cache(batch.kv_cache, batch.k, batch.v, batch.slot_mapping, **batch.op_kwargs)
    np.testing.assert_array_equal(f32(pallas_mosaic_tpu.to_reference_layout(written)), f32(expected))


def test_write_plan_copies_whole_pages_once():
    # Page size 4, 12 pages: a full page (16-19), two single tokens, a full page (32-35) then
    # one more token, padding, a full page (40-43), a slot past the cache, a lone token.
    slots = np.array([16, 17, 18, 19, 5, 6, 32, 33, 34, 35, 36, -1, 40, 41, 42, 43, 99, 20], np.int32)
    expected = [-6, -1, -1, -1, 5, 6, -10, -1, -1, -1, 36, -1, -12, -1, -1, -1, -1, 20]
    assert pallas_mosaic_tpu.write_plan(slots, 4, 12, xp=np).tolist() == expected
    assert np.asarray(jax.jit(pallas_mosaic_tpu.write_plan, static_argnums=(1, 2))(slots, 4, 12)).tolist() == expected


def test_schedule_on_host_and_traced_agree():
    qsl = np.array([0, 1, 1, 9, 10, 14, 14, 14], np.int32)  # an empty request inside, two padding ones at the end
    host = pallas_mosaic_tpu.tpu_schedule(qsl, 16, 4, xp=np)
    traced = jax.jit(pallas_mosaic_tpu.tpu_schedule, static_argnums=(1, 2))(jnp.asarray(qsl), 16, 4)
    np.testing.assert_array_equal(host, np.asarray(traced))
    # Blocks [0,4) [4,8) [8,12) [12,16): first requests, then one past the last.
    assert host.tolist() == [0, 2, 2, 4] + [3, 3, 5, 5]


# --- sharding: the kernel takes one shard's KV heads ------------------------------------------


_SHARDED = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from attn_jax.ops.ragged_paged_attention import pallas_mosaic_tpu
    from attn_jax.ops.ragged_paged_attention.config import TpuBlockSizes
    from attn_jax.testing.workloads import make_ragged_batch

    assert len(jax.devices()) == 4, jax.devices()
    batch = make_ragged_batch(0, [1, 5], [6, 10], num_q_heads=8, num_kv_heads=4, head_size=128, block_size=16)
    q, k, v, cache, *index = batch.op_args
    cache = pallas_mosaic_tpu.from_reference_layout(cache)
    sinks = np.linspace(-1, 1, 8).astype(np.float32)

    def step(q, k, v, cache, sinks, *index):
        return pallas_mosaic_tpu.ragged_paged_attention(q, k, v, cache, *index, sm_scale=0.1, sinks=sinks,
                                                 block_sizes=TpuBlockSizes(8, 1))

    heads, cache_heads = P(None, "kv", None), P(None, "kv", None, None)
    sharded = jax.shard_map(step, mesh=Mesh(np.array(jax.devices()), ("kv",)),
                            in_specs=(heads, heads, heads, cache_heads, P("kv"), P(), P(), P(), P()),
                            out_specs=(heads, cache_heads), check_vma=False)
    out1, cache1 = jax.jit(step)(q, k, v, cache, sinks, *index)
    out4, cache4 = jax.jit(sharded)(q, k, v, cache, sinks, *index)
    np.testing.assert_array_equal(np.asarray(out4), np.asarray(out1))
    np.testing.assert_array_equal(np.asarray(cache4), np.asarray(cache1))
    print("sharded ok")
    """
)


def test_kv_heads_split_over_four_devices_match_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded ok" in result.stdout


# --- tuned tables --------------------------------------------------------------------------


@pytest.mark.parametrize("name", tuned_tables("tpu_"))
def test_every_tuned_tpu_table_entry_validates(name):
    from attn_jax.ops.ragged_paged_attention.config import TPU_MATCH_KEYS, check_tpu_block_sizes, tpu_entry_block_sizes

    table = load_tuned_table(name)
    assert table["source"] and table["device_kind"] and table["entries"]
    keys = set()
    for entry in table["entries"]:
        key = tuple(entry[k] for k in TPU_MATCH_KEYS)
        assert key not in keys, f"duplicate entry {key}"
        keys.add(key)
        pallas_mosaic_tpu.check_tpu_shapes(head_size=entry["head_size"], page_size=entry["page_size"],
                                    kv_dtype=entry["kv_dtype"])  # fmt: skip
        for n in ("max_num_tokens", "max_model_len"):
            assert entry[n] & (entry[n] - 1) == 0, f"{n}={entry[n]} is not a power of two (lookups round up)"
        bs = tpu_entry_block_sizes(entry)
        for group in (1, 2, 4, 8):  # the token counts tile every head group
            check_tpu_block_sizes(bs, group=group, num_kv_heads=8, q_dtype=entry["q_dtype"])


def test_tuned_tables_are_distinct_devices_and_used():
    from attn_jax.ops.ragged_paged_attention.config import tpu_block_sizes

    kinds = [load_tuned_table(n)["device_kind"] for n in tuned_tables("tpu_")]
    assert sorted(kinds) == sorted(set(kinds)) and {"TPU v5 lite", "TPU v6 lite", "TPU7x"} <= set(kinds)
    entry = load_tuned_table("tpu_v6e")["entries"][25]
    page = entry["page_size"]
    kwargs = dict(q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, group=4, head_size=128, page_size=page,
                  num_kv_heads=8, num_tokens=entry["max_num_tokens"],
                  pages_per_req=entry["max_model_len"] // page)  # fmt: skip
    tuned = tpu_block_sizes(**kwargs, device_kind="TPU v6 lite")
    assert tuned.q_tokens_per_block == entry["q_tokens_per_block"]
    assert tuned.kv_pages_per_block == min(entry["kv_pages_per_block"], entry["max_model_len"] // page)
    assert tpu_block_sizes(**kwargs, device_kind=None).kv_pages_per_block == min(256 // page, kwargs["pages_per_req"])


def test_column_softmax_state_matches_row_state():
    """The TPU kernel keeps m and denom as f32[rows, 1] (common.init_softmax_state(column=True));
    the functions give the same numbers as with the GPU kernel's f32[rows]."""
    rng = np.random.default_rng(0)
    sinks = rng.standard_normal(6).astype(np.float32)
    v = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    results = []
    for column in (False, True):
        sink = jnp.asarray(sinks[:, None] if column else sinks)
        state = common.init_softmax_state(6, 8, sinks=sink, column=column)
        for seed in (1, 2):
            s = jnp.asarray(np.random.default_rng(seed).standard_normal((6, 5)), jnp.float32)
            visible = jnp.asarray(np.random.default_rng(seed + 10).random((6, 5)) < 0.7)
            state = common.online_softmax_update(state, s, visible, v)
        assert state[0].shape == ((6, 1) if column else (6,))
        results.append(np.asarray(common.finalize_softmax_state(state)))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-6)  # up to XLA fusion order


def test_vmem_limit_is_raised_for_large_blocks_and_refused_past_v7x():
    shape = dict(group=4, head_size=128, page_size=16, q_itemsize=2, kv_itemsize=2, per_row_inputs=2)
    assert pallas_mosaic_tpu.vmem_limit_for(TpuBlockSizes(4, 16, 2), **shape) is None  # decode blocks: the default
    estimate = pallas_mosaic_tpu.vmem_bytes_estimate(TpuBlockSizes(256, 16, 2), **shape)  # long-prefill blocks
    assert estimate > pallas_mosaic_tpu.VMEM_DEFAULT_SCOPED_BYTES * 3 // 4
    assert pallas_mosaic_tpu.vmem_limit_for(TpuBlockSizes(256, 16, 2), **shape) == estimate * 3 // 2
    with pytest.raises(ValueError, match=f"VMEM_MAX_BYTES={pallas_mosaic_tpu.VMEM_MAX_BYTES}"):
        pallas_mosaic_tpu.vmem_limit_for(TpuBlockSizes(1024, 64, 2), **shape)
    # The op passes it on: 4096 tokens take 256-token q-blocks; with ALiBi and sinks they need more.
    args = _zeros(num_tokens=4096, num_reqs=4, pages_per_req=256, page_size=16, head_size=128, num_blocks=1024)
    step = jax.jit(
        lambda *a: pallas_mosaic_tpu.ragged_paged_attention(
            *a, sm_scale=0.1, interpret=False, sinks=jnp.zeros(8, jnp.float32), alibi_slopes=jnp.ones(8, jnp.float32)
        )
    )
    jaxpr = step.trace(*args).jaxpr.pretty_print()
    raised = pallas_mosaic_tpu.vmem_limit_for(TpuBlockSizes(256, 16, 2), **shape)
    assert f"vmem_limit_bytes={raised}" in jaxpr
