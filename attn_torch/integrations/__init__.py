"""Integrations of attn_torch with other libraries (Hugging Face transformers)."""
