"""The paged KV cache as a torch tensor: allocation and in-place, slot-mapped writes.

JAX cannot write into memory it does not own (a DLPack view of a torch tensor donated to
a jitted call is silently copied, jax 0.11.2), so ``attn_torch`` writes the new keys and
values with torch, in place, and lets the backend read the cache through a zero-copy
view. Per layer and step the bytes written are the new k/v, nothing else.

The cache layout is the XLA and Pallas GPU backends' NHD ``[2, P, S, Hkv, D]``: keys at
index 0, values at 1, slot ``s`` = page ``s // S``, offset ``s % S``. fp8 caches store
``k / k_scale`` clipped to the fp8 range, like ``attn_jax.kv_cache.quantize_to_cache``.
"""

from __future__ import annotations

import torch

from bridge.dlpack import BridgeError

__all__ = ["NHD_LAYOUT", "TORCH_CACHE_DTYPES", "quantize_to_cache", "write_to_kv_cache"]

NHD_LAYOUT = "[2, num_blocks, block_size, num_kv_heads, head_size]"

TORCH_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
"""Every dtype a torch KV cache may hold."""


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as the cache stores it: fp8 = (x / scale) in float32, clipped, cast; else a cast."""
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(cache_dtype).max
        return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def write_to_kv_cache(
    kv_cache: torch.Tensor,  # [2, P, S, Hkv, D]
    key: torch.Tensor,  # f[T, Hkv, D]
    value: torch.Tensor,  # f[T, Hkv, D]
    slots: torch.Tensor,  # i64[n]: flat slots, all >= 0
    rows: torch.Tensor | None = None,  # i64[n]: which rows of key/value; None = rows 0..n-1
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes ``key[rows]``/``value[rows]`` at ``slots`` of ``kv_cache``, in place.

    Moves ``2 * n * Hkv * D`` cache-dtype elements, staged once as a stacked
    ``[2, n, Hkv, D]`` copy of the new rows (quantised for fp8) so that one
    ``index_copy_`` writes keys and values. Padding rows (slot -1) are left out
    of ``slots``/``rows`` by the caller (``ForwardContext.prepare``).
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise BridgeError(f"kv_cache.shape={tuple(kv_cache.shape)} must be {NHD_LAYOUT}")
    if not kv_cache.is_contiguous():
        raise BridgeError(f"kv_cache with strides={kv_cache.stride()} must be contiguous ({NHD_LAYOUT})")
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)  # a view: writes land in the cache
    n = slots.shape[0]
    if n == 0:
        return
    pair = (key[:n], value[:n]) if rows is None else (key.index_select(0, rows), value.index_select(0, rows))
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # index_copy_ has no fp8 kernels (torch 2.11): copy the same bytes as uint8
        k_new, v_new = (quantize_to_cache(x, kv_cache.dtype, s) for x, s in zip(pair, (k_scale, v_scale), strict=True))
        pair, flat = (k_new.view(torch.uint8), v_new.view(torch.uint8)), flat.view(torch.uint8)
    new = torch.stack(pair)  # [2, n, Hkv, D]
    flat.index_copy_(1, slots, new if new.dtype == flat.dtype else new.to(flat.dtype))
