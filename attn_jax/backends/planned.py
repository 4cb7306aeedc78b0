"""Backends whose kernels have not landed: registered, selectable by name, never usable."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from attn_jax.backends.xla import XLAAttentionBackend

if TYPE_CHECKING:
    from attn_jax.platforms import Platform


class PlannedBackend(XLAAttentionBackend):
    """A backend that reports ``not_implemented`` as its reason on every platform.

    It shares XLA's KV-cache shape, f[2, num_blocks, block_size, Hkv, D], so the
    selector and ``attn-stack info`` can describe it; asking it for an impl, metadata
    or builder raises NotImplementedError with the same reason.
    """

    not_implemented: ClassVar[str]
    supports_sink = False  # claims nothing beyond the basics until a kernel exists

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return cls.not_implemented

    @classmethod
    def _refuse(cls):
        raise NotImplementedError(cls.not_implemented)

    get_impl_cls = get_metadata_cls = get_builder_cls = _refuse
