"""Hugging Face checkpoint folders through attn-stack against transformers on the same weights.

Tiny random Llama (untied head, attention biases, linear RoPE scaling, sharded weights),
Mistral (an 8-token sliding window) and Qwen2 (q/k/v biases, tied embeddings) models are
written by transformers' ``save_pretrained`` with a small byte-level BPE tokenizer built by
``tokenizers``; the loader must give the same logits (1e-4, float32), the same greedy tokens
through ``Engine`` as ``generate(do_sample=False)``, the same tokenizer ids and chat prompts,
and an error naming the bad value for each broken folder.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from attn_jax import build_common_attn_metadata
from attn_jax.models.gguf_loader import ModelLoadError
from attn_jax.models.hf_checkpoint import (
    DEEPSEEK_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    HFTokenizer,
    load_hf_checkpoint,
    load_hf_weights,
    read_hf_config,
)
from attn_jax.serving import Engine, SamplingParams
from attn_jax.testing.models import unfused_layer
from tests.subprocess_env import subprocess_env

VOCAB = 320
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
MODELS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            attention_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "llama3": (  # Llama 3.1's RoPE with an 8x factor over a 32-token original context
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),  # fmt: skip
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(tie_word_embeddings=False, sliding_window=8, head_dim=16, rope_parameters={"rope_theta": 1e5}),
    ),
    "gemma2": (  # its first layer slides over 8 keys, the second is full; soft caps low enough to bite
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_theta": 1e4},
        ),  # fmt: skip
    ),
    "gemma3": (  # text only; two RoPEs: linear scaling on the full layer, its own theta on the sliding one
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        ),  # fmt: skip
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=False, head_dim=16, rope_parameters={"rope_theta": 1e6}),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}),
    ),
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["The capital of France is", "Hello world, hello there!", "<|im_start|>user\nhi<|im_end|>", " ünïcödé  x\n\n"]
PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"  # > 8 tokens: past the window
NEW_TOKENS = 12


def _save_tokenizer(folder, **settings) -> None:
    """A 320-token byte-level BPE (BOS added by its post-processor) with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([PROMPT * 3, "Hello world, hello there! " * 3, "abc def ghi jkl"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(folder)
    if settings:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))


def _randomise(model) -> None:
    """Weights whose greedy tokens vary (transformers' init gives zero biases, unit norms and
    a model that repeats one token): matrices ~ N(0, 1/fan_in) with the residual branches'
    outputs (o_proj, down_proj) x3 and the embeddings x0.3, norms ~ 1 + N(0, 0.01), biases
    (DeepSeek-V3's router score-correction buffers too) ~ N(0, 0.01)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                scale = 3.0 if "o_proj" in name or "down_proj" in name else 0.3 if "embed" in name else 1.0
                p.copy_(noise * scale * p.shape[-1] ** -0.5)


def _write_checkpoint(model_type: str, folder, models=MODELS, sizes=SIZES):
    """The transformers model (eval mode) of a tiny random ``model_type`` (a key of ``models``,
    built with ``sizes``), saved with a tokenizer in ``folder``."""
    config_cls, model_cls, extra = models[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**sizes, **extra)).eval()
    _randomise(model)
    model.save_pretrained(folder, max_shard_size="40KB" if model_type == "llama" else "100MB")
    _save_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model in eval mode) of one tiny random model type."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, _write_checkpoint(request.param, folder)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    folder, _ = checkpoint
    return load_hf_checkpoint(folder, block_size=16)


def test_config_matches_transformers(request, checkpoint, loaded):
    folder, hf = checkpoint
    model, params, tokenizer = loaded
    c, h = model.config, hf.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    rope = h.rope_parameters.get("full_attention", h.rope_parameters)  # Gemma 3 nests it by layer type
    assert c.rope_theta == rope["rope_theta"] and c.rms_norm_eps == h.rms_norm_eps
    assert c.tie_word_embeddings == h.tie_word_embeddings == ("lm_head" not in params)
    assert c.eos_token_ids == (1,) and c.bos_token_id == 0 and tokenizer.eos_token_id == 1
    expected = {
        "llama": dict(qkv_bias=True, o_bias=True, sliding_window=None, rope_scaling_factor=2.0),
        "llama3": dict(qkv_bias=False, o_bias=False, sliding_window=None, rope_type="llama3", rope_scaling_factor=8.0),
        "mistral": dict(qkv_bias=False, o_bias=False, sliding_window=8, rope_scaling_factor=1.0),
        "qwen2": dict(qkv_bias=True, o_bias=False, sliding_window=None, rope_scaling_factor=1.0),
        "qwen3": dict(qkv_bias=False, o_bias=False, sliding_window=None, qk_norm=True),
        "gemma2": dict(
            sliding_window=None,
            layer_sliding_windows=(8, None),
            attn_logit_softcap=3.0,
            final_logit_softcap=8.0,
            attn_scale=24**-0.5,
            embed_scale=8.0,
            hidden_act="gelu_pytorch_tanh",
            qk_norm=False,
            sandwich_norms=True,
        ),
        "gemma3": dict(
            sliding_window=None,
            layer_sliding_windows=(8, None),
            attn_logit_softcap=None,
            final_logit_softcap=None,
            qk_norm=True,
            rope_type="linear",
            rope_scaling_factor=2.0,
            local_rope_theta=1e3,
        ),
    }[request.node.callspec.params["checkpoint"]]
    assert {k: getattr(c, k) for k in expected} == expected
    windows = expected.get("layer_sliding_windows") or (expected["sliding_window"],) * 2
    assert tuple(a.sliding_window for a in model.layer_attns) == windows
    if request.node.callspec.params["checkpoint"] == "llama":  # the sharded path: an index and several files
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2


def test_logits_match_transformers(checkpoint, loaded):
    """One prefill over 20 tokens (past Mistral's 8-token window): every row's logits."""
    _, hf = checkpoint
    _assert_prefill_logits_match(loaded, hf)


def _assert_prefill_logits_match(loaded, hf, num_tokens: int = 20) -> None:
    """Every row's logits of one prefill of ``num_tokens`` random ids, ours (``loaded``:
    ``load_hf_checkpoint``'s triple) against transformers' model ``hf`` (1e-4)."""
    model, params, _ = loaded
    ids = np.random.default_rng(1).integers(2, VOCAB, num_tokens)
    n = len(ids)
    pages = -(-n // 16)
    md = build_common_attn_metadata([n], [n], [list(range(pages))], block_size=16)
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:n] = ids
    positions = np.zeros(md.num_tokens, np.int32)
    positions[:n] = np.arange(n)
    caches = model.init_kv_caches(pages)
    logits, _ = model.step(params, caches, tokens, positions, md, np.arange(n, dtype=np.int32))
    with torch.no_grad():
        want = hf(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4)
    assert np.ptp(want, axis=-1).min() > 1, "the random weights should spread the logits"


def test_greedy_tokens_match_transformers_generate(checkpoint, loaded):
    """The engine (prefill in chunks of 16 tokens, pages of 16) against ``generate(do_sample=False)``."""
    folder, hf = checkpoint
    model, params, tokenizer = loaded
    engine = Engine(model, params, tokenizer, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    prompt_ids = engine.encode(PROMPT)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert prompt_ids == hf_tokenizer(PROMPT)["input_ids"] and len(prompt_ids) > 16
    [done] = engine.generate([prompt_ids], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=1
        )
    want = out[0, len(prompt_ids) :].tolist()
    assert len(want) == NEW_TOKENS and done.output_ids == want
    assert len(set(want)) > 3, "the random weights should not repeat one token"
    assert done.text == hf_tokenizer.decode(want, skip_special_tokens=True)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_CONFIGS = {  # config.json RoPE keys -> what transformers 5 computes from them
    "none": {},
    "top-level-theta": {"rope_theta": 5e5},
    "linear-old-keys": {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3": {"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 32, "rope_theta": 5e5}},
    "llama3-default-original": {"rope_theta": 5e5, "rope_scaling": LLAMA3_ROPE},
    # both keys: a non-empty rope_scaling replaces rope_parameters whole, rope_theta included
    "both-keys": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 32},
    },
    "both-keys-top-theta": {
        "rope_theta": 3e5,
        "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5e5},
        "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 32},
    },
    "null-rope-scaling": {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 3.0}},
    "empty-rope-scaling": {"rope_scaling": {}, "rope_parameters": {"rope_type": "linear", "factor": 3.0}},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "yarn-betas-untruncated": {
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    },
    "yarn-mscale": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}},
    "yarn-attention-factor": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}},
}


@pytest.mark.parametrize("rope", ROPE_CONFIGS.values(), ids=ROPE_CONFIGS.keys())
def test_rope_reads_as_transformers(tmp_path, rope):
    """Every RoPE key that applies, with transformers' precedence: the inverse frequencies
    and cos/sin scale of ``llama.rope_frequencies`` equal those of transformers'
    ``LlamaRotaryEmbedding`` built from the same config.json."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from attn_jax.models.llama import rope_frequencies

    _write_config(tmp_path, **rope)
    ours = read_hf_config(tmp_path)
    theirs = LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(tmp_path))
    inv_freq, scale = rope_frequencies(ours)
    assert ours.rope_type == theirs.rope_type
    np.testing.assert_allclose(inv_freq, theirs.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(theirs.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if t not in DEEPSEEK_MODEL_TYPES])
def test_defaults_of_absent_keys_are_transformers(tmp_path, model_type):  # DeepSeek's: tests/models/test_deepseek.py
    """A config.json with only the sizes: every default the loader fills in (head_dim, tied
    embeddings, eps, RoPE theta, windows, Gemma's soft caps and query scalar) is the one
    transformers' config class fills in."""
    sizes = {k: v for k, v in SIZES.items() if k not in ("bos_token_id", "eos_token_id")}
    (tmp_path / "config.json").write_text(json.dumps({**sizes, "model_type": model_type}))
    ours = read_hf_config(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = theirs.rope_parameters.get("full_attention", theirs.rope_parameters)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert (ours.tie_word_embeddings, ours.rms_norm_eps, ours.rope_theta) == (
        theirs.tie_word_embeddings, theirs.rms_norm_eps, rope["rope_theta"]
    )  # fmt: skip
    if model_type == "mistral":  # no layer_types: every layer uses sliding_window
        windows = (theirs.sliding_window,) * 2
    else:
        types = getattr(theirs, "layer_types", None) or ["full_attention"] * 2
        windows = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in types)
    assert (ours.layer_sliding_windows or (ours.sliding_window,) * 2) == windows
    if model_type.startswith("gemma"):
        assert (ours.attn_logit_softcap, ours.final_logit_softcap, ours.attn_scale) == (
            theirs.attn_logit_softcapping, theirs.final_logit_softcapping, theirs.query_pre_attn_scalar**-0.5
        )  # fmt: skip
        assert ours.hidden_act == theirs.hidden_activation


HUB_STYLE_CONFIGS = {  # config.json as older checkpoints on the Hub write it (no layer_types, no rope_parameters)
    "gemma3-1b": dict(
        model_type="gemma3_text", num_hidden_layers=7, sliding_window=16, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling=None, sliding_window_pattern=3, head_dim=16, query_pre_attn_scalar=16,
    ),
    "gemma3-4b-text": dict(
        model_type="gemma3_text", num_hidden_layers=6, sliding_window=16, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, head_dim=16, query_pre_attn_scalar=16,
    ),
    "gemma2": dict(model_type="gemma2", num_hidden_layers=4, sliding_window=16, head_dim=16, rope_theta=1e4),
    "qwen2-window-layers": dict(
        model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    ),
}  # fmt: skip


@pytest.mark.parametrize("config", HUB_STYLE_CONFIGS.values(), ids=HUB_STYLE_CONFIGS.keys())
def test_layer_windows_and_ropes_read_as_transformers(tmp_path, config):
    """Each layer's window (from transformers' layer_types defaults) and each layer kind's
    RoPE (Gemma 3: rope_theta / rope_scaling for full layers, rope_local_base_freq for
    sliding ones) equal transformers' reading of the same config.json."""
    from attn_jax.models.llama import LlamaModel

    _write_config(tmp_path, **config)
    ours = LlamaModel(read_hf_config(tmp_path))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    windows = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types)
    assert tuple(a.sliding_window for a in ours.layer_attns) == windows and len(set(windows)) == 2
    if config["model_type"] == "gemma3_text":
        rope = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(theirs)
        local_inv_freq, full_inv_freq = rope.sliding_attention_inv_freq, rope.full_attention_inv_freq
        np.testing.assert_allclose(ours.local_inv_freq, local_inv_freq.numpy(), rtol=1e-6)
        np.testing.assert_allclose(ours.inv_freq, full_inv_freq.numpy(), rtol=1e-6)


def test_rope_scaling_beside_rope_parameters_matches_transformers(tmp_path):
    """The issue's silent case: transformers 5's ``rope_parameters`` of type default beside a
    llama3 ``rope_scaling``. transformers honours the scaling; so does the loader (the
    logits differ from the unscaled model's by far more than the tolerance)."""
    _write_checkpoint("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config["rope_scaling"] = {**LLAMA3_ROPE, "original_max_position_embeddings": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded[0].config.rope_type == "llama3"
    _assert_prefill_logits_match(loaded, hf, num_tokens=40)


@pytest.mark.parametrize(
    "settings", [{}, {"add_bos_token": False, "add_eos_token": True}], ids=["plain", "add-flags-ignored"]
)
def test_tokenizer_matches_transformers(tmp_path, settings):
    """tokenizer.json's post-processor (BOS) decides, as in transformers, whatever
    tokenizer_config.json's add_bos_token / add_eos_token say."""
    _save_tokenizer(tmp_path, **settings)
    ours = HFTokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[0] == 0, text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    for prompt in (False, True):
        text = ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == theirs.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
        )
    assert (ours.add_bos_token, ours.add_eos_token) == (True, False) and repr(ours).startswith("HFTokenizer(")


@pytest.mark.parametrize("bos, eos", [(False, False), (True, False), (True, True)])
def test_tokenizer_without_post_processor_follows_add_bos_and_eos(tmp_path, bos, eos):
    _save_tokenizer(tmp_path, add_bos_token=bos, add_eos_token=eos)
    file = tmp_path / "tokenizer.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "post_processor": None}))
    tok = HFTokenizer.from_pretrained(tmp_path)
    plain = tok.encode(TEXTS[0], add_special_tokens=False)
    assert tok.encode(TEXTS[0]) == [0] * bos + plain + [1] * eos
    assert (tok.add_bos_token, tok.add_eos_token) == (bos, eos)


@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_load_exactly(tmp_path, torch_dtype):
    """bf16 / f16 safetensors: float32 params equal transformers' weights upcast; the
    ``dtype`` argument keeps them in bfloat16."""
    torch.manual_seed(0)
    config_cls, model_cls, extra = MODELS["qwen2"]
    model = model_cls(config_cls(**SIZES, **extra)).to(torch_dtype)
    _randomise(model)
    model.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    config, params = load_hf_weights(tmp_path)
    attn, layer = model.model.layers[1].self_attn, unfused_layer(config, params["layers"][1])
    for ours, theirs in ((layer["wq"], attn.q_proj.weight.T), (layer["bk"], attn.k_proj.bias)):
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, theirs.detach().float().numpy())
    _, bf16_params, _ = load_hf_checkpoint(tmp_path, dtype="bfloat16")
    assert bf16_params["embed"].dtype.name == "bfloat16"


def _write_config(folder, **changes) -> None:
    config = {**SIZES, "model_type": "llama", **changes}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model_type": "gpt2"},
            r"model_type='gpt2' is not supported; supported: "
            r"\['llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text', 'deepseek_v2', 'deepseek_v3'\]",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 5e5}},
            r"rope_parameters type 'dynamic' is not supported .*; supported: \['default', 'linear', 'llama3', 'yarn'\]",
        ),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, r"rope_scaling type 'longrope' is not supported"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
            r"rope_scaling of type 'llama3' lacks \['high_freq_factor'\]",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 2]}},
            r"rope_parameters has keys \['mrope_section'\] that attn_jax does not read for rope_type 'linear'",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling of type 'linear' needs a factor"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 4}},
            r"quantization_config \(quant_method='awq'\) is not supported",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; supported: \['silu'\]"),
        ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
        ({"num_key_value_heads": 3}, r"num_heads=4 must be divisible by num_kv_heads=3"),
        ({"hidden_size": 0}, r"hidden_size=0 must be a positive integer"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention"]},
            r"layer_types=\['sliding_attention', 'chunked_attention'\] must list one of \['full_attention', "
            r"'sliding_attention'\] for each of 2 layers",
        ),
        ({"model_type": "gemma2", "use_bidirectional_attention": True}, r"use_bidirectional_attention=true is not"),
        ({"model_type": "gemma2", "hidden_activation": "relu"}, r"hidden_activation='relu' is not supported"),
        ({"model_type": "gemma2", "final_logit_softcapping": -1}, r"final_logit_softcapping=-1 must be a positive"),
        (
            {"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            r"rope_parameters=.*: a Gemma 3 config nests them by layer type, \['full_attention', 'sliding_attention'\]",
        ),
        (
            {
                "model_type": "gemma3_text",
                "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2}},
            },
            r"rope_parameters sliding_attention=.* is not supported: attn_jax reads a default RoPE",
        ),
    ],
    ids=[
        "model_type",
        "dynamic-rope",
        "longrope",
        "llama3-missing-key",
        "rope-unknown-key",
        "rope-no-factor",
        "partial-rotary",
        "quantized",
        "hidden_act",
        "mlp_bias",
        "heads",
        "hidden_size",
        "layer-types",
        "gemma-bidirectional",
        "gemma-act",
        "gemma-cap",
        "gemma3-flat-rope",
        "gemma3-local-rope",
    ],
)
def test_config_errors_name_the_value(tmp_path, changes, message):
    _write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        read_hf_config(tmp_path)
    assert SUPPORTED_MODEL_TYPES == (
        "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3"
    )  # fmt: skip


def test_folder_errors(tmp_path):
    with pytest.raises(ModelLoadError, match=r"checkpoint folder '.*nope' does not exist"):
        read_hf_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"has no config.json: a Hugging Face checkpoint folder holds"):
        read_hf_config(tmp_path)
    _write_config(tmp_path)
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors weights"):
        load_hf_weights(tmp_path)
    with pytest.raises(ModelLoadError, match=r"has no tokenizer.json"):
        HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; supported: \['float32', 'bfloat16'"):
        load_hf_checkpoint(tmp_path, dtype="int8")


@pytest.fixture(scope="module")
def qwen2_tensors(tmp_path_factory):
    """(folder, tensors) of a tiny Qwen2 checkpoint in one file, to damage copies of."""
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    config_cls, model_cls, extra = MODELS["qwen2"]
    folder = tmp_path_factory.mktemp("qwen2-single")
    model_cls(config_cls(**SIZES, **extra)).save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
            r"has no tensor 'model.layers.1.self_attn.k_proj.bias'",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}),
            r"tensor 'model.norm.weight' has shape \(65,\); config.json implies \(64,\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.bias": np.ones(128, np.float32)}),
            r"1 tensors the model would not use, e.g. \['model.layers.0.mlp.up_proj.bias'\]",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.ones(64, np.int8)}),
            r"tensor 'model.norm.weight' has dtype I8; supported: \['F32', 'F16', 'BF16'\]",
        ),
        (
            lambda t: t["model.layers.1.mlp.down_proj.weight"].__setitem__((3, 5), np.nan),
            r"tensor 'model.layers.1.mlp.down_proj.weight' of '.*' holds non-finite values \(1 NaN, 0 infinite of "
            r"8192\): the checkpoint is damaged \(check_finite=False skips this check\)",
        ),
        (
            lambda t: t["model.embed_tokens.weight"].__setitem__((0, slice(0, 2)), [np.inf, -np.inf]),
            r"tensor 'model.embed_tokens.weight' of '.*' holds non-finite values \(0 NaN, 2 infinite of 20480\)",
        ),
    ],
    ids=["missing", "shape", "unused", "dtype", "nan", "inf"],
)
def test_tensor_errors_name_the_tensor(tmp_path, qwen2_tensors, damage, message):
    from safetensors.numpy import save_file

    folder, tensors = qwen2_tensors
    tensors = {name: t.copy() for name, t in tensors.items()}
    damage(tensors)
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_hf_weights(tmp_path)
    if "non-finite" in message:  # the check can be skipped (a huge checkpoint known to be good)
        _, params = load_hf_weights(tmp_path, check_finite=False)
        assert not all(np.isfinite(np.asarray(w)).all() for w in jax.tree.leaves(params))


BROKEN_TEMPLATES = {  # template -> the error's message after the source
    "{% for m in messages %}{{ m['content'] }}": r"does not compile: Unexpected end of template.* \(line 1\)",
    "{{ bos_token }}\n{{ messages | nope }}": r"does not compile: No filter named 'nope'. \(line 2\)",
}


def _save_tokenizer_with_template(folder, template: str, where: str = "tokenizer_config.json") -> None:
    """``_save_tokenizer`` with ``template`` in ``chat_template.jinja`` (where save_pretrained
    writes it) or, that file removed, in ``tokenizer_config.json``'s ``chat_template``."""
    _save_tokenizer(folder)
    if where == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        (folder / "chat_template.jinja").unlink()
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize("template", BROKEN_TEMPLATES, ids=["unclosed-for", "unknown-filter"])
def test_broken_chat_template_is_named_at_load(tmp_path, where, template):
    """The template compiles when the tokenizer loads; its error names the file and key."""
    _save_tokenizer_with_template(tmp_path, template, where)
    if where == "chat_template.jinja":
        source = r"'.*chat_template\.jinja'"
    else:
        source = r"'.*tokenizer_config\.json' chat_template"
    with pytest.raises(ModelLoadError, match=rf"the chat template in {source} {BROKEN_TEMPLATES[template]}"):
        HFTokenizer.from_pretrained(tmp_path)


def test_chat_template_render_error_names_the_template(tmp_path):
    """A template that compiles but raises on the messages: a ValueError naming its source."""
    _save_tokenizer_with_template(tmp_path, "{{ raise_exception('roles must alternate') }}")
    tok = HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"the chat template \('.*tokenizer_config.json' chat_template\) failed on "
                       r"these messages: roles must alternate"):  # fmt: skip
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_cli_generate_chat_with_a_broken_template_exits_2(qwen2_tensors, tmp_path, capsys):
    """``generate --chat``: one line naming the file and key, exit code 2, before the weights load."""
    from attn_jax.cli import main

    folder, _ = qwen2_tensors
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    _save_tokenizer_with_template(tmp_path, "{% if messages %}{{ messages[0]['content'] }}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer_config.json' chat_template does not compile" in err, err


@pytest.mark.slow  # the CLI's engine compiles its step (about 6 s on 2 busy cores)
def test_cli_generate_takes_a_checkpoint_folder(tmp_path, capsys):
    """``attn-stack generate --model DIR --chat``: the chat template, the engine and the
    greedy tokens of transformers on the same prompt; max_model_len defaults to the
    checkpoint's 128 positions."""
    from attn_jax.cli import main

    config_cls, model_cls, extra = MODELS["qwen2"]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SIZES, **extra)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    prompt = "Hello world"
    args = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--chat", "--max-new-tokens", "6", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    [result] = out["results"]
    assert out["max_model_len"] == SIZES["max_position_embeddings"] == 128
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, pad_token_id=1)
    want = out[0, len(ids) :].tolist()
    assert result["num_prompt_tokens"] == len(ids) and result["token_ids"] == want and 1 not in want
    assert result["finish_reason"] == "length"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "256"], r"max_model_len=256 exceeds the model's context length 128"),
        (["--max-model-len", "64", "--max-new-tokens", "64"], r"no room for a prompt: --max-model-len 64"),
        (["--max-new-tokens", "128"], r"no room for a prompt: max_model_len=128 \(the model's context length"),
        (["--max-model-len", "16", "--max-new-tokens", "8"], r"--prompt number 1 has \d+ tokens: .*max_model_len=16"),
    ],
    ids=["past-context", "no-room", "no-room-default", "prompt-too-long"],
)
def test_cli_generate_max_model_len_errors(qwen2_tensors, tmp_path, capsys, flags, message):
    """``generate --max-model-len``: one line and exit code 2 before anything compiles."""
    import re

    from attn_jax.cli import main

    folder, _ = qwen2_tensors
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    _save_tokenizer(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", PROMPT, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_cli_reports_a_bad_checkpoint_folder(tmp_path, capsys):
    from attn_jax.cli import main

    _write_config(tmp_path, model_type="gpt2")
    assert main(["generate", "--model", str(tmp_path), "--max-new-tokens", "2"]) == 2
    assert (
        "model_type='gpt2' is not supported; supported: ['llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', "
        "'gemma3_text', 'deepseek_v2', 'deepseek_v3']" in capsys.readouterr().err
    )


_SHARDED = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
from attn_jax.models.hf_checkpoint import load_hf_checkpoint
from attn_jax.serving import Engine, SamplingParams
from attn_jax.sharding import make_mesh
mesh = make_mesh(2, model_parallel=2)
model, params, tokenizer = load_hf_checkpoint(sys.argv[1], mesh=mesh)
engine = Engine(model, params, tokenizer, mesh=mesh, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
[done] = engine.generate([sys.argv[2]], SamplingParams(max_new_tokens=int(sys.argv[3]), ignore_eos=True))
print("RESULT", json.dumps({"tokens": done.output_ids, "split": [model.attn_sharded, model.mlp_sharded]}))
"""


@pytest.mark.slow  # a subprocess with 2 forced CPU devices: jax starts and compiles again
@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_heads_split_over_two_devices_with_biases(tmp_path, model_type):
    """Llama with q/k/v/o biases, heads and MLP split over a model axis of 2: the bias of
    each head goes with it, the output bias is added once after the sum, and the tokens
    are transformers' greedy ones. Gemma 3: the q/k norms (shared by every head), the norms
    after attention and MLP (after the sums) and the per-layer windows, split the same way."""
    hf = _write_checkpoint(model_type, tmp_path)
    env = subprocess_env()
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED, str(tmp_path), PROMPT, str(NEW_TOKENS)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    prompt_ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=1
        )
    assert result == {"tokens": out[0, len(prompt_ids) :].tolist(), "split": [True, True]}
