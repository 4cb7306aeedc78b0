"""The Pallas TPU backend (Mosaic TPU kernel): registered, not implemented yet."""

from __future__ import annotations

from attn_jax.backends.planned import PlannedBackend


class PallasTPUAttentionBackend(PlannedBackend):
    """Ragged paged attention as a Pallas kernel on Mosaic TPU; unavailable until it lands."""

    not_implemented = "the Pallas TPU kernel is not implemented yet; XLA serves every platform until it lands"

    @staticmethod
    def get_name() -> str:
        return "PALLAS_TPU"
