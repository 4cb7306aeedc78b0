"""attn-stack's attn_torch package: filled by the PyTorch bridge issue; nothing here yet."""
