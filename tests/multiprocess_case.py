"""The workload of the multi-process test, shared by the test (one process) and its workers."""

from __future__ import annotations

import numpy as np

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16
)


def generate(mesh=None, model_kwargs=None) -> list[list[int]]:
    """Greedy tokens of three uneven prompts on ``mesh`` (None: one device)."""
    model = LlamaModel(CONFIG, block_size=4, **(model_kwargs or {}))
    engine = Engine(
        model, init_params(CONFIG, seed=2), mesh=mesh, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
        num_blocks=16, buckets=MetadataBuckets((32,), (4,), (16,)),
    )  # fmt: skip
    prompts = [np.random.default_rng(i).integers(0, 128, n).tolist() for i, n in enumerate((4, 19, 7))]
    return [c.output_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))]
