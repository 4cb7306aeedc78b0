"""The DeepSeek-shaped MLA decoder against transformers' DeepseekV3ForCausalLM with the same
random weights (tiny configs, dense MLPs and a mixture of experts): greedy tokens through a
plain prefill/mixed/decode loop and through the serving engine."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata  # noqa: E402
from attn_jax.models.deepseek import DeepSeekConfig, DeepSeekModel, params_from_hf  # noqa: E402
from attn_jax.serving import Engine, SamplingParams  # noqa: E402

NEW_TOKENS = 6
PROMPTS = [[3, 17, 99, 42, 8], [120, 5, 64, 64, 2, 77, 31, 90, 11]]


def _random_hf_model(config, seed: int):
    """transformers' DeepseekV3ForCausalLM (float32, eval) with random weights: RMSNorm weights
    near 1, matrices scaled by their fan-in."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


def _hf_greedy(hf, new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each of PROMPTS (full forward per token, no cache)."""
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    return want


@pytest.fixture(scope="module", params=[32, pytest.param(None, marks=pytest.mark.slow)], ids=["q_lora", "q_proj"])
def models(request):
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=request.param, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=2, max_position_embeddings=128,
    )  # fmt: skip
    hf = _random_hf_model(config, seed=0)
    want = _hf_greedy(hf, NEW_TOKENS)
    config = DeepSeekConfig.from_hf(hf.config)
    return DeepSeekModel(config, block_size=16), params_from_hf(hf), want


def test_greedy_loop_matches_transformers(models):
    """Step 1: request 0's prefill; step 2: its decode with request 1's prefill (mixed);
    then decodes of both (absorbed)."""
    model, params, want = models
    caches = model.init_kv_caches(8)
    table = np.array([[0, 1], [2, 3]], np.int32)
    tokens = [list(p) for p in PROMPTS]
    done = [0, 0]  # tokens of each request already in the cache
    active = [0]
    for step in range(NEW_TOKENS + 1):
        if step == 1:
            active = [0, 1]
        query = [tokens[r][done[r] :] for r in active]
        md = build_common_attn_metadata([len(q) for q in query], [len(tokens[r]) for r in active], table[active], 16)
        ids = np.zeros(md.num_tokens, np.int32)
        pos = np.zeros(md.num_tokens, np.int32)
        flat = [t for q in query for t in q]
        ids[: len(flat)] = flat
        pos[: len(flat)] = [done[r] + i for r, q in zip(active, query, strict=True) for i in range(len(q))]
        last = np.cumsum([len(q) for q in query]).astype(np.int32) - 1
        logits, caches = model.step(params, caches, ids, pos, md, last)
        for r, row in zip(active, np.asarray(logits), strict=True):
            done[r] = len(tokens[r])
            if len(tokens[r]) - len(PROMPTS[r]) < NEW_TOKENS:
                tokens[r].append(int(row.argmax()))
    assert [t[len(p) :] for t, p in zip(tokens, PROMPTS, strict=True)] == want
    assert len({t for w in want for t in w}) > 3  # the random model does not repeat one token


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_engine_serves_it_with_transformers_tokens(models, num_scheduler_steps):
    model, params, want = models
    engine = Engine(
        model, params, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_blocks=8,
        buckets=MetadataBuckets((16,), (2,), (4,)), num_scheduler_steps=num_scheduler_steps,
    )  # fmt: skip
    builder = model.attn.metadata_builder
    advanced = []
    original = builder.advance_decode
    builder.advance_decode = lambda *a: advanced.append(1) or original(*a)  # traced once per multi-step compile
    try:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        del builder.advance_decode
    assert [c.output_ids for c in outputs] == want
    assert advanced  # traced for multi-step decodes and for a one-step call's next inputs (the decode chain)
    assert max(s.num_steps for s in engine.stats) == num_scheduler_steps


def test_mixture_of_experts_gives_transformers_tokens():
    """DeepSeek-V3's routed experts from layer 1 on: 8 experts in 4 groups, the 2 best groups
    kept, 2 experts a token, a random score-correction bias, one shared expert; greedy tokens
    through the engine equal transformers'."""
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=128, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    hf = _random_hf_model(config, seed=2)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    want = _hf_greedy(hf, NEW_TOKENS)
    ds = DeepSeekConfig.from_hf(config)
    assert (ds.is_moe_layer(0), ds.is_moe_layer(1)) == (False, True)
    engine = Engine(
        DeepSeekModel(ds, block_size=16), params_from_hf(hf), max_num_seqs=2, max_num_batched_tokens=16,
        max_model_len=64, num_blocks=8, buckets=MetadataBuckets((16,), (2,), (4,)),
    )  # fmt: skip
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [c.output_ids for c in outputs] == want


def test_route_picks_from_the_best_groups_with_the_bias_and_weights_by_the_scores():
    """One token, 4 experts in 2 groups of 2, 1 group kept, 1 expert: the bias decides the
    choice (expert 3 over expert 0), the weight is the unbiased score, normalised and scaled."""
    import jax.numpy as jnp

    from attn_jax.models.deepseek import route

    c = DeepSeekConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=1, kv_lora_rank=4,
                       qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, first_k_dense_replace=1,
                       n_routed_experts=4, num_experts_per_tok=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                       norm_topk_prob=False)  # fmt: skip
    router = np.diag([2.0, 0.0, 0.0, 1.0]).astype(np.float32)  # expert e scores token dims e
    x = jnp.ones((1, 4), jnp.float32)
    idx, weights = route(x, router, np.array([0.0, 0.0, 0.0, 0.5], np.float32), c)
    sigmoid = 1 / (1 + np.exp(-np.array([2.0, 0.0, 0.0, 1.0])))
    assert sigmoid[3] + 0.5 > sigmoid[0]  # the biased choice
    assert np.asarray(idx).tolist() == [[3]]
    np.testing.assert_allclose(np.asarray(weights), [[2.0 * sigmoid[3]]], rtol=1e-6)


@pytest.mark.slow
def test_engine_with_pallas_mla_gpu_kernels_gives_transformers_tokens():
    """The same through PALLAS_MLA_GPU (the Triton decode and prefill kernels; in the
    interpreter on a CPU, compiled on a GPU), on a config whose latent row splits into powers
    of two as the kernels need (kv_lora_rank 64 + rope 64, nope 32, v 32)."""
    from attn_jax.backends.mla_pallas import PallasMLAGPUBackend

    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, first_k_dense_replace=2, max_position_embeddings=128,
    )  # fmt: skip
    hf = _random_hf_model(config, seed=1)
    want = _hf_greedy(hf, 4)
    model = DeepSeekModel(DeepSeekConfig.from_hf(config), block_size=16, attn_backend=PallasMLAGPUBackend)
    engine = Engine(
        model, params_from_hf(hf), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_blocks=8,
        buckets=MetadataBuckets((16,), (2,), (4,)),
    )  # fmt: skip
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [c.output_ids for c in outputs] == want


@pytest.mark.slow
@pytest.mark.parametrize("models", [32], indirect=True, ids=["q_lora"])  # either q projection: the same shapes
def test_engine_warmup_compiles_every_shape_of_the_mla_model(models):
    """``Engine.warmup`` on a second model family (MLA caches): nothing compiles after it,
    and the tokens are still transformers'."""
    import jax

    model, params, want = models
    engine = Engine(
        model, params, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_blocks=8, num_scheduler_steps=4
    )
    report = engine.warmup()
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert report.num_shapes > 0 and compiles == []
    assert [c.output_ids for c in outputs] == want
