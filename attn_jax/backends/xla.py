"""The XLA backend: pure jnp on every platform, every feature.

Two ops: the chunked op (``ops/ragged_paged_attention/chunked.py``: fixed shapes, an
online softmax over KV chunks up to the batch's longest context; the serving path on the
CPU) for metadata built for a jitted step (``build_for_jit``), and the reference op
(``reference.py``, the specification) for ``build``'s metadata and for FP8 attention, which
only it computes. The metadata is the common metadata's arrays: nothing static but their
shapes, so a jitted step compiles once per (tokens, requests, table width).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.base import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, validate_kv_cache_dims
from attn_jax.metadata import CommonAttentionMetadata, make_local_attention_virtual_batches
from attn_jax.ops.ragged_paged_attention import chunked, reference
from attn_jax.ops.ragged_paged_attention.cascade import cascade_ragged_paged_attention
from attn_jax.ops.ragged_paged_attention.validate import is_concrete
from attn_jax.types import AttentionType, validate_cache_dtype

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class XLAAttentionMetadata:
    """What the XLA impl needs for one batch; every field but ``fixed_shapes`` is a pytree leaf.

    For chunked local attention, query_start_loc / seq_lens / block_tables describe the
    virtual batches (one per request and attention chunk) while slot_mapping stays the
    real one, since writes go to the real cache slots.
    """

    query_start_loc: Array  # i32[R + 1]
    seq_lens: Array  # i32[R]
    block_tables: Array  # i32[R, pages_per_req]
    slot_mapping: Array  # i32[T]
    # Cascade attention (``build(common_prefix_len > 0, ...)``): tokens of the prefix every
    # request shares, whole pages; the impl then reads it once for the batch.
    cascade_prefix_len: Array | None = None  # i32[]
    # Built for a jitted step of fixed shapes (``build_for_jit``, the engine's): the chunked op,
    # whose work follows the longest context. Else (``build``: a layer called on shapes that may
    # change every call, as the PyTorch bridge's) the reference op, which compiles in a third of
    # the chunked op's time (0.36 against 1.1 s for one layer on the CPU).
    fixed_shapes: bool = dataclasses.field(default=False, metadata=dict(static=True))


class XLAMetadataBuilder(AttentionMetadataBuilder[XLAAttentionMetadata]):
    """Builds ``XLAAttentionMetadata``; traceable unless the layer uses chunked attention.

    Chunked local attention splits requests into virtual batches on the host (NumPy), so
    its ``build`` needs concrete metadata and runs before ``jit``. The number of virtual
    batches is padded to the static bound ``2 * num_reqs + num_tokens // chunk`` so a
    jitted step sees one shape per bucket.
    """

    reads_live_pages_only = True  # the chunked op's KV loop stops at the batch's longest context
    supports_cascade = True
    """Whether ``build`` honours ``common_prefix_len`` (its impl has a kernel with LSE)."""

    CASCADE_MIN_PREFIX = 256
    """Fewest shared tokens for cascade attention (vLLM's 256)."""
    CASCADE_MIN_REQUESTS = 8
    """Fewest requests in the batch for cascade attention (vLLM's 8)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = common_attn_metadata
        chunk = self.kv_cache_spec.attention_chunk_size
        if chunk is None:
            return XLAAttentionMetadata(
                query_start_loc=md.query_start_loc,
                seq_lens=md.seq_lens,
                block_tables=md.block_table_tensor,
                slot_mapping=md.slot_mapping,
                cascade_prefix_len=self.cascade_prefix_len(common_prefix_len),
            )
        if common_prefix_len:
            raise ValueError(
                f"common_prefix_len={common_prefix_len}: cascade attention does not serve chunked local "
                f"attention (attention_chunk_size={chunk}); build with 0"
            )
        return self._build_local(md, chunk)

    def cascade_prefix_len(self, common_prefix_len: int):
        """i32[] tokens of whole pages of ``common_prefix_len`` for the metadata, or None (no cascade)."""
        if not common_prefix_len:
            return None
        if not self.supports_cascade:
            raise ValueError(
                f"common_prefix_len={common_prefix_len}: {type(self).__name__} has no cascade attention "
                "(use_cascade_attention says False); build with 0"
            )
        pages = int(common_prefix_len) // self.kv_cache_spec.block_size
        return np.int32(pages * self.kv_cache_spec.block_size) if pages else None

    @classmethod
    def cascade_summary(cls) -> str:
        if not cls.supports_cascade:
            return "never (this backend's kernel returns no log-sum-exp yet)"
        return (
            f"when the running batch shares >= {cls.CASCADE_MIN_PREFIX} tokens (whole pages held by every "
            f"request through the prefix cache, before all its new tokens) over >= {cls.CASCADE_MIN_REQUESTS} "
            "requests, without ALiBi, sliding window or chunked attention: the prefix is read once for the "
            "batch and merged by log-sum-exp (the engine's CascadeConfig may lower the thresholds)"
        )

    def use_cascade_attention(
        self, common_prefix_len, query_lens, num_query_heads, num_kv_heads, use_alibi, use_sliding_window, num_sms,
        *, min_prefix_len=None, min_requests=None, seq_lens=None, performance_model=True,
    ) -> bool:  # fmt: skip
        """vLLM's first tests: a shared prefix of at least ``CASCADE_MIN_PREFIX`` tokens over
        at least ``CASCADE_MIN_REQUESTS`` requests (or the thresholds given), no ALiBi, no
        sliding window, no chunked attention, and a builder whose kernel returns LSE. (vLLM
        then weighs cascade against flash-decoding's split-KV for decode batches; here
        cascade's saving, the prefix read once instead of once per request, is taken
        whenever these hold. ``seq_lens`` and ``performance_model`` are for builders with a
        model of their kernels' work, PALLAS_GPU's for float32; this rule has none.)"""
        del seq_lens, performance_model
        min_prefix_len = self.CASCADE_MIN_PREFIX if min_prefix_len is None else min_prefix_len
        min_requests = self.CASCADE_MIN_REQUESTS if min_requests is None else min_requests
        return (
            self.supports_cascade
            and common_prefix_len > 0
            and common_prefix_len >= min_prefix_len
            and len(query_lens) >= min_requests
            and not use_alibi
            and not use_sliding_window
            and self.kv_cache_spec.attention_chunk_size is None
        )

    def build_for_jit(self, common_attn_metadata, step_query_lens=None, common_prefix_len: int = 0):
        """``build``'s metadata marked for the chunked op (``fixed_shapes``)."""
        del step_query_lens  # the chunked op's shapes do not depend on the step's query lengths
        built = self.build(common_prefix_len, common_attn_metadata)
        return dataclasses.replace(built, fixed_shapes=True)

    @property
    def supports_decode_advance(self) -> bool:  # chunked local attention's virtual batches do not advance
        return self.kv_cache_spec.attention_chunk_size is None

    def advance_decode(self, metadata, steps, active):
        """Moves ``seq_lens`` and ``slot_mapping`` (the base class says what it takes)."""
        seq_lens = metadata.seq_lens + steps
        num_reqs, num_tokens = seq_lens.shape[0], metadata.slot_mapping.shape[0]
        rows = jnp.arange(num_tokens)
        req = jnp.minimum(rows, num_reqs - 1)
        position = jnp.maximum(seq_lens[req] - 1, 0)
        block_size = self.kv_cache_spec.block_size
        page = jnp.take_along_axis(metadata.block_tables[req], (position // block_size)[:, None], axis=1)[:, 0]
        write = (rows < num_reqs) & active[req] & (metadata.slot_mapping >= 0)
        slot_mapping = jnp.where(write, page * block_size + position % block_size, -1).astype(jnp.int32)
        return dataclasses.replace(metadata, seq_lens=seq_lens.astype(jnp.int32), slot_mapping=slot_mapping)

    def _build_local(self, md: CommonAttentionMetadata, chunk: int) -> XLAAttentionMetadata:
        host = (md.query_start_loc_cpu, md.seq_lens_cpu, md.block_table_tensor)
        if not is_concrete(*host):
            raise ValueError(
                f"attention_chunk_size={chunk}: chunked local attention builds virtual batches "
                "on the host; call the backend's builder outside jax.jit and pass the "
                "resulting XLAAttentionMetadata into the jitted step"
            )
        block_size = self.kv_cache_spec.block_size
        seqlens_q, cu_seqlens_q, seqlens_k, table = make_local_attention_virtual_batches(
            chunk, np.asarray(md.query_start_loc_cpu), np.asarray(md.seq_lens_cpu),
            np.asarray(md.block_table_tensor), block_size,
        )  # fmt: skip
        num_reqs, num_tokens = len(md.seq_lens_cpu), md.num_tokens
        padded = 2 * num_reqs + num_tokens // chunk
        num_virtual = len(seqlens_q)
        if num_virtual > padded:  # cannot happen for valid metadata; guards the bound above
            raise ValueError(f"{num_virtual=} virtual batches exceed the static bound {padded}")
        pad = padded - num_virtual
        cu = np.concatenate([cu_seqlens_q, np.full(pad, cu_seqlens_q[-1], np.int32)])
        lens_k = np.concatenate([seqlens_k, np.zeros(pad, np.int32)]).astype(np.int32)
        table = np.concatenate([np.asarray(table), np.zeros((pad, table.shape[1]), np.int32)])
        return XLAAttentionMetadata(
            query_start_loc=jnp.asarray(cu, jnp.int32),
            seq_lens=jnp.asarray(lens_k),
            block_tables=jnp.asarray(table, jnp.int32),
            slot_mapping=md.slot_mapping,
        )


class XLAAttentionImpl(AttentionImpl[XLAAttentionMetadata]):
    """Calls ``ragged_paged_attention`` with the layer's hyperparameters: the chunked op for
    ``build_for_jit``'s metadata, else (and for FP8 attention) the reference."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks=None,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = _per_head("alibi_slopes", alibi_slopes, num_heads)
        self.sliding_window = sliding_window
        self.kv_cache_dtype = validate_cache_dtype(kv_cache_dtype)
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = AttentionType.parse(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = _per_head("sinks", sinks, num_heads)

    def forward(self, query, key, value, kv_cache, attn_metadata, k_scale=None, v_scale=None, q_scale=None):
        """``q_scale`` (FP8 attention, the layer's ``query_quant``): the reference op serves
        every batch (the chunked op has no FP8 dots)."""
        if self.kv_sharing_target_layer_name is not None:
            key = value = None  # the target layer has written this cache already
        md = attn_metadata
        op, fp8 = reference.ragged_paged_attention, {}
        if q_scale is not None:
            fp8 = {"q_scale": q_scale}
        elif md.fixed_shapes:
            op = chunked.ragged_paged_attention
        if md.cascade_prefix_len is not None:
            return self.cascade(query, key, value, kv_cache, md, op, k_scale, v_scale, **fp8)
        return op(
            query, key, value, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables,
            md.slot_mapping, sm_scale=self.scale, causal=self.attn_type.is_causal,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=self.alibi_slopes, sinks=self.sinks, k_scale=k_scale, v_scale=v_scale, **fp8,
        )  # fmt: skip

    def cascade(self, query, key, value, kv_cache, md, op, k_scale, v_scale, **op_kwargs):
        """``cascade_ragged_paged_attention`` with this layer's hyperparameters, ``op`` for both parts."""
        return cascade_ragged_paged_attention(
            query, key, value, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.slot_mapping,
            prefix_len=md.cascade_prefix_len, sm_scale=self.scale, causal=self.attn_type.is_causal,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=self.alibi_slopes, sinks=self.sinks, k_scale=k_scale, v_scale=v_scale, op=op, **op_kwargs,
        )  # fmt: skip


def _per_head(name: str, values, num_heads: int):
    """f32[num_heads] from a per-head sequence or array; None stays None."""
    if values is None:
        return None
    arr = jnp.asarray(values, jnp.float32)
    if arr.shape != (num_heads,):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}; expected one value per query head: ({num_heads},)")
    return arr


class XLAAttentionBackend(AttentionBackend):
    """Pure jnp ragged paged attention; every feature, every platform; not the fastest."""

    supports_sink = True
    supports_quant_query_input = True  # FP8 attention through the reference op

    @staticmethod
    def get_name() -> str:
        return "XLA"

    @staticmethod
    def get_impl_cls() -> type[XLAAttentionImpl]:
        return XLAAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[XLAAttentionMetadata]:
        return XLAAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[XLAMetadataBuilder]:
        return XLAMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        validate_kv_cache_dims(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2, 3, 4)

    @staticmethod
    def get_required_kv_cache_layout() -> str | None:
        return "NHD"
