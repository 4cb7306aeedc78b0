"""MLA's prefill on the Mosaic GPU kernel (``ops/mla/prefill_pallas_mosaic_gpu``) against the
float64 oracle, compiled on a Hopper GPU (marker ``gpu``): requests the kernel's 128-token
tiles serve, the rows they leave to the Triton kernel, and padding rows. Its lowering from
the CPU is ``test_mla_lowering``'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.ops.mla import prefill_pallas_mosaic_gpu
from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available
from attn_jax.testing.mla import make_mla_batch
from tests.ops.mla_oracle import mla_prefill_oracle


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("traced", "padding"), [(False, 3), (True, 3), (True, 1100)],
    ids=["host_metadata", "traced_metadata", "traced_metadata_long_padding"],
)  # fmt: skip
def test_prefill_on_mosaic_gpu_matches_oracle(traced, padding):
    """Padding rows: a few, or more than the Triton kernel's q-blocks cover in one pass (its
    padding programs loop)."""
    if jax.default_backend() != "gpu" or not mgpu_prefill_available(jax.devices()[0].device_kind):
        pytest.skip("needs a Hopper GPU (H100/H200) for Mosaic GPU")
    rng = np.random.default_rng(11)
    query_lens, seq_lens = [300, 1, 140, 5, 130], [400, 300, 140, 50, 200]
    b = make_mla_batch(11, seq_lens=seq_lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                       dtype=jnp.bfloat16)  # fmt: skip
    num_tokens = sum(query_lens) + padding
    q = jnp.asarray(rng.standard_normal((num_tokens, 16, 192)), jnp.bfloat16)
    w_uk = jnp.asarray(rng.standard_normal((512, 16, 128)) * 512**-0.5, jnp.bfloat16)
    w_uv = jnp.asarray(rng.standard_normal((512, 16, 128)) * 512**-0.5, jnp.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)

    def run(q, cache, w_uk, w_uv, qsl, lens, tables):
        return prefill_pallas_mosaic_gpu.mla_prefill(q, cache, w_uk, w_uv, qsl, lens, tables, sm_scale=192**-0.5,
                                                     kv_lora_rank=512, q_block=512)  # fmt: skip

    args = (q, b.kv_cache, w_uk, w_uv, qsl, b.seq_lens, b.block_tables)
    out = jax.jit(run)(*args) if traced else run(*args)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, w_uk, w_uv)]
    want, _ = mla_prefill_oracle(f64[0][: qsl[-1]], b.latents, f64[1], f64[2], query_lens, sm_scale=192**-0.5)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[: qsl[-1]], want, atol=3e-2, rtol=3e-2)
    assert (out[qsl[-1] :] == 0).all(), "padding rows are zero"
    err = np.linalg.norm(out[: qsl[-1]] - want) / np.linalg.norm(want)
    assert err < 1e-2, err
