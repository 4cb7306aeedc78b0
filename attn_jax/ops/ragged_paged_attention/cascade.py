"""Cascade attention: a prefix every request of the batch shares, read once for all of them.

The batch's attention splits into two parts over disjoint keys, merged by log-sum-exp
(``merge.merge_attn_states``):

- the shared prefix: every real query row of the batch as ONE non-causal request over the
  prefix's pages (``block_tables[0, :prefix_len // S]``), so those pages are read once for the
  whole batch instead of once per request (non-causal is exact: every new token comes after
  the prefix);
- the suffix: each request over its own pages after the prefix (``block_tables[:, prefix_len
  // S:]``, ``seq_lens - prefix_len``), causal as usual (positions shift by the same amount on
  both sides of ``j <= p``), with the sinks.

Any kernel module's ``ragged_paged_attention`` with ``return_lse`` serves both parts
(``op``), on its own cache layout (the XLA one or the Mosaic TPU kernel's). Sliding windows
and ALiBi depend on each row's absolute position, which the one-request prefix part does
not have: they are refused, as vLLM's cascade refuses them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn_jax.ops.ragged_paged_attention import reference
from attn_jax.ops.ragged_paged_attention.merge import merge_attn_states
from attn_jax.ops.ragged_paged_attention.validate import is_concrete


def cascade_ragged_paged_attention(
    q,  # f[T, Hq, D]
    k,  # f[T, Hkv, D] | None: new keys, written at slot_mapping
    v,  # f[T, Hkv, D] | None
    kv_cache,  # the op's cache layout
    query_start_loc,  # i32[R + 1]
    seq_lens,  # i32[R]
    block_tables,  # i32[R, pages_per_req]: the first prefix_len // S entries equal in every row
    slot_mapping,  # i32[T]
    *,
    prefix_len,  # int or i32[]: tokens of the shared prefix, whole pages, within every request's context
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes=None,
    sinks=None,
    k_scale=None,
    v_scale=None,
    op=reference.ragged_paged_attention,
    prefix_kwargs: dict | None = None,
    suffix_kwargs: dict | None = None,
    fuse_merge: bool = False,
    suffix_block_tables=None,  # i32[R, pages_per_req] | None: ``suffix_block_tables``'s, built once per step
    **op_kwargs,
):
    """(out f[T, Hq, D], kv_cache): ``op``'s attention, with the shared prefix read once.

    ``op_kwargs`` go to both calls of ``op`` (``interpret``, say); block sizes and schedules
    built for the whole batch do not fit the two parts and must not be passed.
    ``prefix_kwargs`` go to the prefix part's call only (block sizes for its one request of
    every row, say), ``suffix_kwargs`` to the suffix part's only. ``fuse_merge``: ``op`` has
    ``return_states`` and ``state_init`` (``pallas_triton``'s): the suffix part's kernel
    starts from the prefix part's raw split states, so no merge runs between or after the
    two launches. A metadata builder that serves many layers passes what every layer's call
    would derive alike, once: ``suffix_block_tables`` here, each part's ``schedule`` in its
    kwargs (``PALLAS_GPU``'s builder does).

    Example::

        out, kv_cache = cascade_ragged_paged_attention(
            q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping,
            prefix_len=2048, sm_scale=head_size**-0.5, op=pallas_triton.ragged_paged_attention)
    """
    page_size = _page_size(kv_cache)
    if sliding_window is not None or alibi_slopes is not None:
        raise ValueError(
            f"cascade attention takes no sliding_window ({sliding_window}) or alibi_slopes "
            f"({'set' if alibi_slopes is not None else None}): both depend on each row's position"
        )
    if not causal:
        raise ValueError("cascade attention is for causal decoder attention (causal=True)")
    width = block_tables.shape[1]
    if is_concrete(prefix_len):
        prefix_len = int(np.asarray(prefix_len))
        if prefix_len <= 0 or prefix_len % page_size:
            raise ValueError(f"prefix_len={prefix_len} must be a positive multiple of the page size {page_size}")
        if prefix_len // page_size > width:
            raise ValueError(f"prefix_len={prefix_len} spans {prefix_len // page_size} pages; block_tables has {width}")
    prefix_pages = prefix_len // page_size
    qsl = np.asarray(query_start_loc) if is_concrete(query_start_loc) else None
    if is_concrete(seq_lens, block_tables, prefix_len) and qsl is not None:
        lens, host_tables = np.asarray(seq_lens), np.asarray(block_tables)
        context = lens - np.diff(qsl)
        real = np.diff(qsl) > 0
        if (context[real] < prefix_len).any():
            r = int(np.flatnonzero(real & (context < prefix_len))[0])
            raise ValueError(
                f"prefix_len={prefix_len} exceeds request {r}'s cached context {int(context[r])}: "
                "the shared prefix must be cached before every request's new tokens"
            )
        shared = host_tables[real][:, :prefix_pages]
        if len(shared) and (shared != shared[:1]).any():
            r = int(np.flatnonzero((shared != shared[:1]).any(axis=1))[0])
            raise ValueError(f"request {r}'s first {prefix_pages} pages differ from request 0's: no shared prefix")
    common = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale)
    tables = jnp.asarray(block_tables)
    # The prefix part reads request 0's table up to prefix_len (a non-causal request of that
    # length never reads further); the suffix part each request's table moved left by the
    # prefix's pages (the columns shifted in past the end are never read).
    prefix = (q, k, v, kv_cache, *prefix_part_lens(query_start_loc, prefix_len), tables[:1], slot_mapping)
    prefix_kwargs = dict(causal=False, **common, **op_kwargs, **(prefix_kwargs or {}))
    if fuse_merge:
        states, kv_cache = op(*prefix, return_states=True, **prefix_kwargs)
    else:
        out_p, kv_cache, lse_p = op(*prefix, return_lse=True, **prefix_kwargs)
    if suffix_block_tables is None:
        suffix_block_tables = shifted_block_tables(tables, prefix_pages)
    elif tuple(suffix_block_tables.shape) != tuple(tables.shape):
        raise ValueError(
            f"suffix_block_tables.shape={tuple(suffix_block_tables.shape)} must equal block_tables.shape="
            f"{tuple(tables.shape)} (shifted_block_tables of it)"
        )
    suffix = (
        q, None, None, kv_cache, query_start_loc, jnp.asarray(seq_lens) - prefix_len, suffix_block_tables, slot_mapping,
    )  # fmt: skip
    suffix_kwargs = dict(causal=True, sinks=sinks, **common, **op_kwargs, **(suffix_kwargs or {}))
    if fuse_merge:
        return op(*suffix, state_init=states, **suffix_kwargs)
    out_s, kv_cache, lse_s = op(*suffix, return_lse=True, **suffix_kwargs)
    out, _ = merge_attn_states(out_p, lse_p, out_s, lse_s)
    return out, kv_cache


def prefix_part_lens(query_start_loc, prefix_len, xp=jnp):
    """(query_start_loc i32[2], seq_lens i32[1]) of the prefix part: every real query row of
    the batch as one request over ``prefix_len`` keys. ``xp=numpy`` on the host."""
    num_actual = xp.asarray(query_start_loc)[-1]
    return xp.stack([xp.zeros((), np.int32), num_actual]).astype(np.int32), xp.full((1,), prefix_len, np.int32)


def shifted_block_tables(block_tables, prefix_pages, xp=jnp):
    """i32[R, W]: each request's table moved left by the shared prefix's ``prefix_pages``
    (the suffix part's tables; the columns shifted in past the end repeat the last and are
    never read). ``xp=numpy`` on the host."""
    width = block_tables.shape[1]
    return xp.take(block_tables, xp.minimum(prefix_pages + xp.arange(width), width - 1), axis=1)


def _page_size(kv_cache) -> int:
    """Page size S of an XLA-layout cache [2, P, S, Hkv, D] or a PALLAS_TPU one [P, Hkv, S, 2D]."""
    if kv_cache.ndim not in (4, 5):
        raise ValueError(
            f"cascade attention takes the XLA cache layout [2, P, S, Hkv, D] or the PALLAS_TPU one "
            f"[P, Hkv, S, 2D], not {kv_cache.shape}"
        )
    return int(kv_cache.shape[2])
