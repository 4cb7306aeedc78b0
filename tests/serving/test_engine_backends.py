"""The engine with each attention backend gives the same tokens (a tiny random model, so
the Pallas GPU kernel's interpreter run stays short)."""

from __future__ import annotations

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import Engine, SamplingParams

CONFIG = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=4, head_dim=32
)


def _tokens(backend: str) -> list[list[int]]:
    model = LlamaModel(CONFIG, attn_backend=AttentionBackendEnum[backend].get_class())
    engine = Engine(
        model, init_params(CONFIG, seed=3), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
        num_blocks=16, buckets=MetadataBuckets((32,), (4,), (4,)),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 40, 9)]  # 40 > the 32-token budget
    return [c.output_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))]


@pytest.mark.parametrize("backend", ["PALLAS_GPU"])
def test_backends_give_the_xla_tokens(backend):
    assert _tokens(backend) == _tokens("XLA")
