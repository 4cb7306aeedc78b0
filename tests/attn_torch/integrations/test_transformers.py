"""SmolLM2-135M-Instruct (the embedded GGUF) through attn-stack: greedy tokens match stock transformers."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from attn_torch.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PAGED_ATTN_IMPLEMENTATION,
    _left_padding,
    attn_stack_paged_attention_forward,
    use_attn_stack,
)
from tests.serving.hf_reference import left_padded

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 16
SMALL_CACHE = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
"""A 16-block paged cache: the default sizes it from free memory, too much on a shared machine."""


@pytest.fixture(scope="module")
def padded_prompts(hf_smollm2):
    """The prompts as one left-padded batch (input_ids, attention_mask)."""
    _, tokenizer = hf_smollm2
    enc = left_padded(tokenizer, PROMPTS)
    assert (enc["attention_mask"] == 0).any(), "the prompts must need padding"
    return enc


@pytest.fixture(scope="module")
def stock_tokens(hf_smollm2, padded_prompts):
    """Stock transformers' greedy continuations (its default attention, one padded batch)."""
    model, tokenizer = hf_smollm2
    assert model.config._attn_implementation not in (ATTN_IMPLEMENTATION, PAGED_ATTN_IMPLEMENTATION)
    out = model.generate(
        **padded_prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return out[:, padded_prompts["input_ids"].shape[1] :].tolist()


def test_generate_batch_over_the_paged_cache_matches(hf_smollm2, stock_tokens, caplog):
    """Also: no "eos_token_id not set" warning, and the caller's config is left as it was."""
    model, tokenizer = hf_smollm2
    original = model.config._attn_implementation
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    inputs = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with use_attn_stack(model, paged=True):
        assert model.config._attn_implementation == PAGED_ATTN_IMPLEMENTATION
        with caplog.at_level(logging.WARNING):
            results = model.generate_batch(
                inputs=inputs, generation_config=config, continuous_batching_config=SMALL_CACHE
            )
    assert "eos_token_id" not in caplog.text and config.eos_token_id is None
    assert model.config._attn_implementation == original
    assert "init_continuous_batching" not in vars(model), "the block's CUDA-graph guard must be removed on exit"
    ours = [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    assert ours == stock_tokens
    layers = [m._attn_stack_layers for m in model.modules() if "_attn_stack_layers" in m.__dict__]
    assert len(layers) == model.config.num_hidden_layers
    assert all(layer.attn_backend.get_name() == "XLA" for d in layers for layer in d.values())


def test_generate_left_padded_batch_matches(hf_smollm2, padded_prompts, stock_tokens):
    """Plain generate on a left-padded batch; 6 tokens (the 16-token match is generate_batch's test)."""
    model, tokenizer = hf_smollm2
    with use_attn_stack(model):
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        out = model.generate(**padded_prompts, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out[:, padded_prompts["input_ids"].shape[1] :].tolist() == [t[:6] for t in stock_tokens]


def test_right_padding_mask_is_refused():
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[0, 0, :, 2] = False  # the last key is padding: right padding
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0, \d, \d\]=\w+ is not causal with left padding"):
        _left_padding(mask, 1, 3, 3)


def test_paged_implementation_needs_the_paged_cache():
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="needs its paged cache; use 'attn_stack'"):
        attn_stack_paged_attention_forward(module, q, q, q, None)


def test_paged_block_refuses_cuda_graphs(hf_smollm2):
    """Host code runs every step: a config asking for CUDA graphs is refused, not silently dropped."""
    model, _ = hf_smollm2
    with (
        use_attn_stack(model, paged=True),
        pytest.raises(ValueError, match=r"use_cuda_graph=True, but 'attn_stack_flash_varlen' .* leave it None or"),
    ):
        model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=True))
    assert "init_continuous_batching" not in vars(model)


def test_attn_implementation_by_name_after_import():
    """Importing the integration registers "attn_stack": from_config / from_pretrained take it by name."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ATTN_IMPLEMENTATION).eval()
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    stock.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == ATTN_IMPLEMENTATION
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)
    assert any("_attn_stack_layers" in m.__dict__ for m in ours.modules()), "attn-stack served the attention"
