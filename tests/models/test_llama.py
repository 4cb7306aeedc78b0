"""The JAX Llama on the embedded SmolLM2 GGUF: configuration, weights, tokenizer and logits
against stock transformers on the same file, and clear errors for bad model files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attn_jax import build_common_attn_metadata
from attn_jax.models.gguf_loader import (
    WEIGHTS_CACHE_ENV,
    ModelLoadError,
    _unpermute,
    _weights_cache_file,
    load_gguf,
    load_tokenizer,
    read_config,
)
from attn_jax.models.llama import LlamaConfig, LlamaModel
from attn_jax.models.smollm2 import GGUF_NAME, gguf_path
from attn_jax.testing.models import unfused_layer


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_gguf(smollm2_gguf)


def test_gguf_path_finds_the_embedded_model(smollm2_gguf):
    assert smollm2_gguf == gguf_path() and smollm2_gguf.name == GGUF_NAME and smollm2_gguf.is_file()


def test_config_matches_transformers(smollm2, hf_smollm2):
    config, params = smollm2
    hf = hf_smollm2[0].config
    assert config.num_layers == hf.num_hidden_layers == 30
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
    )  # fmt: skip
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.tie_word_embeddings and hf.tie_word_embeddings and "lm_head" not in params
    assert config.vocab_size == hf.vocab_size and config.eos_token_ids == (2,)


def test_weights_equal_transformers_dequantised_weights(smollm2, hf_smollm2):
    """The same dequantisation and the same q/k un-permutation: bit-identical weights."""
    config, params = smollm2
    hf = hf_smollm2[0].model
    np.testing.assert_array_equal(params["embed"], hf.embed_tokens.weight.detach().numpy())
    for i in (0, 29):
        attn, mlp = hf.layers[i].self_attn, hf.layers[i].mlp
        ours = unfused_layer(config, params["layers"][i])
        modules = dict(wq=attn.q_proj, wk=attn.k_proj, wv=attn.v_proj, wo=attn.o_proj, w_gate=mlp.gate_proj)
        modules.update(w_up=mlp.up_proj, w_down=mlp.down_proj)
        for name, module in modules.items():
            np.testing.assert_array_equal(ours[name], module.weight.detach().numpy().T, err_msg=name)
        norms = (hf.layers[i].input_layernorm, hf.layers[i].post_attention_layernorm)
        np.testing.assert_array_equal(params["layer_norms"][i], np.stack([n.weight.detach().numpy() for n in norms]))


def test_unpermute_inverts_llama_cpp_permutation():
    heads, dim = 3, 8
    w = np.arange(heads * dim * 5, dtype=np.float32).reshape(heads * dim, 5)
    permuted = w.reshape(heads, 2, dim // 2, 5).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's permute
    np.testing.assert_array_equal(_unpermute(permuted, heads), w)


def test_prefill_logits_match_transformers(smollm2, hf_smollm2):
    config, params = smollm2
    model_hf, tokenizer = hf_smollm2
    ids = tokenizer("The capital of France is")["input_ids"]
    n = len(ids)
    model = LlamaModel(config, block_size=16)
    md = build_common_attn_metadata([n], [n], [[0]], block_size=16)
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:n] = ids
    positions = np.zeros(md.num_tokens, np.int32)
    positions[:n] = np.arange(n)
    fast = model.attn.metadata_builder.build_for_jit(md)
    step = jax.jit(model.step)
    logits, _ = step(params, model.init_kv_caches(2), tokens, positions, fast, np.arange(n, dtype=np.int32))
    with torch.no_grad():
        want = model_hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-3, atol=1e-3)
    assert (np.asarray(logits).argmax(-1) == want.argmax(-1)).all()


def test_model_file_errors(tmp_path, smollm2_gguf):
    with pytest.raises(ModelLoadError, match=r"model file '.*nope\.gguf' does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="is not a file"):
        load_gguf(tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match=r"is not a GGUF file: it starts with b'hell', not b'GGUF'"):
        load_gguf(text)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf.read_bytes()[: 1 << 20])
    with pytest.raises(ModelLoadError, match="is a corrupt or truncated GGUF file"):
        load_gguf(truncated)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.gguf")


def test_non_finite_weight_is_named(smollm2_gguf, monkeypatch):
    """A NaN in a dequantised tensor stops the load naming it (the first tensor read: the embedding)."""
    import gguf

    dequantize = gguf.dequantize

    def poisoned(data, kind):
        w = np.array(dequantize(data, kind), np.float32)
        w.flat[7] = np.nan
        return w

    monkeypatch.setattr(gguf, "dequantize", poisoned)
    monkeypatch.delenv(WEIGHTS_CACHE_ENV, raising=False)  # the session's cache holds the clean weights
    with pytest.raises(ModelLoadError, match=r"tensor 'token_embd.weight' of '.*' holds non-finite values \(1 NaN, 0"):
        load_gguf(smollm2_gguf)


def test_weights_cache_is_read_back_and_a_damaged_entry_read_again(tmp_path, monkeypatch, caplog):
    """With ``WEIGHTS_CACHE_ENV`` set, ``load_gguf`` returns a file's cached weights, telling
    ``progress`` the reads the real load told; an unreadable entry is logged and the GGUF read
    again (here a text file, so its error shows the file was read)."""
    import pickle

    monkeypatch.setenv(WEIGHTS_CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_text("hello, not a model")
    entry = _weights_cache_file(model, np.float32)
    entry.parent.mkdir()
    entry.write_bytes(pickle.dumps(("config", {"embed": np.ones(2)}, (2, 3))))
    calls = []
    config, params = load_gguf(model, progress=lambda done, total: calls.append((done, total)))
    assert config == "config" and params["embed"].tolist() == [1.0, 1.0] and calls == [(1, 3), (2, 3)]
    assert _weights_cache_file(model, np.float16) != entry  # one entry per dtype
    entry.write_bytes(b"damaged")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_gguf(model)
    assert "unreadable" in caplog.text


def test_config_checks():
    sizes = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1)
    with pytest.raises(ValueError, match="num_heads=9 must be divisible by num_kv_heads=2"):
        LlamaConfig(**sizes, num_heads=9, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="head_dim=3 must be even"):
        LlamaConfig(**sizes, num_heads=2, num_kv_heads=2, head_dim=3)


def test_read_config_rejects_other_architectures():
    class Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    class Reader:
        fields = {"general.architecture": Field("mamba")}
        tensors = []

    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'mamba' is not supported; supported: \['llama'\]"):
        read_config(Reader())


def test_builtin_config_equals_the_ggufs(smollm2):
    from attn_jax.models.smollm2 import smollm2_135m_config

    assert smollm2_135m_config() == smollm2[0]


def test_gguf_weights_in_bfloat16_are_the_float32_ones_rounded(smollm2, smollm2_gguf):
    """``load_gguf(dtype=bfloat16)`` (``--dtype auto`` on an accelerator): every weight equals
    the float32 load rounded to bfloat16."""
    _, params = smollm2
    _, half = load_gguf(smollm2_gguf, dtype=jnp.bfloat16)
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(half), strict=True))
    for want, got in pairs:
        assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))
