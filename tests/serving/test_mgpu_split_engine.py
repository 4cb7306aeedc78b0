"""The engine's mixed steps on Hopper: a long prompt's chunks on the Mosaic GPU prefill beside
the running decodes (the split with its decode part) give the Triton kernel's greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.backends import pallas_gpu
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.ops.ragged_paged_attention.config import mgpu_prefill_available
from attn_jax.serving import Engine, SamplingParams

CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
    eos_token_ids=(1,), max_position_embeddings=2048,
)  # fmt: skip
BUILD = pallas_gpu.PallasGPUMetadataBuilder._build


def _tokens(monkeypatch, mgpu: str, builds: list) -> list[list[int]]:
    """Six short requests decoding, then three long prompts admitted beside them; every
    request's greedy tokens, and (in ``builds``) whether each built batch took the split
    with a decode part while holding a decode."""
    from attn_jax.registry import AttentionBackendEnum

    monkeypatch.setenv(pallas_gpu.MGPU_PREFILL_ENV, mgpu)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(CONFIG, seed=0))
    model = LlamaModel(CONFIG, block_size=16, attn_backend=AttentionBackendEnum.PALLAS_GPU, dtype=jnp.bfloat16)
    engine = Engine(model, params, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1300)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = [engine.add_request(rng.integers(3, 512, 40).tolist(), greedy) for _ in range(6)]
    out = {i: [] for i in ids}
    for _ in range(3):
        for run in engine.step_runs():
            out[run.request_id] += run.token_ids
    ids += [engine.add_request(rng.integers(3, 512, n).tolist(), greedy) for n in (700, 333, 1200)]
    out.update({i: [] for i in ids[6:]})

    def recorded(self, *args, **kwargs):
        md, mode = BUILD(self, *args, **kwargs)
        decodes = (np.diff(np.asarray(md.query_start_loc)) == 1).any()
        builds.append(bool(decodes and md.rest_schedule is not None and md.decode_block_sizes is not None))
        return md, mode

    monkeypatch.setattr(pallas_gpu.PallasGPUMetadataBuilder, "_build", recorded)
    while engine.has_unfinished():
        for run in engine.step_runs():
            out[run.request_id] += run.token_ids
    return [out[i] for i in ids]


@pytest.mark.gpu
def test_mixed_steps_split_on_hopper_give_the_triton_tokens(monkeypatch):
    if jax.default_backend() != "gpu" or not mgpu_prefill_available(jax.devices()[0].device_kind):
        pytest.skip("needs a Hopper GPU (H100/H200) for Mosaic GPU")
    split_builds, triton_builds = [], []
    split = _tokens(monkeypatch, "1", split_builds)
    triton = _tokens(monkeypatch, "0", triton_builds)
    assert any(split_builds) and not any(triton_builds), (split_builds, triton_builds)
    assert split == triton
    assert all(len(t) == 12 for t in split)
