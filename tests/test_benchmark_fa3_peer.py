"""benchmarks/attention.py's FlashAttention-3 peer on the CPU, without the wheel.

The layout conversions of ``benchmarks/fa3_peer.py`` against direct gathers and against the
jnp reference op; the workloads' floors against a brute-force count of visible pairs; the
command line; and the whole FA3 path of ``attention.run_fa3`` driven by ``FakeFA3``, a jnp
model of the binding's documented semantics (paged with bottom-right causal masks,
varlen, dense), with the CUPTI trace replaced by synthetic device events.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.ragged_paged_attention import config, reference
from attn_jax.testing.workloads import WORKLOADS, WorkloadSpec
from benchmarks import attention, cupti_timing, fa3_peer

SMALL = WorkloadSpec(
    "M1", "tiny mixed batch", (5, 5, 1, 1, 1), (7, 7, 9, 9, 9), num_q_heads=4, num_kv_heads=2, head_size=16,
    block_size=4, dtype="float32",
)  # fmt: skip


def _attend(q, k, v, q_pos, k_pos, same, scale):
    """f32 softmax attention: q [n, Hq, D] at positions q_pos, keys k/v [m, Hkv, D] at k_pos;
    key j visible to query i iff same[i, j] and k_pos[j] <= q_pos[i]."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32), precision="highest") * scale
    mask = same & (k_pos[None, :] <= q_pos[:, None])
    p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32), precision="highest").astype(q.dtype)


class FakeFA3:
    """flash_attn3_jax's three calls as their docstrings define them, in jnp (causal only)."""

    __version__ = "fake"

    @staticmethod
    def flash_mha_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, softmax_scale, is_causal, num_splits):
        assert is_causal and num_splits >= 1 and page_table.dtype == jnp.int32
        Lq, (W, S) = q.shape[1], (page_table.shape[1], k_cache.shape[1])

        def one(q, table, n):
            k, v = (c[table].reshape(W * S, *c.shape[2:]) for c in (k_cache, v_cache))
            k_pos = jnp.where(jnp.arange(W * S) < n, jnp.arange(W * S), W * S + Lq)  # past seqlen: never visible
            return _attend(q, k, v, n - Lq + jnp.arange(Lq), k_pos, True, softmax_scale)

        return jax.vmap(one)(q, page_table, cache_seqlens)

    @staticmethod
    def flash_mha_varlen(q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal):
        assert is_causal
        rq = jnp.searchsorted(cu_q, jnp.arange(q.shape[0]), side="right") - 1
        rk = jnp.searchsorted(cu_k, jnp.arange(k.shape[0]), side="right") - 1
        lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        q_pos = jnp.arange(q.shape[0]) - cu_q[rq] + (lk - lq)[rq]  # bottom-right
        k_pos = jnp.arange(k.shape[0]) - cu_k[rk]
        return _attend(q, k, v, q_pos, k_pos, rq[:, None] == rk[None, :], softmax_scale)

    @staticmethod
    def flash_mha(q, k, v, *, softmax_scale, is_causal):
        assert is_causal and q.shape[1] == k.shape[1]
        pos = jnp.arange(q.shape[1])
        return jax.vmap(lambda q, k, v: _attend(q, k, v, pos, pos, True, softmax_scale))(q, k, v)


@pytest.fixture(scope="module")
def small():
    b = attention.make_device_batch(SMALL, seed=3)
    args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
    return b, attention.xla_fn(b, jnp.float32)(*args)


def _ref(b, kv_cache, tables):
    """The reference op (no write) on ``kv_cache`` through ``tables``; slots of the new tokens in that layout."""
    seq = b.query_lens + b.context_lens
    slots = fa3_peer.token_slots(tables, seq, kv_cache.shape[2])
    new = np.concatenate([np.arange(s - q, s) for s, q in zip(np.cumsum(seq), b.query_lens, strict=True)])
    out, _ = reference.ragged_paged_attention(
        b.q, None, None, kv_cache, b.query_start_loc, b.seq_lens, jnp.asarray(tables), jnp.asarray(slots[new]),
        sm_scale=b.spec.head_size**-0.5,
    )  # fmt: skip
    return np.asarray(out)


# --------------------------------------------------------------------------- layouts
def test_token_slots_walks_each_request_through_its_pages():
    slots = fa3_peer.token_slots(np.array([[3, 1, 0], [2, 0, 0]]), np.array([5, 2]), page_size=4)
    np.testing.assert_array_equal(slots, [12, 13, 14, 15, 4, 8, 9])


def test_token_slots_refuses_a_request_longer_than_its_table():
    with pytest.raises(ValueError, match="exceeds the table's 1 pages"):
        fa3_peer.token_slots(np.array([[0]]), np.array([5]), page_size=4)


@pytest.mark.parametrize("page", [2, 8])
def test_repage_keeps_every_token_and_the_attention(small, page):
    b, ref = small
    seq = b.query_lens + b.context_lens
    kv, tables = fa3_peer.repage(b.kv_cache, np.asarray(b.block_tables), seq, page)
    assert kv.shape[2] == page and tables.shape == (len(seq), -(-int(seq.max()) // page))
    old_tables, S = np.asarray(b.block_tables), b.spec.block_size
    for r, n in enumerate(seq):
        pos = np.arange(n)
        np.testing.assert_array_equal(kv[:, tables[r, pos // page], pos % page],
                                      b.kv_cache[:, old_tables[r, pos // S], pos % S])  # fmt: skip
    np.testing.assert_allclose(_ref(b, kv, tables), ref, atol=1e-6)


def test_packed_kv_and_dense_kv_match_a_per_request_gather(small):
    b, _ = small
    seq = b.query_lens + b.context_lens
    k, v, cu = fa3_peer.packed_kv(b.kv_cache, np.asarray(b.block_tables), seq)
    np.testing.assert_array_equal(cu, np.concatenate([[0], np.cumsum(seq)]))
    for r, n in enumerate(seq):
        pages = np.asarray(b.block_tables)[r, : -(-n // b.spec.block_size)]
        dense = b.kv_cache[:, pages].reshape(2, -1, b.spec.num_kv_heads, b.spec.head_size)[:, :n]
        np.testing.assert_array_equal(k[cu[r] : cu[r + 1]], dense[0])
        np.testing.assert_array_equal(v[cu[r] : cu[r + 1]], dense[1])
    kd, _ = fa3_peer.dense_kv(k[:14], v[:14], np.array([7, 7]))
    assert kd.shape == (2, 7, b.spec.num_kv_heads, b.spec.head_size)
    with pytest.raises(ValueError, match="one sequence length per call"):
        fa3_peer.dense_kv(k, v, seq)


def test_call_groups_round_trip_the_packed_rows(small):
    b, _ = small
    groups = fa3_peer.call_groups(b.query_lens, b.query_lens + b.context_lens)
    assert [(g.q_len, g.reqs.tolist(), g.max_seq) for g in groups] == [(5, [0, 1], 12), (1, [2, 3, 4], 10)]
    outs = [fa3_peer.group_q(b.q, g) for g in groups]
    assert outs[0].shape == (2, 5, 4, 16) and outs[1].shape == (3, 1, 4, 16)
    np.testing.assert_array_equal(fa3_peer.scatter_out(outs, groups, b.num_tokens), b.q)
    assert fa3_peer.group_tables(np.asarray(b.block_tables), groups[0], 4).shape == (2, 3)


@pytest.mark.parametrize("page", [4, 16])
def test_converted_inputs_give_the_reference_under_fa3_semantics(small, page):
    """Each group's paged call (FakeFA3 semantics) on converted inputs gives the reference's rows."""
    b, ref = small
    seq = b.query_lens + b.context_lens
    kv, tables = fa3_peer.repage(b.kv_cache, np.asarray(b.block_tables), seq, page)
    outs, groups = [], fa3_peer.call_groups(b.query_lens, seq)
    for g in groups:
        call = fa3_peer.paged_call(FakeFA3, sm_scale=16**-0.5, num_splits=2)
        args = (
            fa3_peer.group_q(b.q, g),
            kv[0],
            kv[1],
            fa3_peer.group_tables(tables, g, page),
            jnp.asarray(seq[g.reqs]),
        )
        outs.append(call(*args))
    np.testing.assert_allclose(fa3_peer.scatter_out(outs, groups, b.num_tokens), ref, atol=2e-5)


def test_varlen_call_on_packed_kv_gives_the_reference(small):
    b, ref = small
    seq = b.query_lens + b.context_lens
    k, v, cu_k = fa3_peer.packed_kv(b.kv_cache, np.asarray(b.block_tables), seq)
    call = fa3_peer.varlen_call(FakeFA3, sm_scale=16**-0.5, max_q=5, max_k=12)
    np.testing.assert_allclose(call(b.q, k, v, b.query_start_loc, cu_k), ref, atol=2e-5)


# --------------------------------------------------------------------------- floors
def _brute_force_floors(spec):
    pairs = 0
    for q, c in zip(spec.query_lens, spec.context_lens, strict=True):
        pairs += int((np.arange(c + q)[None, :] <= c + np.arange(q)[:, None]).sum())
    item = np.dtype(jnp.dtype(spec.dtype)).itemsize
    kv = 2 * (sum(spec.query_lens) + sum(spec.context_lens)) * spec.num_kv_heads * spec.head_size * item
    qo = 2 * sum(spec.query_lens) * spec.num_q_heads * spec.head_size * item
    return kv + qo, 4.0 * spec.head_size * spec.num_q_heads * pairs


@pytest.mark.parametrize("name", ["D1", "D2", "M1", "P1", "P1_p128"])
def test_workload_floors_count_every_visible_pair(name):
    (spec,) = attention.parse_workloads(name)
    assert attention.count_floors(spec, spec.query_lens, spec.context_lens) == _brute_force_floors(spec)


def test_floors_of_a_batch_are_its_workloads(small):
    b, _ = small
    assert attention.floors(b) == _brute_force_floors(SMALL)


# --------------------------------------------------------------------------- command line
def test_parse_workloads_reads_page_and_head_suffixes():
    specs = attention.parse_workloads("D1,P1_p128,M1_p32_h64", head_sizes="80")
    assert [(s.name, s.block_size, s.head_size) for s in specs] == [
        ("D1", 16, 128), ("P1_p128", 128, 128), ("M1_p32_h64", 32, 64),
        ("D1_h80", 16, 80), ("P1_p128_h80", 128, 80), ("M1_p32_h64_h80", 32, 80),
    ]  # fmt: skip
    assert specs[1].query_lens == WORKLOADS["P1"].query_lens


@pytest.mark.parametrize(
    ("names", "message"),
    [("D3", r"unknown workload 'D3': valid bases are "
            r"\['D1', 'D2', 'E1', 'E256', 'E64', 'EA256', 'EA256R', 'EM256', 'EM64', 'M1', 'M2', 'P1'\]"),
     ("P1_q128", "suffix 'q128'"), ("P1_p0", "suffix 'p0'"), ("P1_p", "suffix 'p'")],
)  # fmt: skip
def test_parse_workloads_names_the_bad_part(names, message):
    with pytest.raises(ValueError, match=message):
        attention.parse_workloads(names)


def test_parse_args_lists_and_defaults():
    args = attention.parse_args(["--workloads", "D1,P1_p128", "--impls", "pallas_gpu,fa3", "--fa3-splits", "1,8"])
    assert [s.name for s in args.specs] == ["D1", "P1_p128"]
    assert args.impl_list == ["pallas_gpu", "fa3"]
    assert args.fa3_page_list == [16, 128] and args.fa3_split_list == [1, 8] and args.cupti_calls == 50
    assert not args.skip_split_rows and attention.parse_args(["--skip-split-rows"]).skip_split_rows


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--fa3-splits", "0,1"], "--fa3-splits must list integers >= 1"), (["--fa3-pages", "16,x"], "comma-separated"),
     (["--impls", "pallas_gpu,fa4"], r"unknown --impls \['fa4'\]"), (["--cupti-calls", "2"], "must be >= 3"),
     (["--workloads", "Q1"], "unknown workload 'Q1'")],
)  # fmt: skip
def test_parse_args_exits_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        attention.parse_args(argv)
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_fa3_unavailable_reason():
    hopper = type("Dev", (), {"compute_capability": "9.0", "device_kind": "NVIDIA H100 80GB HBM3"})()
    ampere = type("Dev", (), {"compute_capability": "8.0", "device_kind": "NVIDIA A100-SXM4-80GB"})()
    assert attention.fa3_unavailable_reason(None, hopper) is None
    assert "SM90 (Hopper) only; this GPU is NVIDIA A100-SXM4-80GB (sm 8.0)" in attention.fa3_unavailable_reason(
        None, ampere
    )
    assert attention.fa3_unavailable_reason("flash_attn3_jax did not import", hopper) == (
        "flash_attn3_jax did not import"
    )


def test_import_fa3_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install --no-index --no-deps --target /tmp/site"):
        fa3_peer.import_fa3()


def test_import_fa3_stands_a_stub_in_for_einops_only_during_the_import(monkeypatch, tmp_path):
    """A stand-in package that imports einops at the top, as the wheel's flash.py does."""
    (tmp_path / "flash_attn3_jax").mkdir()
    (tmp_path / "flash_attn3_jax" / "__init__.py").write_text("import einops\nrearrange = einops.rearrange\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn3_jax", raising=False)
    monkeypatch.setitem(sys.modules, "einops", None)  # not installed
    module, notes = fa3_peer.import_fa3()
    assert notes == ["einops absent: a stub stood in at import (used only by the binding's vmap and ring paths)"]
    with pytest.raises(NotImplementedError, match="einops is not installed"):
        module.rearrange("x")
    assert sys.modules["einops"] is None  # taken out again: later imports see einops as absent
    sys.modules.pop("flash_attn3_jax")


# --------------------------------------------------------------------------- CUPTI grouping
def _events(starts_durs):
    return [cupti_timing.DeviceEvent(f"k{i}", s, d) for i, (s, d) in enumerate(starts_durs)]


def test_group_calls_splits_at_idle_gaps():
    ev = _events([(0, 100), (105, 50), (2000, 80), (2090, 10), (2095, 5), (5000, 70)])
    groups = cupti_timing.group_calls(ev, expected=3, min_gap_ns=500)
    assert [[e.name for e in g] for g in groups] == [["k0", "k1"], ["k2", "k3", "k4"], ["k5"]]
    summary = cupti_timing.summarize(groups, classes=(("short", "k4"),))
    assert summary["median_us"] == pytest.approx(0.1) and summary["max_us"] == pytest.approx(0.155)  # spans
    assert summary["median_kernel_sum_us"] == pytest.approx(0.095)
    assert summary["median_us_by_class"] == {"other": pytest.approx(0.09), "short": 0.0}


def test_summarize_counts_overlapping_kernels_once_in_the_span():
    summary = cupti_timing.summarize([_events([(0, 100), (50, 100)])])  # a dependent launch starting early
    assert summary["median_us"] == pytest.approx(0.15) and summary["median_kernel_sum_us"] == pytest.approx(0.2)


def test_group_calls_treats_overlapping_streams_as_one_call():
    ev = _events([(0, 1000), (200, 100), (1100, 10)])  # the second stream's kernel ends inside the first
    assert len(cupti_timing.group_calls(ev, expected=1, min_gap_ns=500)) == 1


def test_back_to_back_spans_every_call_and_waits_on_the_last_only(monkeypatch):
    issued = []

    def fake_events(run):
        run()
        return _events([(1000, 300), (1350, 300), (1700, 400)])  # 3 calls issued back to back: 1.1 us

    monkeypatch.setattr(cupti_timing, "_traced_events", fake_events)
    us = cupti_timing.back_to_back_us(lambda: issued.append(1) or jnp.zeros(2), n=3)
    assert us == pytest.approx(1.1 / 3) and len(issued) == 4  # one warm-up call, then the 3 traced


def test_group_calls_refuses_a_count_it_cannot_explain():
    with pytest.raises(RuntimeError, match="split into 2 calls .* expected 3"):
        cupti_timing.group_calls(_events([(0, 10), (1000, 10)]), expected=3, min_gap_ns=500)


# --------------------------------------------------------------------------- the FA3 rows end to end
def _fake_trace(calls, n=50, gap_s=1e-3):
    """One call each (it must run), then n synthetic calls: 10 us + 1 us per split over 2."""
    out = {}
    for name, call in calls.items():
        jax.block_until_ready(call())
        splits = [int(p[1:]) for p in name.split("_") if p.startswith("s") and p[1:].isdigit()]
        us = 10 + sum(abs(s - 2) for s in splits)
        out[name] = [[cupti_timing.DeviceEvent(name, 0, us * 1e3)]] * n
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["M1", "P1"])
def test_run_fa3_rows_check_every_call_and_pick_the_best_splits(small, name, monkeypatch):
    monkeypatch.setattr(cupti_timing, "trace_calls", _fake_trace)
    monkeypatch.setattr(cupti_timing, "back_to_back_us", lambda call, n=50: 9.0)
    monkeypatch.setattr(attention, "time_jax", lambda fn, *a, **k: 1e-3)
    if name == "M1":
        b, ref = small
    else:
        spec = dataclasses.replace(SMALL, name="P1", query_lens=(8, 8), context_lens=(0, 0))
        b = attention.make_device_batch(spec, seed=4)
        args = (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
        ref = attention.xla_fn(b, jnp.float32)(*args)
    results = []

    def record(impl, t, err, extra=None, *, device_s=None, counts=None):
        results.append({"impl": impl, "ms": t * 1e3, "rel_l2_vs_f32": err, "device_ms": device_s * 1e3,
                        "counts": counts, **(extra or {})})  # fmt: skip

    pages = [4] if name == "M1" else [8]
    attention.run_fa3(FakeFA3, b, ref, ref, pages, [1, 2, 3], 5, record, results, lambda *a: None)
    rows = {r["impl"]: r for r in results}
    assert not [r for r in results if "error" in r]
    assert all(r["device"]["back_to_back_us"] == 9.0 for r in results if "_s" in r["impl"] or "dense" in r["impl"])
    for r in results:
        assert r["max_abs_err_vs_f32"] < 2e-5 and r["max_abs_err_vs_pallas_gpu"] < 2e-5, r["impl"]
    if name == "M1":
        expected = {f"fa3_paged_p4_s{n}_q{q}" for n in (1, 2, 3) for q in (5, 1)}
        assert expected | {"fa3_varlen", "fa3_paged_p4"} == set(rows)
        assert rows["fa3_paged_p4"]["num_splits"] == [2, 2] and rows["fa3_paged_p4"]["device_ms"] == 0.01
        assert rows["fa3_paged_p4_s3_q1"]["counts"] == attention.count_floors(b.spec, [1, 1, 1], [9, 9, 9])
        assert rows["fa3_varlen"]["counts"] is None
    else:  # no cached context: one split, the dense call, and the best row naming its source
        assert {"fa3_paged_p8_s1", "fa3_dense", "fa3_paged_p8"} == set(rows)
        assert rows["fa3_paged_p8"]["best_of_sweep"] == "fa3_paged_p8_s1"


def test_peer_table_puts_fa3_beside_attn_stack_and_says_what_is_missing():
    dev = {"device_tflop_per_s": 600.0, "device_pct_of_floor": 80.0, "floor_ms": 0.8}
    results = [
        {"workload": "P1", "impl": "pallas_gpu_with_write", "device_ms": 1.0, **dev,
         "device_step": {"median_kernel_sum_us": 997.0, "back_to_back_us": 1000.0,
                         "median_us_by_class": {"attention_mosaic_gpu": 950.0, "kv_write_pallas": 47.0}}},
        {"workload": "P1", "impl": "fa3_paged_p128", "device_ms": 0.85, "num_splits": 1, **dev},
        {"workload": "P1", "impl": "fa3_paged_p16_s1", "device_ms": 0.9, **dev},  # a sweep row: not in the table
        {"workload": "P1", "impl": "fa3_paged_p16", "device_ms": 0.95, "num_splits": 1, "max_abs_err_vs_f32": 0.004,
         **dev},
        {"workload": "P1", "impl": "fa3_dense", "ms": 0.9, "device_error": "RuntimeError: no GPU stream events"},
        {"workload": "D1", "impl": "pallas_gpu", "device_ms": 0.4, **dev},
        {"workload": "D1", "impl": "fa3", "error": "flash_attn3_jax did not import (ModuleNotFoundError: x)"},
    ]  # fmt: skip
    lines = attention.peer_table(results).splitlines()
    assert lines[2] == (
        "| P1 | attn-stack, write + attend | 1.000 | 600 | 80.0 | 0.800 |  | "
        "kernels sum 997.0 us; back to back 1000.0 us a call (80.0 % of floor); "
        "attention_mosaic_gpu 950.0 us, kv_write_pallas 47.0 us |"
    )
    assert lines[3] == "| P1 | FA3 paged, page 16 | 0.950 | 600 | 80.0 | 0.800 | 4.00e-03 | num_splits 1 |"
    assert lines[4] == "| P1 | FA3 paged, page 128 | 0.850 | 600 | 80.0 | 0.800 |  | num_splits 1 |"
    assert lines[5] == "| P1 | FA3 dense | | | | | | no device time: RuntimeError: no GPU stream events |"
    assert lines[6].startswith("| D1 | attn-stack, attention alone | 0.400 |")
    assert lines[7].endswith("| not run: flash_attn3_jax did not import (ModuleNotFoundError: x) |")
    assert len(lines) == 8


@pytest.mark.slow
def test_the_wheels_calls_lower_for_cuda(tmp_path, monkeypatch):
    """With the wheel in the checkout's .whl/ (never installed): every FA3 call the benchmark
    makes traces through the binding and lowers for CUDA to its FFI target, splits as asked."""
    import pathlib
    import zipfile

    wheels = sorted((pathlib.Path(attention.ROOT) / ".whl").glob("flash_attn3_jax-0.2.3-*.whl"))
    if not wheels:
        pytest.skip("no flash_attn3_jax 0.2.3 wheel under .whl/")
    zipfile.ZipFile(wheels[0]).extractall(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("flash_attn3_jax")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        fa3, _ = fa3_peer.import_fa3()
        spec = dataclasses.replace(WORKLOADS["M1"], query_lens=(64, 1, 1), context_lens=(32, 100, 100))
        b = attention.make_device_batch(spec)
        configs, per_page = attention.fa3_configs(fa3, b, [16], [3])
        configs.append(attention.fa3_combined(fa3, b, per_page[16], [1, 3], 16))
        for c in configs:
            text = c.fn.trace(*c.args).lower(lowering_platforms=("cuda",)).as_text()
            calls = re.findall(r"custom_call @flash_mha_fwd.*?num_splits = (\d+)", text)
            expected = {"fa3_varlen": ["1"], "fa3_paged_p16": ["1", "3"]}.get(c.impl, [str(c.extra.get("num_splits"))])
            assert calls == expected, c.impl
    finally:  # the binding imported from tmp_path goes out of sys.modules again
        for name in [m for m in sys.modules if m.startswith("flash_attn3_jax")]:
            del sys.modules[name]


def test_tune_candidates_cover_narrow_heads_packs_and_short_contexts_splits():
    """The engine's decode shapes (SmolLM2's 3 KV heads of 64): every pack of adjacent heads up to
    all three, and at batch 1 splits of a short context up to its tile count, none past it."""
    spec = dataclasses.replace(attention.WORKLOADS["E1"], context_lens=(255,))  # 256 keys: 4 tiles of 64
    b = attention.make_device_batch(spec)
    cands = attention.tune_candidates(b)
    assert {bs.kv_heads_per_program for bs in cands} == {1, 2, 3}
    for bs in cands:
        assert bs.num_kv_splits <= -(-256 // bs.tile(16))
        assert bs.rows(3) == 16
    assert {bs.num_kv_splits for bs in cands if bs.tile(16) == 32} == {1, 2, 4, 8}
    d1 = attention.tune_candidates(attention.make_device_batch(dataclasses.replace(
        attention.WORKLOADS["D1"], query_lens=(1,) * 2, context_lens=(64,) * 2)))  # fmt: skip
    assert {bs.kv_heads_per_program for bs in d1} == {1}  # head 128: already a whole tile


def test_a_tune_run_merges_into_the_devices_table():
    """A run's entries replace the old ones with their match keys and keep the others (tuning D1
    again must not drop the table's SmolLM2 entry); two of the run's with the same keys keep the first."""
    match = dict(mode="decode", head_size=128, group=4, page_size=16, q_dtype="bfloat16", kv_dtype="bfloat16")
    other = {**match, "head_size": 64, "group": 3, "note": "workload E1", "block_q": 4}
    old = {"device_kind": "GPU X", "source": "an earlier run", "entries": [{**match, "note": "old D1"}, other]}
    new = [{**match, "note": "workload D1", "block_q": 4}, {**match, "note": "workload D2", "block_q": 2}]
    table, notes = attention.merged_table(old, new, "GPU X", "this run")
    assert [e["note"] for e in table["entries"]] == ["workload E1", "workload D1"]
    assert table["source"] == "an earlier run; this run" and table["match_keys"] == list(attention.GPU_MATCH_KEYS)
    assert any("workload D2: dropped" in n for n in notes) and any("replaced the entry 'old D1'" in n for n in notes)
    fresh, _ = attention.merged_table(None, new[:1], "GPU X", "this run")
    assert fresh["source"] == "this run" and len(fresh["entries"]) == 1


def test_a_tuned_entry_is_keyed_by_the_launch_its_workload_runs():
    """The builder reads the decode and mixed launches' entries only (a prefill batch runs the
    mixed launch), so a tune of a prefill workload writes a "mixed" entry, which the table validates."""
    small = dict(context_lens=(0,) * 2)
    keyed = {
        name: attention.tuned_match(attention.make_device_batch(dataclasses.replace(attention.WORKLOADS[name], **q)))
        for name, q in [("D1", {"query_lens": (1,) * 2, "context_lens": (64,) * 2}),
                        ("P1", {"query_lens": (16,) * 2, **small}),
                        ("M1", {"query_lens": (16, 1), "context_lens": (0, 64)})]
    }  # fmt: skip
    assert {name: match["mode"] for name, match in keyed.items()} == {"D1": "decode", "P1": "mixed", "M1": "mixed"}
    config.gpu_entry_block_sizes({**keyed["P1"], "block_q": 4, "pages_per_tile": 4})


def test_compile_all_keeps_order_and_each_candidates_failure():
    """The tuner's candidates compile on threads; each result is its own executable or the
    exception its lowering raised, in the candidates' order."""
    x = jnp.arange(6.0).reshape(2, 3)
    fns = [jax.jit(lambda a: a * 2), jax.jit(lambda a: a @ a), jax.jit(lambda a: a.sum(axis=0))]
    out = attention.compile_all(fns, (x,), threads=2)
    assert len(out) == 3 and isinstance(out[1], Exception)  # [2, 3] @ [2, 3]: a shape error
    np.testing.assert_allclose(out[0](x), np.arange(6.0).reshape(2, 3) * 2)
    np.testing.assert_allclose(out[2](x), [3.0, 5.0, 7.0])
