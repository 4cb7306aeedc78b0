"""Greedy continuations from stock transformers, the ground truth of the engine tests."""

from __future__ import annotations

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Here is a list of the planets of the solar system, in order from the sun: Mercury, Venus, "
    "Earth, Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them is",
]
"""Short prompts and one longer than the tests' 32-token step budget (chunked prefill)."""

LONG_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within",
    "To bake a simple loaf of bread you need flour, water, salt and yeast. First, mix the flour "
    "and the salt in a large bowl, then dissolve the yeast in warm water and",
    "A binary search finds an item in a sorted list by repeatedly halving the part of the list "
    "that could contain it. Here is an implementation in Python:\\n\\ndef binary_search(items, target):",
]
"""Three prompts of 30+ tokens: with 16 new tokens each they need more pages than the tests' cache."""


def hf_greedy(model, tokenizer, prompt: str | list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (text, or token ids as given) alone (no
    padding): up to and including EOS, or exactly ``max_new_tokens`` with ``ignore_eos``."""
    ids = tokenizer(prompt, return_tensors="pt") if isinstance(prompt, str) else {"input_ids": torch.tensor([prompt])}
    eos = dict(eos_token_id=None, pad_token_id=tokenizer.pad_token_id) if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, **eos)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def left_padded(tokenizer, prompts: list[str]):
    """``prompts`` tokenised as one left-padded batch (input_ids, attention_mask), whatever
    the tokenizer's own padding side is (it is restored)."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side


def hf_greedy_batch(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of ``prompts`` in one left-padded batch, EOS
    ignored (exactly ``max_new_tokens`` each): one ``generate`` call instead of one per
    prompt. (Padding does not change the greedy tokens of these prompts: the CPU benchmark
    and the per-prompt EOS test check the same model unpadded.)"""
    batch = left_padded(tokenizer, prompts)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return out[:, batch["input_ids"].shape[1] :].tolist()
