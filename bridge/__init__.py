"""attn-stack's bridge package: filled by the PyTorch bridge issue; nothing here yet."""
