"""Sparse MLA over per-token top-k positions and the lightning indexer (each as the jnp
reference and the Triton kernel in the interpreter), against float64 NumPy oracles; NaN in
unused slots."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import indexer_pallas_triton, sparse_pallas_triton
from attn_jax.ops.mla.sparse_reference import lightning_indexer as reference_indexer
from attn_jax.ops.mla.sparse_reference import sparse_mla
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import indexer_oracle, sparse_mla_oracle

C, ROPE, H, S, K = 32, 16, 4, 16, 24
QUERY_LENS, SEQ_LENS = [3, 1, 0, 5], [3, 40, 2, 21]


def _batch(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    b = make_mla_batch(seed, seq_lens=SEQ_LENS, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=S, dtype=dtype)
    num_tokens = sum(QUERY_LENS) + 2  # two padding rows
    topk = np.full((num_tokens, K), -1, np.int32)
    row = 0
    for qlen, n in zip(QUERY_LENS, SEQ_LENS, strict=True):
        for i in range(qlen):
            p = n - qlen + i
            chosen = rng.permutation(p + 1)[: rng.integers(1, K + 1)]  # up to K distinct visible positions
            topk[row, : chosen.size] = chosen
            row += 1
    topk[0] = -1  # a token that attends to nothing
    q = jnp.asarray(rng.standard_normal((num_tokens, H, C + ROPE)).astype(np.float32), dtype)
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(np.int32)
    return b, q, topk, qsl


@pytest.mark.parametrize("impl", ["reference", "triton_interpret"])
def test_sparse_matches_oracle(impl):
    b, q, topk, qsl = _batch(1)
    args = (q, b.kv_cache, topk, qsl, b.seq_lens, b.block_tables)
    if impl == "reference":
        out, lse = sparse_mla(*args, sm_scale=0.15, kv_lora_rank=C, return_lse=True)
    else:
        out, lse = sparse_pallas_triton.sparse_mla(*args, sm_scale=0.15, kv_lora_rank=C, return_lse=True,
                                                   interpret=True, block_h=16, block_k=16)  # fmt: skip
    want, want_lse = sparse_mla_oracle(np.asarray(q), b.latents, topk, QUERY_LENS, kv_lora_rank=C, sm_scale=0.15)
    n = sum(QUERY_LENS)
    np.testing.assert_allclose(np.asarray(out, np.float64)[:n], want[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:n], want_lse[:n], atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))  # all -1
    assert np.all(np.asarray(out)[n:] == 0)  # padding rows


def test_sparse_error_index_beyond_sequence():
    b, q, topk, qsl = _batch(2)
    topk[1, 0] = 3  # token 1 is request 0's position 1
    with pytest.raises(ValueError, match=r"topk_positions\[1, 0\]=3 is beyond token 1's sequence \(request 0, "
                                         r"position 1\): valid entries are -1 \(padding\) or 0..1"):  # fmt: skip
        sparse_mla(q, b.kv_cache, topk, qsl, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C)


@pytest.mark.parametrize("impl", ["reference", "triton_interpret"])
def test_lightning_indexer_matches_oracle_and_feeds_sparse_mla(impl):
    rng = np.random.default_rng(3)
    hi, di, topk = 16, 16, 8
    lightning_indexer = {
        "reference": reference_indexer,
        "triton_interpret": functools.partial(indexer_pallas_triton.lightning_indexer, interpret=True, block_l=16),
    }[impl]
    idx_batch = make_mla_batch(5, seq_lens=SEQ_LENS, num_heads=1, kv_lora_rank=8, rope_dim=di - 8, block_size=S)
    num_tokens = sum(QUERY_LENS) + 1
    q_idx = rng.standard_normal((num_tokens, hi, di)).astype(np.float32)
    weights = rng.uniform(0.5, 1.5, (num_tokens, hi)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(np.int32)
    got = np.asarray(lightning_indexer(q_idx, weights, idx_batch.kv_cache, qsl, idx_batch.seq_lens,
                                       idx_batch.block_tables, topk=topk))  # fmt: skip
    want = indexer_oracle(q_idx, weights, idx_batch.latents, QUERY_LENS, topk=topk)
    for t, expected in enumerate(want):
        assert set(got[t][got[t] >= 0].tolist()) == expected
        assert (got[t] >= 0).sum() == min(topk, len(expected))
    assert np.all(got[len(want) :] == -1)  # the padding row
    b = make_mla_batch(6, seq_lens=SEQ_LENS, num_heads=H, kv_lora_rank=C, rope_dim=ROPE, block_size=S)
    q = jnp.asarray(rng.standard_normal((num_tokens, H, C + ROPE)).astype(np.float32))
    out = sparse_mla(q, b.kv_cache, got, qsl, b.seq_lens, b.block_tables, sm_scale=0.1, kv_lora_rank=C)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.gpu
def test_sparse_compiled_on_gpu():
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(7)
    lens = [300, 2049, 64]
    b = make_mla_batch(7, seq_lens=lens, num_heads=128, kv_lora_rank=512, rope_dim=64, block_size=64,
                       dtype=jnp.bfloat16)  # fmt: skip
    qlens = [4, 1, 64]
    topk = np.full((sum(qlens), 256), -1, np.int32)
    row = 0
    for qlen, n in zip(qlens, lens, strict=True):
        for i in range(qlen):
            p = n - qlen + i
            chosen = rng.permutation(p + 1)[:256]
            topk[row, : chosen.size] = chosen
            row += 1
    q = jnp.asarray(rng.standard_normal((sum(qlens), 128, 576)).astype(np.float32), jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    out = sparse_pallas_triton.sparse_mla(q, b.kv_cache, topk, qsl, b.seq_lens, b.block_tables, sm_scale=192**-0.5,
                                          kv_lora_rank=512, interpret=False)  # fmt: skip
    want, _ = sparse_mla_oracle(np.asarray(q.astype(jnp.float32)), b.latents, topk, qlens, kv_lora_rank=512,
                                sm_scale=192**-0.5)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-2, rtol=2e-2)


def test_indexer_kernel_scores_match_the_reference_and_refuse_odd_heads():
    """The kernel's scores (not only their top-k) against a dense float64 computation of the
    same formula; -inf exactly where a token may not look; the Triton tile rules named."""
    rng = np.random.default_rng(4)
    b = make_mla_batch(8, seq_lens=SEQ_LENS, num_heads=1, kv_lora_rank=8, rope_dim=8, block_size=S)
    num_tokens = sum(QUERY_LENS) + 1
    q_idx = rng.standard_normal((num_tokens, 16, 16)).astype(np.float32)
    weights = rng.uniform(0.5, 1.5, (num_tokens, 16)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(np.int32)
    got = np.asarray(indexer_pallas_triton.index_scores(q_idx, weights, b.kv_cache, qsl, b.seq_lens, b.block_tables,
                                                        interpret=True, block_l=16))  # fmt: skip
    row = 0
    for qlen, lat in zip(QUERY_LENS, b.latents, strict=True):
        for i in range(qlen):
            p = len(lat) - qlen + i
            keys = np.asarray(lat[: p + 1], np.float64)
            want = (weights[row, :, None] * np.maximum(q_idx[row].astype(np.float64) @ keys.T, 0)).sum(0)
            np.testing.assert_allclose(got[row, : p + 1], want, rtol=1e-5, atol=1e-5)
            assert np.isneginf(got[row, p + 1 :]).all()
            row += 1
    assert np.isneginf(got[row:]).all()  # the padding row
    with pytest.raises(ValueError, match="index heads=8 must be a power of two >= 16"):
        indexer_pallas_triton.index_scores(q_idx[:, :8], weights[:, :8], b.kv_cache, qsl, b.seq_lens, b.block_tables)


@pytest.mark.gpu
def test_indexer_compiled_on_gpu_matches_reference():
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(9)
    qlens, lens = [4, 1, 200], [300, 2049, 200]
    b = make_mla_batch(9, seq_lens=lens, num_heads=1, kv_lora_rank=64, rope_dim=64, block_size=64,
                       dtype=jnp.bfloat16)  # fmt: skip
    num_tokens = sum(qlens)
    q_idx = jnp.asarray(rng.standard_normal((num_tokens, 64, 128)), jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (num_tokens, 64)), jnp.float32)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    args = (q_idx, weights, b.kv_cache, qsl, b.seq_lens, b.block_tables)
    got = np.asarray(indexer_pallas_triton.index_scores(*args, interpret=False))
    want = np.asarray(indexer_pallas_triton.index_scores(*args, interpret=True))
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all()
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-2, atol=2e-2)
