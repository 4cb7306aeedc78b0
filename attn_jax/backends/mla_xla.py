"""The XLA_MLA backend: multi-head latent attention in pure jnp (the reference ops), every platform.

What every MLA backend shares lives here too (vLLM's ``MLACommonBackend`` /
``MLACommonMetadata`` / ``MLACommonImpl`` idea): the latent cache ``[P, S, C + R]`` (one row
per token, no heads: ``num_kv_heads`` is 1 and ``head_size`` is ``kv_lora_rank +
qk_rope_head_dim``, e.g. 576), the metadata split into decodes and prefills, and the impl
that writes new latents, runs the decodes absorbed (``q_nope @ W_UK``, MQA over the latent,
``@ W_UV``) and the prefills up-projected (``ops/mla/dense.py``: each prefill request's
latents up-projected once). A Pallas MLA backend swaps in its decode kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.base import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    AttentionMetadataBuilder,
    validate_kv_cache_dims,
)
from attn_jax.ops.mla import reference, sparse_reference
from attn_jax.ops.mla.dense import mla_prefill_dense
from attn_jax.ops.mla.validate import is_concrete
from attn_jax.platforms import Platform
from attn_jax.types import AttentionType, validate_cache_dtype

Array = Any


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


MLA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
"""Cache dtypes the MLA backends serve; an fp8 latent cache stores latent / k_scale."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class MLAMetadata:
    """One batch split into decodes (one new token: absorbed) and prefills (up-projected).

    Requests need not be ordered: each part names the token rows it owns. Decode arrays
    have one entry per request slot of the batch (padding: row T, seq_len 0) or none when
    the batch has no decode; the prefill part is the batch's prefill requests compacted into
    the power of two >= their count of slots (padding slots: no tokens), its rows padded with
    T to the batch's token count, or empty when there is no prefill. So shapes, and the jit
    key, depend only on the bucket, on which parts are present, the prefill slots and
    ``prefill_q_block`` (powers of two), never on the decode count.
    """

    slot_mapping: Array  # i32[T]: where each new latent goes (-1: not written)
    query_start_loc: Array  # i32[R + 1]: the whole batch (the sparse path attends every row absorbed)
    seq_lens: Array  # i32[R]
    block_tables: Array  # i32[R, pages_per_req]
    decode_rows: Array  # i32[Rd]: token row of each decode (T = padding)
    decode_seq_lens: Array  # i32[Rd]
    decode_block_tables: Array  # i32[Rd, pages_per_req]
    prefill_rows: Array  # i32[Tp]: token rows of the prefills, request by request (T = padding)
    prefill_query_start_loc: Array  # i32[Rp + 1] over prefill_rows
    prefill_seq_lens: Array  # i32[Rp]
    prefill_block_tables: Array  # i32[Rp, pages_per_req]
    num_decodes: Array  # i32[]: decodes of the batch (data, not part of the jit key)
    num_prefills: Array  # i32[]
    has_decodes: bool = dataclasses.field(metadata=dict(static=True))  # the part's shapes exist
    has_prefills: bool = dataclasses.field(metadata=dict(static=True))
    prefill_q_block: int = dataclasses.field(default=0, metadata=dict(static=True))
    """Query rows per prefill request block (``dense.mla_prefill_dense``): the power of two
    >= the longest prefill; 0 without prefills."""
    prefill_rows_in_order: bool = dataclasses.field(default=False, metadata=dict(static=True))
    """No decodes and ``prefill_rows`` is 0, 1, ... then padding: the prefill part reads the
    query and writes the output in place, no gather and no scatter of the batch's rows."""


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Builds ``MLAMetadata`` on the host (NumPy): the split needs concrete metadata, so call
    it outside ``jax.jit`` and pass the result into the jitted step (the engine does)."""

    reorder_batch_threshold: ClassVar[int] = 1
    """A request with at most this many new tokens runs as a decode (absorbed)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> MLAMetadata:
        md = common_attn_metadata
        if not is_concrete(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_table_tensor):
            raise ValueError(
                "MLAMetadataBuilder.build splits decodes from prefills on the host: pass concrete (NumPy) "
                "CommonAttentionMetadata, outside jax.jit, and the resulting MLAMetadata into the jitted step"
            )
        qsl = np.asarray(md.query_start_loc_cpu, np.int32)
        lens = np.asarray(md.seq_lens_cpu, np.int32)
        table = np.asarray(md.block_table_tensor, np.int32)
        num_tokens, num_reqs = md.num_tokens, len(lens)
        qlens = np.diff(qsl)
        decodes = np.flatnonzero((qlens >= 1) & (qlens <= self.reorder_batch_threshold))
        prefills = np.flatnonzero(qlens > self.reorder_batch_threshold)

        nd = num_reqs if decodes.size else 0
        decode_rows = np.full(nd, num_tokens, np.int32)
        decode_lens = np.zeros(nd, np.int32)
        decode_table = np.zeros((nd, table.shape[1]), np.int32)
        decode_rows[: decodes.size] = qsl[decodes]
        decode_lens[: decodes.size] = lens[decodes]
        decode_table[: decodes.size] = table[decodes]

        # Prefill slots: the power of two >= the prefill count (each slot's context is gathered and
        # up-projected whole, so empty slots are not free); few shapes, as the XLA backend's prefill group.
        npf = min(next_pow2(int(prefills.size)), num_reqs) if prefills.size else 0
        rows = [np.arange(qsl[r], qsl[r + 1], dtype=np.int32) for r in prefills]
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        prefill_rows = np.full(num_tokens if prefills.size else 0, num_tokens, np.int32)
        prefill_rows[: flat.size] = flat
        prefill_qsl = np.full(npf + 1, flat.size, np.int32)
        prefill_qsl[: prefills.size + 1] = np.concatenate([[0], np.cumsum(qlens[prefills])]) if npf else 0
        prefill_lens = np.zeros(npf, np.int32)
        prefill_table = np.zeros((npf, table.shape[1]), np.int32)
        prefill_lens[: prefills.size] = lens[prefills]
        prefill_table[: prefills.size] = table[prefills]
        return MLAMetadata(
            slot_mapping=md.slot_mapping, query_start_loc=qsl, seq_lens=lens, block_tables=table,
            decode_rows=decode_rows, decode_seq_lens=decode_lens,
            decode_block_tables=decode_table, prefill_rows=prefill_rows, prefill_query_start_loc=prefill_qsl,
            prefill_seq_lens=prefill_lens, prefill_block_tables=prefill_table,
            num_decodes=np.int32(decodes.size), num_prefills=np.int32(prefills.size),
            has_decodes=bool(decodes.size), has_prefills=bool(prefills.size),
            prefill_q_block=next_pow2(int(qlens[prefills].max())) if prefills.size else 0,
            prefill_rows_in_order=bool(prefills.size and not decodes.size
                                       and (flat == np.arange(flat.size)).all()),
        )  # fmt: skip

    def build_for_jit(self, common_attn_metadata, step_query_lens=None, common_prefix_len=0) -> MLAMetadata:
        """``build``: its shapes already depend only on the bucket and the parts present.
        No cascade attention (``use_cascade_attention`` says False): a shared prefix is refused."""
        if common_prefix_len:
            raise ValueError(
                f"common_prefix_len={common_prefix_len}: {type(self).__name__} has no cascade attention; build with 0"
            )
        return self.build(0, common_attn_metadata)

    @property
    def supports_decode_advance(self) -> bool:
        return True

    def advance_decode(self, metadata: MLAMetadata, steps, active) -> MLAMetadata:
        """A decode batch ``steps`` i32[R] tokens later (the engine's multi-step decoding): every
        request of such a batch is a decode, so decode entry r is request r and token row r."""
        seq_lens = metadata.seq_lens + steps
        num_reqs, num_tokens = seq_lens.shape[0], metadata.slot_mapping.shape[0]
        rows = jnp.arange(num_tokens)
        req = jnp.minimum(rows, num_reqs - 1)
        position = jnp.maximum(seq_lens[req] - 1, 0)
        block_size = self.kv_cache_spec.block_size
        page = jnp.take_along_axis(metadata.block_tables[req], (position // block_size)[:, None], axis=1)[:, 0]
        write = (rows < num_reqs) & active[req] & (metadata.slot_mapping >= 0)
        slot_mapping = jnp.where(write, page * block_size + position % block_size, -1).astype(jnp.int32)
        nd = metadata.decode_seq_lens.shape[0]
        decode_lens = jnp.where(metadata.decode_seq_lens > 0, metadata.decode_seq_lens + steps[:nd], 0)
        return dataclasses.replace(
            metadata, seq_lens=seq_lens.astype(jnp.int32), slot_mapping=slot_mapping,
            decode_seq_lens=decode_lens.astype(jnp.int32),
        )  # fmt: skip


class XLAMLAImpl(AttentionImpl[MLAMetadata]):
    """MLA forward (vLLM's ``MLACommonImpl``): write latents, absorbed decodes, up-projected prefills.

    ``forward(q, kv_c_normed, k_pe, kv_cache, attn_metadata, *, w_uk, w_uv)``: q f[T, H, nope + R],
    kv_c_normed f[T, C], k_pe f[T, R] (both None for a layer that shares another's cache),
    w_uk f[C, H, nope], w_uv f[C, H, Dv]; returns (out f[T, H, Dv], kv_cache).

    ``prefill_context_chunk``: contexts longer than this many tokens are prefilled a chunk at
    a time (``ops/mla/dense.py``: vLLM's chunked-context prefill), bounding the up-projected
    keys and values and the scores to one chunk's.
    """

    prefill_context_chunk: ClassVar[int] = 8192

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = 1,
        alibi_slopes=None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks=None,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
    ) -> None:
        for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap), ("sinks", sinks)):  # fmt: skip
            if value is not None:
                raise NotImplementedError(f"{name}={value!r}: MLA backends support none of alibi_slopes, "
                                          "sliding_window, logits_soft_cap, sinks (valid: None)")  # fmt: skip
        if num_kv_heads not in (None, 1):
            raise ValueError(f"num_kv_heads={num_kv_heads}: an MLA cache has one latent row per token (valid: 1)")
        if head_size != kv_lora_rank + qk_rope_head_dim:
            raise ValueError(
                f"head_size={head_size} must be kv_lora_rank + qk_rope_head_dim = {kv_lora_rank} + "
                f"{qk_rope_head_dim} = {kv_lora_rank + qk_rope_head_dim} (the latent cache row)"
            )
        self.attn_type = AttentionType.parse(attn_type)
        if self.attn_type is not AttentionType.DECODER:
            raise NotImplementedError(f"attn_type={self.attn_type.value!r}: MLA is decoder-only (valid: 'decoder')")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.kv_lora_rank, self.qk_nope_head_dim = kv_lora_rank, qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = qk_rope_head_dim, v_head_dim
        self.kv_cache_dtype = validate_cache_dtype(kv_cache_dtype)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def write_latents(self, kv_cache, kv_c, k_pe, slot_mapping, k_scale=None):
        """Each new token's ``[kv_c | k_pe]`` into its slot (an XLA scatter); overridden by kernels."""
        return reference.write_latent_cache(kv_cache, kv_c, k_pe, slot_mapping, kv_lora_rank=self.kv_lora_rank,
                                            k_scale=k_scale)  # fmt: skip

    def decode(self, q_abs, kv_cache, seq_lens, block_tables, k_scale=None):
        """Absorbed decode op: q_abs f[Rd, H, C + R] -> f[Rd, H, C]; overridden by the kernels."""
        return reference.mla_decode(q_abs, kv_cache, seq_lens, block_tables, sm_scale=self.scale,
                                    kv_lora_rank=self.kv_lora_rank, k_scale=k_scale)  # fmt: skip

    def prefill(self, q, kv_cache, w_uk, w_uv, md, k_scale=None):
        """Up-projected prefill of the compacted prefill rows q f[Tp, H, nope + R] -> f[Tp, H, Dv]."""
        return mla_prefill_dense(
            q, kv_cache, w_uk, w_uv, md.prefill_query_start_loc, md.prefill_seq_lens, md.prefill_block_tables,
            sm_scale=self.scale, kv_lora_rank=self.kv_lora_rank, q_block=md.prefill_q_block, k_scale=k_scale,
            context_chunk=self._context_chunk(kv_cache, md.prefill_block_tables),
        )  # fmt: skip

    def _context_chunk(self, kv_cache, block_tables) -> int | None:
        """``prefill_context_chunk`` rounded down to whole pages, or None when the block table
        (its static width) holds no more than that."""
        page = kv_cache.shape[1]
        if block_tables.shape[1] * page <= self.prefill_context_chunk:
            return None
        return max(self.prefill_context_chunk // page, 1) * page

    def sparse(self, q_abs, kv_cache, topk_positions, md, k_scale=None):
        """Sparse absorbed op over every row: q_abs f[T, H, C + R] -> f[T, H, C]; overridden by kernels."""
        return sparse_reference.sparse_mla(
            q_abs, kv_cache, topk_positions, md.query_start_loc, md.seq_lens, md.block_tables,
            sm_scale=self.scale, kv_lora_rank=self.kv_lora_rank, k_scale=k_scale,
        )  # fmt: skip

    def forward(self, query, key, value, kv_cache, attn_metadata, k_scale=None, v_scale=None, *, w_uk, w_uv,
                topk_positions=None):  # fmt: skip
        """``topk_positions`` i32[T, topk] (sparse MLA, -1 = padding): every row attends, absorbed,
        to its listed positions only; None: dense MLA (decodes absorbed, prefills up-projected)."""
        md = attn_metadata
        if not isinstance(md, MLAMetadata):
            raise TypeError(
                f"attn_metadata is {type(md).__name__}; MLA backends need MLAMetadata from "
                "MLAMetadataBuilder.build (MLAAttention builds it from CommonAttentionMetadata)"
            )
        if np.dtype(kv_cache.dtype).itemsize != 1:
            k_scale = None  # only an fp8 latent cache is scaled; v_scale is unused (one latent, one scale)
        if self.kv_sharing_target_layer_name is None and key is not None:
            kv_cache = self.write_latents(kv_cache, key, value, md.slot_mapping, k_scale)
        num_tokens = query.shape[0]
        precision = jax.lax.Precision.HIGHEST if query.dtype == jnp.float32 else None
        if topk_positions is not None:
            q_abs = self._absorb(query, w_uk, precision)
            o_lat = self.sparse(q_abs, kv_cache, topk_positions, md, k_scale)
            o = jnp.einsum("thc,chd->thd", o_lat, w_uv.astype(o_lat.dtype), precision=precision)
            return o.astype(query.dtype), kv_cache
        if md.prefill_rows_in_order:  # no decodes: the rows are the prefills', then padding (0, as below)
            o = self.prefill(query, kv_cache, w_uk, w_uv, md, k_scale).astype(query.dtype)
            real = jnp.arange(num_tokens, dtype=jnp.int32) < md.prefill_query_start_loc[-1]
            return jnp.where(real[:, None, None], o, jnp.zeros((), o.dtype)), kv_cache
        out = jnp.zeros((num_tokens, self.num_heads, self.v_head_dim), query.dtype)
        if md.has_decodes:
            q_abs = self._absorb(query[jnp.minimum(md.decode_rows, num_tokens - 1)], w_uk, precision)
            o_lat = self.decode(q_abs, kv_cache, md.decode_seq_lens, md.decode_block_tables, k_scale)
            o = jnp.einsum("thc,chd->thd", o_lat, w_uv.astype(o_lat.dtype), precision=precision)
            out = out.at[md.decode_rows].set(o.astype(out.dtype), mode="drop")
        if md.has_prefills:
            q = query[jnp.minimum(md.prefill_rows, num_tokens - 1)]
            o = self.prefill(q, kv_cache, w_uk, w_uv, md, k_scale)
            out = out.at[md.prefill_rows].set(o.astype(out.dtype), mode="drop")
        return out, kv_cache

    def _absorb(self, q, w_uk, precision):
        """f[T, H, nope + R] -> the absorbed query f[T, H, C + R]: ``[q_nope @ W_UK | q_pe]``."""
        nope = self.qk_nope_head_dim
        q_lat = jnp.einsum("thd,chd->thc", q[..., :nope], w_uk.astype(q.dtype), precision=precision)
        return jnp.concatenate([q_lat.astype(q.dtype), q[..., nope:]], axis=-1)


class MLACommonBackend(AttentionBackend):
    """What the MLA backends share: the latent cache shape, the metadata and its builder."""

    supports_mla = True
    supported_kv_cache_dtypes = MLA_CACHE_DTYPES
    supported_attn_types = (AttentionType.DECODER,)

    @staticmethod
    def get_metadata_cls() -> type[MLAMetadata]:
        return MLAMetadata

    @staticmethod
    def get_builder_cls() -> type[MLAMetadataBuilder]:
        return MLAMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """``(num_blocks, block_size, head_size)``: one ``kv_lora_rank + qk_rope_head_dim`` row per token."""
        validate_kv_cache_dims(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str)
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={num_kv_heads}: an MLA cache has one latent row per token (valid: 1)")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2)

    @staticmethod
    def write_to_kv_cache(kv_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
        """key = kv_c_normed f[T, C], value = k_pe f[T, R]: written as latent rows at slot_mapping
        (fp8 caches: latent / k_scale; v_scale is unused)."""
        if np.dtype(kv_cache.dtype).itemsize != 1:
            k_scale = None
        return reference.write_latent_cache(kv_cache, key, value, slot_mapping, kv_lora_rank=key.shape[-1],
                                            k_scale=k_scale)  # fmt: skip

    @classmethod
    def backend_reasons(cls, config: AttentionConfig, platform: Platform | None) -> list[str]:
        """MLA backends serve only MLA layers."""
        reasons = super().backend_reasons(config, platform)
        if not config.use_mla:
            reasons.insert(0, "serves only MLA layers (use_mla=True)")
        return reasons


class XLAMLABackend(MLACommonBackend):
    """Pure jnp MLA (``ops/mla/reference.py``); every platform; the specification, not fast.
    Serves sparse MLA (``use_sparse=True``: per-token top-k positions) too."""

    supports_sparse = True

    @staticmethod
    def get_name() -> str:
        return "XLA_MLA"

    @staticmethod
    def get_impl_cls() -> type[XLAMLAImpl]:
        return XLAMLAImpl
