"""The reference op lowers for TPU and GPU from this CPU machine (jax.export).

Nothing runs on those platforms here: this checks that the XLA backend's op, jitted,
produces a StableHLO module for each platform, so selecting XLA there cannot fail at
lowering time.
"""

import jax
import jax.numpy as jnp
import pytest

from attn_jax.ops.ragged_paged_attention.reference import ragged_paged_attention
from attn_jax.testing.workloads import make_ragged_batch


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("cache_dtype_str", ["auto", "fp8"])
def test_reference_exports_for(platform, cache_dtype_str):
    batch = make_ragged_batch(
        0, [1, 3], [4, 0], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
        dtype=jnp.bfloat16, cache_dtype_str=cache_dtype_str,
    )  # fmt: skip

    def step(*args):
        return ragged_paged_attention(
            *args, sm_scale=8**-0.5, sliding_window=3, logits_soft_cap=5.0,
            sinks=jnp.zeros(4, jnp.float32), **batch.op_kwargs,
        )  # fmt: skip

    exported = jax.export.export(jax.jit(step), platforms=[platform])(*batch.op_args)
    assert exported.platforms == (platform,)
    assert "stablehlo" in exported.mlir_module()
