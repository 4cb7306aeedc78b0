"""What the Pallas backends share: an impl that hands its builder's metadata to a kernel module.

``PallasKernelImpl`` keeps the layer's hyperparameters as the XLA impl does and calls
its ``op`` (a kernel module's ``ragged_paged_attention``) with them, the metadata's index arrays, schedule and
block sizes. Where its platform is absent it runs the kernel in the Pallas interpreter
(with a logged warning, once per impl).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from attn_jax.backends.xla import XLAAttentionImpl
from attn_jax.platforms import current_platform

logger = logging.getLogger(__name__)


class PallasKernelImpl(XLAAttentionImpl):
    """Base of the PALLAS_GPU / PALLAS_TPU impls; subclasses name their kernel and platform.

    ``interpret`` None: compiled on ``platform_kind``, the interpreter elsewhere.
    """

    backend_name: ClassVar[str]  # "PALLAS_GPU"
    platform_kind: ClassVar[str]  # the platform the kernel compiles for: "gpu" | "tpu"
    interpreter: ClassVar[str]  # how the fallback is named in the warning
    op: ClassVar[Callable]  # a kernel module's ragged_paged_attention(..., interpret, block_sizes, schedule)
    metadata_cls: ClassVar[type]  # what the backend's builder makes

    def __init__(self, *args, interpret: bool | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if interpret is None:
            platform = current_platform()
            interpret = platform.kind != self.platform_kind
            if interpret:
                logger.warning(
                    "%s runs in the %s on platform %s (no %s): correct but slow",
                    self.backend_name, self.interpreter, platform, self.platform_kind.upper(),
                )  # fmt: skip
        self.interpret = interpret

    def forward(self, query, key, value, kv_cache, attn_metadata, k_scale=None, v_scale=None, q_scale=None):
        if self.kv_sharing_target_layer_name is not None:
            key = value = None  # the target layer has written this cache already
        md = attn_metadata
        if not isinstance(md, self.metadata_cls):
            name, builder = self.metadata_cls.__name__, self.metadata_cls.__name__.replace("AttentionMetadata", "")
            raise TypeError(
                f"attn_metadata is {type(md).__name__}; {self.backend_name} needs {name} from "
                f"{builder}MetadataBuilder.build (the Attention layer builds it from CommonAttentionMetadata)"
            )
        fp8 = {} if q_scale is None else {"q_scale": q_scale}  # FP8 attention: the kernels' q_scale
        if getattr(md, "cascade_prefix_len", None) is not None:  # both parts on this kernel, its own blocks
            return self.cascade(
                query, key, value, kv_cache, md, self.op, k_scale, v_scale, interpret=self.interpret,
                **self.cascade_kwargs(md), **fp8,
            )  # fmt: skip
        return self.op(
            query, key, value, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping,
            sm_scale=self.scale, causal=self.attn_type.is_causal, sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
            k_scale=k_scale, v_scale=v_scale, interpret=self.interpret, block_sizes=md.block_sizes,
            schedule=md.schedule, **self.kernel_kwargs(md), **fp8,
        )  # fmt: skip

    def kernel_kwargs(self, md) -> dict:
        """Further keyword arguments for the kernel from the metadata (none by default)."""
        return {}

    def cascade_kwargs(self, md) -> dict:
        """Further keyword arguments for ``cascade_ragged_paged_attention`` from the metadata
        (none by default)."""
        return {}
