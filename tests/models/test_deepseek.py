"""The DeepSeek-shaped MLA decoder against transformers' DeepseekV3ForCausalLM with the same
random weights (tiny configs, dense MLPs and a mixture of experts): greedy tokens through a
plain prefill/mixed/decode loop and through the serving engine; DeepSeek-V2 / V3 checkpoint
folders written by ``save_pretrained`` through ``load_hf_checkpoint`` and ``attn-stack
generate`` (logits to 1e-4, greedy tokens), each router against transformers', and the
config values the loader refuses."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata  # noqa: E402
from attn_jax.models.deepseek import DeepSeekConfig, DeepSeekModel, params_from_hf  # noqa: E402
from attn_jax.models.hf_checkpoint import deepseek_config  # noqa: E402
from attn_jax.serving import Engine, SamplingParams  # noqa: E402
from attn_jax.testing.engine_probes import count_backend_compiles  # noqa: E402
from tests.models.test_hf_checkpoint import (  # noqa: E402
    PROMPT,
    VOCAB,
    _assert_prefill_logits_match,
    _write_checkpoint,
)

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
    config = deepseek_config(hf.config.to_dict())
    return DeepSeekModel(config, block_size=16), params_from_hf(hf, config), want


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
    ds = deepseek_config(config.to_dict())
    assert (ds.is_moe_layer(0), ds.is_moe_layer(1)) == (False, True)
    engine = Engine(
        DeepSeekModel(ds, block_size=16), params_from_hf(hf, ds), max_num_seqs=2, max_num_batched_tokens=16,
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
    model = DeepSeekModel(deepseek_config(config.to_dict()), block_size=16, attn_backend=PallasMLAGPUBackend)
    engine = Engine(
        model, params_from_hf(hf, model.config), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
        num_blocks=8, buckets=MetadataBuckets((16,), (2,), (4,)),
    )  # fmt: skip
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [c.output_ids for c in outputs] == want


@pytest.mark.slow
@pytest.mark.parametrize("models", [32], indirect=True, ids=["q_lora"])  # either q projection: the same shapes
def test_engine_warmup_compiles_every_shape_of_the_mla_model(models):
    """``Engine.warmup`` on a second model family (MLA caches): nothing compiles after it,
    and the tokens are still transformers'."""
    model, params, want = models
    engine = Engine(  # one slot, 8-token steps: 11 programs (2 x 16: 38), the 9-token prompt in two chunks
        model, params, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64, num_blocks=8, num_scheduler_steps=1
    )
    report = engine.warmup()
    with count_backend_compiles() as compiles:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert report.num_shapes > 0 and compiles == []
    assert [c.output_ids for c in outputs] == want


YARN = {  # DeepSeek's long-context RoPE (V2-Lite's mscale = mscale_all_dim: the softmax scale grows), 4x over 32
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
    "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
}  # fmt: skip
CHECKPOINT_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
    max_position_embeddings=128, bos_token_id=0, eos_token_id=1, rope_parameters=YARN,
)  # fmt: skip
CHECKPOINTS = {  # a dense layer, then 8 routed experts in 4 groups and a shared one (V3: a random router bias)
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(q_lora_rank=32)),
    "deepseek_v2": (  # V2-Lite's q_proj (no q LoRA), V2's group-limited softmax router
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, _write_checkpoint(request.param, folder, CHECKPOINTS, CHECKPOINT_SIZES)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from attn_jax.models.hf_checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(checkpoint[0], block_size=16)


def test_checkpoint_loads_onto_the_mla_model_with_transformers_logits(checkpoint, loaded):
    """The folder's model_type routes to DeepSeekModel on an MLA backend; every row's
    logits of a 20-token prefill (YaRN's frequencies and softmax scale) equal transformers'."""
    model, params, _ = loaded
    assert isinstance(model, DeepSeekModel) and model.attn_backend.get_name() == "XLA_MLA"
    assert model.config.rope_type == "yarn" and model.config.is_moe_layer(1) and not model.config.is_moe_layer(0)
    _assert_prefill_logits_match(loaded, checkpoint[1])


@pytest.mark.parametrize("checkpoint", ["deepseek_v2"], indirect=True)
def test_cli_generate_gives_transformers_greedy_tokens(checkpoint, capsys):
    """``attn-stack generate --model DIR`` on the DeepSeek-V2 folder (its softmax router, q_proj
    and YaRN through the engine; V3's routed experts through the engine:
    ``test_mixture_of_experts_gives_transformers_tokens``, from the same ``assemble_params``):
    the MLA backend chosen, transformers' greedy tokens."""
    import json

    from attn_jax.cli import main

    folder, hf = checkpoint
    args = ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "6", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    [result] = out["results"]
    ids = transformers.AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=1)
    want = want[0, len(ids) :].tolist()
    assert result["token_ids"] == want and len(set(want)) > 2
    assert out["backend"] in ("XLA_MLA", "PALLAS_MLA_GPU", "PALLAS_MLA_TPU") and out["max_model_len"] == 128


@pytest.mark.parametrize(
    "router_cls, config_cls, extra",
    [
        ("DeepseekV3TopkRouter", transformers.DeepseekV3Config, dict(n_group=4, topk_group=2, norm_topk_prob=True)),
        ("DeepseekV2TopkRouter", transformers.DeepseekV2Config, dict(topk_method="greedy")),
        (
            "DeepseekV2TopkRouter",
            transformers.DeepseekV2Config,
            dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
        ),
    ],
    ids=["v3-noaux_tc", "v2-greedy", "v2-group_limited_greedy"],
)
def test_route_matches_transformers_router(router_cls, config_cls, extra):
    """``route`` against transformers' router module on 32 random tokens: the same experts
    (as sets) with the same weights."""
    import importlib

    from attn_jax.models.deepseek import route

    hf_config = config_cls(
        hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.5,
        **extra,
    )  # fmt: skip
    module = importlib.import_module(f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}")
    torch.manual_seed(0)
    router = getattr(module, router_cls)(hf_config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.1 * torch.randn(8))
        x = torch.randn(32, 16)
        _, want_weights, want_idx = router(x)
    sizes = dict(vocab_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=4,
                 qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, first_k_dense_replace=0)  # fmt: skip
    c = deepseek_config({**hf_config.to_dict(), **sizes})
    bias = getattr(router, "e_score_correction_bias", None)
    idx, weights = route(x.numpy(), router.weight.detach().numpy(), None if bias is None else bias.numpy(), c)
    ours = [dict(zip(i, w, strict=True)) for i, w in zip(np.asarray(idx).tolist(), np.asarray(weights), strict=True)]
    theirs = [dict(zip(i, w, strict=True)) for i, w in zip(want_idx.tolist(), want_weights.numpy(), strict=True)]
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], rtol=1e-5)


DEFAULTED = (  # DeepSeekConfig fields whose config.json keys have transformers' defaults
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
    "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "routed_scaling_factor",
    "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_interleave",
)  # fmt: skip


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_defaults_of_absent_keys_are_transformers(tmp_path, model_type):
    """A config.json with only the sizes (and V2's experts per token, which has no default):
    every field the loader fills in is the one transformers' config class fills in."""
    import json

    from attn_jax.models.hf_checkpoint import read_hf_config

    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    sizes |= {"num_experts_per_tok": 6} if model_type == "deepseek_v2" else {}
    (tmp_path / "config.json").write_text(json.dumps({**sizes, "model_type": model_type}))
    ours = read_hf_config(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs.rope_theta = theirs.rope_parameters["rope_theta"]
    theirs.rope_interleave = getattr(theirs, "rope_interleave", True)  # V2 always rotates interleaved pairs
    assert {k: getattr(ours, k) for k in DEFAULTED} == {k: getattr(theirs, k) for k in DEFAULTED}
    routers = {"deepseek_v2": ("softmax", "greedy", 1, 1), "deepseek_v3": ("sigmoid", "noaux_tc", 8, 4)}
    assert (ours.scoring_func, ours.topk_method, ours.n_group, ours.topk_group) == routers[model_type]
    if model_type == "deepseek_v3":
        assert (ours.n_group, ours.topk_group) == (theirs.n_group, theirs.topk_group)


@pytest.mark.parametrize(
    "model_type, changes, message",
    [
        ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported for deepseek_v3; "
         r"supported: \['sigmoid'\]"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, r"topk_method='noaux_tc' is not supported for deepseek_v2; "
         r"supported: \['greedy', 'group_limited_greedy'\]"),
        ("deepseek_v2", {"norm_topk_prob": True}, r"norm_topk_prob=true is not supported for deepseek_v2"),
        ("deepseek_v2", {"rope_interleave": False}, r"rope_interleave=False is not supported for deepseek_v2; "
         r"supported: \[True\]"),
        ("deepseek_v3", {"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported; supported: \[1\]"),
        ("deepseek_v3", {"attention_bias": True}, r"attention_bias=true is not supported for DeepSeek"),
        ("deepseek_v3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
         r"rope_scaling type 'dynamic' is not supported by attn_jax; supported: \['default', 'linear', 'llama3', "
         r"'yarn'\]"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, r"quant_method='fp8'\) is not supported"),
        ("deepseek_v3", {"n_group": 3}, r"n_routed_experts=8 must split into n_group=3 equal groups"),
        ("deepseek_v3", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; supported: \['silu'\]"),
    ],
    ids=["v3-scoring", "v2-topk-method", "v2-norm-topk", "v2-interleave", "moe-freq", "attention-bias", "rope-type",
         "fp8", "groups", "hidden-act"],
)  # fmt: skip
def test_config_refusals_name_the_key(tmp_path, model_type, changes, message):
    import json

    from attn_jax.models.gguf_loader import ModelLoadError
    from attn_jax.models.hf_checkpoint import read_hf_config

    config = {**CHECKPOINT_SIZES, "model_type": model_type, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        read_hf_config(tmp_path)


def test_more_than_one_device_is_refused(checkpoint):
    import types

    from attn_jax.models.gguf_loader import ModelLoadError
    from attn_jax.models.hf_checkpoint import load_hf_checkpoint

    with pytest.raises(ModelLoadError, match=r"is a DeepSeek \(MLA\) model: it runs on one device; a mesh of 2"):
        load_hf_checkpoint(checkpoint[0], mesh=types.SimpleNamespace(size=2))
