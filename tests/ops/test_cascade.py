"""Log-sum-exp out of the kernels, merge_attn_states and cascade attention, against the
float64 oracle (NaN in every unused cache slot, as everywhere)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.ragged_paged_attention import pallas_triton, reference
from attn_jax.ops.ragged_paged_attention.cascade import cascade_ragged_paged_attention
from attn_jax.ops.ragged_paged_attention.config import GpuBlockSizes
from attn_jax.ops.ragged_paged_attention.merge import merge_attn_states, merge_many_attn_states
from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import TOLERANCES, make_options, read_back
from tests.oracle import attention_oracle

_SHAPE = dict(num_q_heads=8, num_kv_heads=2, head_size=32, block_size=16)
_MIXED = dict(query_lens=[1, 9, 1, 5], context_lens=[37, 0, 20, 16], **_SHAPE, num_tokens=19, extra_blocks=1)
OPS = {
    "reference": reference.ragged_paged_attention,
    "triton_one_pass": functools.partial(
        pallas_triton.ragged_paged_attention, interpret=True, block_sizes=GpuBlockSizes(4, 1)
    ),
    "triton_split_kv": functools.partial(
        pallas_triton.ragged_paged_attention, interpret=True, block_sizes=GpuBlockSizes(4, 1, num_kv_splits=3)
    ),
}


def _oracle(batch, options, kv_cache):
    k_seqs, v_seqs = read_back(batch, kv_cache)
    return attention_oracle(np.asarray(batch.q), k_seqs, v_seqs, batch.query_lens, **options, return_lse=True)


@pytest.mark.parametrize("name", list(OPS))
def test_lse_matches_the_oracle(name):
    batch = make_ragged_batch(0, **_MIXED)
    options = make_options(batch, logits_soft_cap=5.0, sinks=True)
    out, cache, lse = OPS[name](*batch.op_args, **options, return_lse=True)
    expected_out, expected_lse = _oracle(batch, options, cache)
    n = batch.num_actual_tokens
    assert lse.shape == (batch.q.shape[0], 8) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse[:n]), expected_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[:n]), expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse[n:]), np.broadcast_to(options["sinks"], lse[n:].shape), rtol=1e-6)
    _, _, no_sink_lse = OPS[name](*batch.op_args, **make_options(batch), return_lse=True)
    assert np.isneginf(np.asarray(no_sink_lse[n:])).all(), "padding rows see no key: LSE -inf"


def test_merge_of_two_disjoint_parts_is_the_whole():
    rng = np.random.default_rng(0)
    T, H, D, L = 5, 3, 4, 12
    s = rng.normal(size=(T, H, L))
    v = rng.normal(size=(L, D))
    cut = 7

    def part(lo, hi):
        w = np.exp(s[..., lo:hi])
        return (w @ v[lo:hi]) / w.sum(-1, keepdims=True), np.log(w.sum(-1))

    (out_a, lse_a), (out_b, lse_b), (out, lse) = part(0, cut), part(cut, L), part(0, L)
    merged, merged_lse = merge_attn_states(*(jnp.asarray(x, jnp.float32) for x in (out_a, lse_a, out_b, lse_b)))
    np.testing.assert_allclose(np.asarray(merged), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged_lse), lse, rtol=1e-5, atol=1e-6)


def test_merge_of_empty_parts():
    out = jnp.asarray(np.random.default_rng(1).normal(size=(3, 2, 4)), jnp.float32)
    garbage = jnp.full_like(out, jnp.nan)  # an empty part's output is never read
    lse = jnp.asarray([[0.5, -1.0]] * 3, jnp.float32)
    for empty in (-jnp.inf, jnp.inf):  # vLLM marks an empty part with +inf too
        merged, merged_lse = merge_attn_states(garbage, jnp.full_like(lse, empty), out, lse)
        np.testing.assert_array_equal(np.asarray(merged), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(merged_lse), np.asarray(lse))
    both, both_lse = merge_attn_states(garbage, jnp.full_like(lse, -jnp.inf), garbage, jnp.full_like(lse, -jnp.inf))
    assert (np.asarray(both) == 0).all() and np.isneginf(np.asarray(both_lse)).all()
    with pytest.raises(ValueError, match=r"out_a \(3, 2, 4\), lse_a \(3, 2\), out_b \(3, 2, 5\)"):
        merge_attn_states(out, lse, jnp.zeros((3, 2, 5)), lse)


def _shared_batch(**kwargs):
    """Four requests sharing 32 cached tokens (two pages), then their own pages."""
    return make_ragged_batch(3, query_lens=[1, 6, 1, 3], context_lens=[40, 33, 32, 47], **_SHAPE,
                             num_tokens=14, extra_blocks=2, **kwargs).with_shared_prefix(32)  # fmt: skip


@pytest.mark.parametrize(
    "name, fuse_merge",
    [("reference", False), ("triton_one_pass", False), ("triton_one_pass", True), ("triton_split_kv", True)],
)
def test_cascade_matches_the_oracle(name, fuse_merge):
    """The prefix read once, then each request's own pages; merged by LSE after both parts, or
    (``fuse_merge``) inside the suffix part's kernel, which starts from the prefix part's state."""
    batch = _shared_batch()
    options = make_options(batch, logits_soft_cap=5.0, sinks=True)
    del options["sliding_window"], options["alibi_slopes"], options["causal"]
    fuse = {"fuse_merge": True} if fuse_merge else {}
    out, cache = cascade_ragged_paged_attention(*batch.op_args, prefix_len=32, op=OPS[name], **options, **fuse)
    expected, _ = _oracle(batch, {**options, "causal": True}, cache)
    n = batch.num_actual_tokens
    tol = TOLERANCES["float32"]
    np.testing.assert_allclose(np.asarray(out[:n]), expected, rtol=tol.rtol, atol=tol.atol)
    assert np.isfinite(np.asarray(out[n:])).all()


def test_fused_merge_folds_an_fp8_cache_scale_as_the_merge_does():
    """With an fp8 cache the kernel's state is in cache units (times v_scale at the end): the
    prefix part's output joins it divided by v_scale."""
    batch = _shared_batch(cache_dtype_str="fp8_e4m3")
    options = dict(sm_scale=0.2, k_scale=batch.k_scale, v_scale=batch.v_scale)
    run = functools.partial(cascade_ragged_paged_attention, *batch.op_args, prefix_len=32, op=OPS["triton_one_pass"])
    fused, _ = run(**options, fuse_merge=True)
    merged, _ = run(**options)
    n = batch.num_actual_tokens
    np.testing.assert_allclose(np.asarray(fused[:n]), np.asarray(merged[:n]), rtol=1e-5, atol=1e-5)


def test_raw_states_of_an_empty_batch_are_one_empty_split():
    batch = make_ragged_batch(1, query_lens=[0], context_lens=[20], **_SHAPE)
    (m, denom, acc), _ = OPS["triton_one_pass"](*batch.op_args, sm_scale=0.1, return_states=True)
    assert (m.shape, denom.shape, acc.shape) == ((1, 0, 8), (1, 0, 8), (1, 0, 8, 32))


def test_cascade_refusals_are_named():
    batch = make_ragged_batch(3, query_lens=[1, 2], context_lens=[40, 33], **_SHAPE).with_shared_prefix(32)
    run = functools.partial(cascade_ragged_paged_attention, *batch.op_args, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"prefix_len=24 must be a positive multiple of the page size 16"):
        run(prefix_len=24)
    with pytest.raises(ValueError, match=r"prefix_len=48 exceeds request 0's cached context 40"):
        run(prefix_len=48)
    with pytest.raises(ValueError, match=r"no sliding_window \(8\)"):
        run(prefix_len=32, sliding_window=8)
    unshared = make_ragged_batch(3, query_lens=[1, 2], context_lens=[40, 33], **_SHAPE)
    with pytest.raises(ValueError, match=r"request 1's first 2 pages differ from request 0's"):
        cascade_ragged_paged_attention(*unshared.op_args, sm_scale=0.1, prefix_len=32)


def test_merge_many_attn_states_matches_one_softmax_over_all_keys():
    """Splits' normalised outputs and LSEs merge into the softmax over their union; an empty
    split (-inf, its output garbage) contributes nothing; a row empty everywhere is zero."""
    rng = np.random.default_rng(3)
    k, r, h, c, n = 3, 2, 4, 8, 5
    scores = rng.standard_normal((k, r, h, n))
    values = rng.standard_normal((k, r, n, c))
    lse = np.log(np.exp(scores).sum(-1))
    out = np.einsum("krhn,krnc->krhc", np.exp(scores - lse[..., None]), values)
    lse[1, 0] = -np.inf  # request 0's second split saw no key
    out[1, 0] = np.nan
    lse[:, 1, 2] = -np.inf  # request 1, head 2: no key anywhere
    parts = list(jnp.asarray(out, jnp.float32)), list(jnp.asarray(lse, jnp.float32))
    merged, merged_lse = merge_many_attn_states(*parts)
    keep = np.isfinite(lse)[..., None]
    w = np.where(keep[..., 0], np.exp(lse), 0.0)
    want = np.where(keep, out, 0.0)
    want = (want * w[..., None]).sum(0) / np.where(w.sum(0) == 0, 1.0, w.sum(0))[..., None]
    np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(merged_lse)[1, 2]) and (np.asarray(merged)[1, 2] == 0).all()
    np.testing.assert_allclose(np.asarray(merged_lse)[0], np.log(w.sum(0)[0]), rtol=1e-6)
