"""The backend interface: AttentionBackend, AttentionImpl, AttentionMetadataBuilder.

Mirrors vLLM's ``AttentionBackend`` / ``AttentionImpl`` / ``AttentionMetadataBuilder``.
A backend declares what it supports as class attributes; ``validate_configuration``
turns them into a list of human-readable reasons it cannot serve a request (empty when
it can), which the selector shows to the user.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from attn_jax.types import (
    ACTIVATION_DTYPES,
    CACHE_DTYPES,
    AttentionType,
    cache_storage_dtype,
    validate_cache_dtype,
    validate_positive_int,
)

if TYPE_CHECKING:
    from attn_jax.metadata import CommonAttentionMetadata
    from attn_jax.platforms import Platform


FP8_QUERY_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""The cache dtypes FP8 attention (``query_quant``) runs against: its dots take e4m3 on both sides."""


def validate_kv_cache_dims(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str) -> None:
    """ValueError naming the first cache dimension that is not a positive int, or a bad cache dtype."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        validate_positive_int(name, value)
    validate_cache_dtype(cache_dtype_str)


def describe_sizes(sizes) -> str:
    """``[64, 128]``, or "multiples of 8 up to 256" for a long run of multiples of its first."""
    sizes = list(sizes)
    if len(sizes) > 4 and sizes == list(range(sizes[0], sizes[-1] + 1, sizes[0])):
        return f"multiples of {sizes[0]} up to {sizes[-1]}"
    return str(sizes)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One layer configuration: the arguments of ``validate_configuration`` (and, normalised,
    of one ``get_attn_backend`` call: the selector's request); hashable."""

    head_size: int
    dtype: np.dtype
    kv_cache_dtype: str
    block_size: int
    use_mla: bool
    has_sink: bool
    use_sparse: bool
    attn_type: AttentionType | str
    query_quant: bool = False

    def __str__(self) -> str:
        return (
            f"head_size={self.head_size}, dtype={self.dtype}, kv_cache_dtype={self.kv_cache_dtype!r}, "
            f"block_size={self.block_size}, use_mla={self.use_mla}, has_sink={self.has_sink}, "
            f"use_sparse={self.use_sparse}, attn_type={str(self.attn_type)!r}"
            + (", query_quant=True" if self.query_quant else "")
        )


class AttentionBackend(abc.ABC):
    """Abstract attention backend: a bundle of impl, metadata and builder classes."""

    accept_output_buffer: ClassVar[bool] = False
    supports_quant_query_input: ClassVar[bool] = False

    supported_dtypes: ClassVar[tuple[np.dtype, ...]] = ACTIVATION_DTYPES
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = CACHE_DTYPES
    supports_sink: ClassVar[bool] = False
    supports_mla: ClassVar[bool] = False
    supports_sparse: ClassVar[bool] = False
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = tuple(AttentionType)

    @staticmethod
    @abc.abstractmethod
    def get_name() -> str:
        """The backend's registry name, e.g. "XLA"."""

    @staticmethod
    @abc.abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abc.abstractmethod
    def get_metadata_cls() -> type: ...

    @staticmethod
    @abc.abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abc.abstractmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """Logical shape of one layer's KV cache."""

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Permutation from the logical cache shape to the stored one (identity here)."""
        raise NotImplementedError

    @staticmethod
    def get_required_kv_cache_layout() -> str | None:
        """ "NHD" or "HND" if the backend needs that layout, None if it takes either."""
        return None

    @staticmethod
    def write_to_kv_cache(kv_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
        """Writes key/value f[T, Hkv, D] at flat slots i32[T] (-1: skipped) into this backend's cache
        layout; returns the cache (in place under jit with the cache donated)."""
        from attn_jax.kv_cache import write_to_kv_cache

        return write_to_kv_cache(kv_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def make_metadata(cls, *args, **kwargs):
        return cls.get_metadata_cls()(*args, **kwargs)

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...] | None:
        """Head sizes the backend supports; None means any positive size."""
        return None

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...] | None:
        """Block (page) sizes the backend supports; None means any positive size."""
        return None

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        """Why the backend cannot run on ``platform`` at all, or None if it can."""
        return None

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """A subclass's own reasons beyond the capability flags ``validate_configuration`` checks
        (a kernel's shape limits, a device's missing units); [] by default."""
        return []

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype,
        kv_cache_dtype: str,
        block_size: int,
        use_mla: bool = False,
        has_sink: bool = False,
        use_sparse: bool = False,
        attn_type: str = AttentionType.DECODER,
        platform: Platform | None = None,
        query_quant: bool = False,
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration; [] if it can.

        ``query_quant`` (FP8 attention, vLLM's ``Attention.query_quant``): the query quantised
        to e4m3 for fp8 x fp8 dots; needs ``supports_quant_query_input`` and an e4m3 cache."""
        reasons: list[str] = []
        if platform is not None and (why := cls.unavailable_reason(platform)) is not None:
            reasons.append(why)
        head_sizes = cls.get_supported_head_sizes()
        if head_sizes is not None and head_size not in head_sizes:
            reasons.append(f"head_size={head_size} is not supported; supported: {describe_sizes(head_sizes)}")
        block_sizes = cls.get_supported_block_sizes()
        if block_sizes is not None and block_size not in block_sizes:
            reasons.append(f"block_size={block_size} is not supported; supported: {list(block_sizes)}")
        if np.dtype(dtype) not in cls.supported_dtypes:
            valid = [str(d) for d in cls.supported_dtypes]
            reasons.append(f"dtype={np.dtype(dtype)} is not supported; supported: {valid}")
        if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported; supported: {list(cls.supported_kv_cache_dtypes)}"
            )
        if use_mla and not cls.supports_mla:
            reasons.append("MLA is not supported")
        if has_sink and not cls.supports_sink:
            reasons.append("attention sinks are not supported")
        if use_sparse and not cls.supports_sparse:
            reasons.append("sparse attention is not supported")
        if attn_type not in cls.supported_attn_types:
            valid = [t.value for t in cls.supported_attn_types]
            reasons.append(f"attn_type={str(attn_type)!r} is not supported; supported: {valid}")
        if query_quant:
            if not cls.supports_quant_query_input:
                reasons.append("FP8 attention (query_quant=True) is not supported")
            if kv_cache_dtype not in FP8_QUERY_CACHE_DTYPES:
                reasons.append(
                    f"query_quant=True with kv_cache_dtype={kv_cache_dtype!r}: FP8 attention needs an e4m3 cache, "
                    f"kv_cache_dtype one of {list(FP8_QUERY_CACHE_DTYPES)}"
                )
        config = AttentionConfig(head_size, np.dtype(dtype), kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                                 attn_type, query_quant)  # fmt: skip
        return reasons + cls.backend_reasons(config, platform)

    @classmethod
    def kv_cache_dtype_for(cls, cache_dtype_str: str, model_dtype) -> np.dtype:
        """The dtype of the array ``init``-ed for this backend's cache."""
        return cache_storage_dtype(validate_cache_dtype(cache_dtype_str), model_dtype)


class AttentionImpl[M](abc.ABC):
    """Per-layer attention computation; holds the layer's static hyperparameters."""

    @abc.abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: Any = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: Any = None,
    ) -> None: ...

    @abc.abstractmethod
    def forward(self, query, key, value, kv_cache, attn_metadata: M, k_scale=None, v_scale=None, q_scale=None):
        """Writes new k/v into the cache and attends. Returns (output, kv_cache).

        query f[T, Hq, D]; key, value f[T, Hkv, D] (None for KV-sharing layers);
        output has query's dtype and shape. ``q_scale`` f32[] (FP8 attention, backends with
        ``supports_quant_query_input``; an e4m3 cache): the query enters the dots as e4m3.
        """


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a metadata builder needs to know about the layers it serves."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    num_q_heads: int | None = None  # lets a builder size q-blocks for the head group; None: unknown
    cache_dtype: Any = None  # what the cache stores (fp8 for a quantized cache); None: ``dtype``
    query_quant: bool = False  # FP8 attention: the layers quantise their query to e4m3 (q_scale)


class AttentionMetadataBuilder[M](abc.ABC):
    """Turns the per-batch ``CommonAttentionMetadata`` into a backend's metadata."""

    reads_live_pages_only: ClassVar[bool] = False
    """Whether the backend's kernels read only the pages a request's context covers, so a
    block table padded to the engine's longest context costs no device work: the serving
    engine then fixes the table's width at ``max_model_len``'s pages (one program for every
    context length). False (PALLAS_TPU, whose block sizes follow the width): the engine
    buckets the width by powers of two."""

    def __init__(self, kv_cache_spec: AttentionSpec) -> None:
        self.kv_cache_spec = kv_cache_spec

    @abc.abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        """Central method that builds attention metadata for one batch."""

    def build_for_jit(
        self, common_attn_metadata: CommonAttentionMetadata, step_query_lens=None, common_prefix_len: int = 0
    ) -> M:
        """Metadata with static shapes for tracing a jitted step (vLLM's CUDA-graph capture).

        ``step_query_lens`` (i32[N], optional): the query lengths of the whole step when it
        runs several data shards, each built separately. A backend makes its static choices
        (block sizes, schedule widths) from them instead of from this batch alone, so every
        shard's metadata has one structure; default: this batch's own.
        ``common_prefix_len``: as ``build``'s (tokens every request shares, for cascade
        attention; 0: none), given only when ``use_cascade_attention`` said yes.
        """
        return self.build(common_prefix_len=common_prefix_len, common_attn_metadata=common_attn_metadata)

    @property
    def supports_decode_advance(self) -> bool:
        """Whether ``advance_decode`` serves this builder's metadata (the engine's multi-step
        decoding); a builder that says True implements ``advance_decode``."""
        return False

    def advance_decode(self, metadata: M, steps, active) -> M:
        """A decode batch's metadata ``steps`` tokens later, traced (multi-step decoding).

        ``metadata`` (``build_for_jit``'s) describes one new token per request: token row
        r is request r, rows past the requests are padding. ``steps`` i32[R]: tokens each
        request has advanced since (its block table already holds their pages); ``active``
        bool[R]: requests whose new token is written (the others' rows get slot -1).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support multi-step decoding")

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: np.ndarray,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        num_sms: int,
        *,
        min_prefix_len: int | None = None,
        min_requests: int | None = None,
        seq_lens: np.ndarray | None = None,
        performance_model: bool = True,
    ) -> bool:
        """Whether cascade attention pays for a batch whose requests share
        ``common_prefix_len`` tokens (vLLM's heuristic; ``query_lens`` i32[R]).
        ``min_prefix_len`` / ``min_requests`` replace a builder's own thresholds (tests,
        benchmarks); ``seq_lens`` i32[R] (each request's keys in the step, optional) serves a
        builder whose rule weighs the work of both paths, and ``performance_model=False``
        leaves such a rule out (the thresholds alone decide: benchmarks, correctness tests).
        A builder without cascade attention says False."""
        return False

    @classmethod
    def cascade_summary(cls) -> str:
        """When this builder runs cascade attention, in words (``attn-stack info``)."""
        return "never (this backend's builder has no cascade attention)"

    def reorder_batch(self, input_batch, scheduler_output) -> bool:
        """Reorders the batch if the backend wants to; returns whether it did."""
        return False
