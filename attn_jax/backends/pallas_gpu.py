"""The Pallas GPU backend (Triton lowering): registered, not implemented yet."""

from __future__ import annotations

from attn_jax.backends.planned import PlannedBackend


class PallasGPUAttentionBackend(PlannedBackend):
    """Ragged paged attention as a Pallas kernel on GPU (Triton lowering); unavailable until it lands."""

    not_implemented = "the Pallas GPU kernel is not implemented yet; XLA serves every platform until it lands"

    @staticmethod
    def get_name() -> str:
        return "PALLAS_GPU"
