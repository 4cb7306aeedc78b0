"""The Pallas GPU backend (Triton lowering): registered, not implemented yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attn_jax.backends.base import AttentionBackend

if TYPE_CHECKING:
    from attn_jax.platforms import Platform

_NOT_IMPLEMENTED = "the Pallas GPU kernel is not implemented yet; XLA serves every platform until it lands"


class PallasGPUAttentionBackend(AttentionBackend):
    """Ragged paged attention as a Pallas kernel on GPU (Triton lowering); unavailable until it lands.

    The KV cache has XLA's shape, f[2, num_blocks, block_size, Hkv, D] (K then V, NHD
    pages), so a cache allocated for one backend serves the other.
    """

    @staticmethod
    def get_name() -> str:
        return "PALLAS_GPU"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(_NOT_IMPLEMENTED)

    @staticmethod
    def get_metadata_cls():
        raise NotImplementedError(_NOT_IMPLEMENTED)

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError(_NOT_IMPLEMENTED)

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2, 3, 4)

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return _NOT_IMPLEMENTED
