"""Tests of attn_torch."""
