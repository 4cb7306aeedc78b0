"""The MLAAttention layer for JAX models: multi-head latent attention (vLLM's ``MLAAttention``).

A DeepSeek-V2/V3 attention block computes, per token, the query ``q`` f[T, H, nope + rope]
(``q_nope`` then the rotated ``q_pe``), the normalised latent ``kv_c_normed`` f[T, C] and the
rotated shared rotary key ``k_pe`` f[T, R]. The layer writes ``[kv_c_normed | k_pe]`` into the
paged latent cache (one ``C + R`` row per token) and attends through its MLA backend:

- decodes absorbed: ``q_nope @ W_UK`` (f[H, C]) joined to ``q_pe`` is an MQA query of head
  size ``C + R`` over the shared latent key; the latent output ``[H, C] @ W_UV`` gives f[H, v];
- prefills up-projected: keys ``[c_kv @ W_UK | k_pe]`` (nope + R) and values ``c_kv @ W_UV``.

``W_UK`` and ``W_UV`` are the two halves of ``kv_b_proj`` (f[C, H * (nope + v)] in ``x @ w``
orientation, per head the nope columns then the v columns, as Hugging Face stores
``kv_b_proj.weight.T``); the layer is functional, so they are arguments of the call.

Example::

    mla = MLAAttention(num_heads=16, scale=192**-0.5, qk_nope_head_dim=128, qk_rope_head_dim=64,
                       v_head_dim=128, q_lora_rank=None, kv_lora_rank=512, block_size=64, dtype=jnp.bfloat16)
    cache = mla.init_kv_cache(num_blocks=1024)
    out, cache = mla(q, kv_c_normed, k_pe, cache, common_attn_metadata, kv_b_proj)   # out f[T, H * 128]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_jax.backends.base import AttentionBackend, AttentionSpec
from attn_jax.layer import CacheConfig
from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.platforms import current_platform
from attn_jax.selector import get_attn_backend
from attn_jax.types import cache_storage_dtype, validate_activation_dtype, validate_cache_dtype, validate_positive_int


class MLAAttention:
    """Multi-head latent attention over a paged latent cache; the backend is chosen by
    ``get_attn_backend(kv_lora_rank + qk_rope_head_dim, dtype, ..., use_mla=True)`` unless
    ``attn_backend`` is given. Arguments follow vLLM's ``MLAAttention`` (``kv_b_proj`` is
    passed at call time: JAX layers hold no weights)."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        use_sparse: bool = False,
        attn_backend: type[AttentionBackend] | None = None,
        *,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        dtype=None,
    ) -> None:
        for name, value in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim),
                            ("kv_lora_rank", kv_lora_rank)):  # fmt: skip
            validate_positive_int(name, value)
        if cache_config is not None:
            block_size, kv_cache_dtype = cache_config.block_size, cache_config.cache_dtype
        self.num_heads, self.scale = num_heads, float(scale)
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank = v_head_dim, q_lora_rank, kv_lora_rank
        self.head_size = kv_lora_rank + qk_rope_head_dim  # the latent cache row
        self.block_size = validate_positive_int("block_size", block_size)
        self.kv_cache_dtype = validate_cache_dtype(kv_cache_dtype)
        self.dtype = validate_activation_dtype(jnp.zeros(()).dtype if dtype is None else dtype)
        self.prefix, self.use_sparse = prefix, use_sparse
        if attn_backend is None:
            attn_backend = get_attn_backend(
                self.head_size, self.dtype, self.kv_cache_dtype, self.block_size, use_mla=True, use_sparse=use_sparse
            )
        else:
            reasons = attn_backend.validate_configuration(
                self.head_size, self.dtype, self.kv_cache_dtype, self.block_size, use_mla=True,
                use_sparse=use_sparse, platform=current_platform(),
            )  # fmt: skip
            if reasons:
                raise ValueError(
                    f"attn_backend={attn_backend.get_name()} cannot serve this layer: " + "; ".join(reasons)
                )
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(
            num_heads, self.head_size, self.scale, 1, kv_cache_dtype=self.kv_cache_dtype, kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        )  # fmt: skip
        self.kv_cache_spec = AttentionSpec(
            block_size=self.block_size, num_kv_heads=1, head_size=self.head_size, dtype=self.dtype,
            num_q_heads=num_heads,
        )  # fmt: skip
        self.metadata_builder = attn_backend.get_builder_cls()(self.kv_cache_spec)
        self.k_scale = jnp.float32(1.0)  # an fp8 latent cache stores latent / k_scale (vLLM's default 1.0)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)``."""
        return self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, 1, self.head_size, self.kv_cache_dtype)

    def init_kv_cache(self, num_blocks: int, fill: float = 0.0) -> jax.Array:
        """A cache of the backend's shape and the cache dtype, filled with ``fill``."""
        dtype = cache_storage_dtype(self.kv_cache_dtype, self.dtype)
        return jnp.full(self.kv_cache_shape(num_blocks), fill, dtype)

    def split_kv_b_proj(self, kv_b_proj):
        """(w_uk f[C, H, nope], w_uv f[C, H, v]) from kv_b_proj f[C, H * (nope + v)]."""
        expected = (self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        if tuple(kv_b_proj.shape) != expected:
            raise ValueError(
                f"kv_b_proj.shape={tuple(kv_b_proj.shape)} must be {expected}: [kv_lora_rank, num_heads * "
                f"(qk_nope_head_dim + v_head_dim)] (x @ w orientation, per head nope columns then v columns)"
            )
        w = kv_b_proj.reshape(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim :]

    def __call__(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, kv_b_proj, topk_positions=None):
        """Writes the new latents and attends. Returns (out f[T, H * v_head_dim], kv_cache).

        q f[T, H, nope + rope] or f[T, H * (nope + rope)]; kv_c_normed f[T, C]; k_pe f[T, R] or
        f[T, 1, R]; attn_metadata: ``CommonAttentionMetadata`` (built here, on the host) or the
        backend's ``MLAMetadata``; topk_positions i32[T, topk] (positions in each token's
        request, -1 = padding; e.g. ``sparse_reference.lightning_indexer``'s), required exactly
        when the layer has ``use_sparse=True``.
        """
        if self.use_sparse != (topk_positions is not None):
            raise ValueError(
                f"topk_positions is {'None' if topk_positions is None else 'given'} but the layer has "
                f"use_sparse={self.use_sparse}: sparse MLA layers take i32[T, topk] positions, dense ones none"
            )
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.qk_head_dim)
        k_pe = k_pe.reshape(num_tokens, self.qk_rope_head_dim)
        for name, x in (("q", q), ("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if x.dtype != self.dtype:
                raise TypeError(f"{name}.dtype={x.dtype} must be the layer's dtype={self.dtype} (no silent cast)")
        if kv_c_normed.shape != (num_tokens, self.kv_lora_rank):
            raise ValueError(
                f"kv_c_normed.shape={tuple(kv_c_normed.shape)} must be ({num_tokens}, {self.kv_lora_rank})"
            )
        if isinstance(attn_metadata, CommonAttentionMetadata):
            attn_metadata = self.metadata_builder.build(0, attn_metadata)
        w_uk, w_uv = self.split_kv_b_proj(kv_b_proj)
        sparse = {} if topk_positions is None else {"topk_positions": topk_positions}
        out, kv_cache = self.impl.forward(
            q, kv_c_normed, k_pe, kv_cache, attn_metadata, w_uk=w_uk, w_uv=w_uv, k_scale=self.k_scale, **sparse
        )
        return out.reshape(num_tokens, self.num_heads * self.v_head_dim), kv_cache

    def __repr__(self) -> str:
        return (
            f"MLAAttention(num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}, backend={self.attn_backend.get_name()})"
        )
