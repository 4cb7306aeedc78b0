"""Llama-family decoder models served through attn_jax's attention layer and paged cache."""
