"""FlashAttention-3 (the ``flash-attn3-jax`` 0.2.3 binding, Hopper only) as a peer in
``benchmarks/attention.py``: its inputs made from a benchmark batch, its calls, its outputs
put back in the batch's packed token order.

The batch (``attention.DeviceBatch``) holds q packed as bf16[T, Hq, D] and one paged cache
bf16[2, P, S, Hkv, D] with block tables i32[R, W]. FA3's calls take:

- ``flash_mha_with_kvcache`` (paged): q bf16[B, Lq, Hq, D] with one Lq per call, caches
  bf16[P, S, Hkv, D] each, a page table i32[B, W] and ``cache_seqlens`` i32[B] (every key,
  causal bottom-right). A batch with several query lengths (M1) is one call per length
  (``call_groups``); another page size is a copy of the cache on new pages (``repage``).
- ``flash_mha_varlen`` (dense, packed): q bf16[T, Hq, D], k/v bf16[sum seq, Hkv, D] with
  cumulative lengths (``packed_kv``).
- ``flash_mha`` (dense): q bf16[B, L, Hq, D], k/v bf16[B, L, Hkv, D], one length (P1).

Every conversion here is done once, outside the timed region; nothing imports the wheel
but ``import_fa3`` (the CPU tests never call it). Example (on a CPU, no FA3)::

    slots = token_slots(np.array([[3, 1]]), np.array([5]), page_size=4)  # [12 13 14 15 4]
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

FA3_MODULE = "flash_attn3_jax"
FA3_WHEEL = "flash-attn3-jax 0.2.3"
_MISSING = object()


def import_fa3():
    """(the ``flash_attn3_jax`` module, notes); raises ImportError naming what to install where.

    The wheel declares einops, which ``pip install --no-deps`` leaves out and the project does
    not install; the binding uses it only in its vmap batching rules and ring attention, which
    these single-device calls never reach, so without einops a stub that raises on use stands
    in for the import (and is taken out of ``sys.modules`` again); the notes say so."""
    notes = []
    stub, before = None, sys.modules.get("einops", _MISSING)
    try:
        import einops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("einops")
        stub.rearrange = _einops_unavailable
        sys.modules["einops"] = stub
        notes.append("einops absent: a stub stood in at import (used only by the binding's vmap and ring paths)")
    try:
        import flash_attn3_jax
    except Exception as e:  # an ImportError, or the .so failing to load its CUDA runtime
        raise ImportError(
            f"{FA3_MODULE} did not import ({type(e).__name__}: {str(e)[:200]}); on the GPU machine: "
            f"pip install --no-index --no-deps --target /tmp/site .whl/flash_attn3_jax-*.whl and "
            f"export PYTHONPATH=/tmp/site:$PYTHONPATH ({FA3_WHEEL}, cp312, Hopper only)"
        ) from e
    finally:
        if stub is not None and sys.modules.get("einops") is stub:  # as it was before
            if before is _MISSING:
                del sys.modules["einops"]
            else:
                sys.modules["einops"] = before
    return flash_attn3_jax, notes


def _einops_unavailable(*args, **kwargs):
    raise NotImplementedError("einops is not installed: the FA3 binding's vmap and ring paths are unavailable here")


# --------------------------------------------------------------------------- layouts
def token_slots(block_tables: np.ndarray, seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    """i32[sum seq_lens]: the flat cache slot (page * page_size + offset) of every token of
    every request, request by request, in position order."""
    block_tables, seq_lens = np.asarray(block_tables), np.asarray(seq_lens)
    if block_tables.ndim != 2 or len(seq_lens) != block_tables.shape[0]:
        raise ValueError(f"{block_tables.shape=} must be [R, W] with R = {len(seq_lens)=}")
    if (seq_lens > block_tables.shape[1] * page_size).any():
        raise ValueError(f"{seq_lens.max()=} exceeds the table's {block_tables.shape[1]} pages of {page_size=}")
    out = []
    for r, n in enumerate(seq_lens):
        pos = np.arange(int(n))
        out.append(block_tables[r, pos // page_size] * page_size + pos % page_size)
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


def packed_kv(kv_cache: jax.Array, block_tables: np.ndarray, seq_lens: np.ndarray):
    """Every request's keys and values, packed: (k, v) bf16[sum seq, Hkv, D] each and
    cu_seqlens i32[R + 1] (the layout of FA3's ``flash_mha_varlen``)."""
    _, P, S, H, D = kv_cache.shape
    slots = token_slots(block_tables, seq_lens, S)
    flat = kv_cache.reshape(2, P * S, H, D)[:, jnp.asarray(slots)]
    cu = np.concatenate([[0], np.cumsum(np.asarray(seq_lens))]).astype(np.int32)
    return flat[0], flat[1], jnp.asarray(cu)


def repage(kv_cache: jax.Array, block_tables: np.ndarray, seq_lens: np.ndarray, page_size: int, seed: int = 0):
    """The same keys and values on pages of ``page_size``: (kv_cache bf16[2, P', page_size, Hkv, D],
    block_tables i32[R, W']). New pages are shuffled over the new cache like the benchmark's;
    slots past a request's last token hold zeros."""
    _, P, S, H, D = kv_cache.shape
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")
    seq_lens = np.asarray(seq_lens)
    pages = -(-seq_lens // page_size)
    num_pages = int(pages.sum())
    ids = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages)])
    tables = np.zeros((len(seq_lens), max(int(pages.max(initial=0)), 1)), np.int32)
    src = np.full(num_pages * page_size, P * S, np.int32)  # P * S: the zero row appended below
    old = token_slots(block_tables, seq_lens, S)
    start = 0
    for r, n in enumerate(seq_lens):
        tables[r, : pages[r]] = ids[offsets[r] : offsets[r + 1]]
        pos = np.arange(int(n))
        src[tables[r, pos // page_size] * page_size + pos % page_size] = old[start : start + n]
        start += n
    flat = jnp.concatenate([kv_cache.reshape(2, P * S, H, D), jnp.zeros((2, 1, H, D), kv_cache.dtype)], axis=1)
    return flat[:, jnp.asarray(src)].reshape(2, num_pages, page_size, H, D), tables


@dataclasses.dataclass(frozen=True)
class CallGroup:
    """Requests one FA3 paged call serves: all of one query length."""

    reqs: np.ndarray  # i32[B]: request indices
    q_len: int
    rows: np.ndarray  # i32[B * q_len]: their rows of the packed q, request by request
    max_seq: int  # the longest seq_len among them


def call_groups(query_lens: np.ndarray, seq_lens: np.ndarray) -> list[CallGroup]:
    """One group per distinct query length, in order of first appearance (FA3's paged call
    takes one Lq per call)."""
    query_lens, seq_lens = np.asarray(query_lens), np.asarray(seq_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    out = []
    for n in dict.fromkeys(int(x) for x in query_lens):
        reqs = np.flatnonzero(query_lens == n).astype(np.int32)
        rows = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in reqs]).astype(np.int32)
        out.append(CallGroup(reqs, n, rows, int(seq_lens[reqs].max())))
    return out


def group_q(q: jax.Array, group: CallGroup) -> jax.Array:
    """bf16[T, Hq, D] -> bf16[B, q_len, Hq, D]: the group's rows as FA3 takes them."""
    return q[jnp.asarray(group.rows)].reshape(len(group.reqs), group.q_len, *q.shape[1:])


def group_tables(block_tables: np.ndarray, group: CallGroup, page_size: int) -> jax.Array:
    """i32[B, ceil(max_seq / page_size)]: the group's block tables, cut to its longest request
    (FA3 sizes its work by the table's width)."""
    width = -(-group.max_seq // page_size)
    return jnp.asarray(np.asarray(block_tables)[group.reqs, :width], jnp.int32)


def scatter_out(outs: list[jax.Array], groups: list[CallGroup], num_tokens: int) -> jax.Array:
    """The groups' outputs ([B, q_len, Hq, D] each) back in packed order: [T, Hq, D]."""
    Hq, D = outs[0].shape[-2:]
    out = jnp.zeros((num_tokens, Hq, D), outs[0].dtype)
    for o, g in zip(outs, groups, strict=True):
        out = out.at[jnp.asarray(g.rows)].set(o.reshape(-1, Hq, D))
    return out


def dense_kv(k: jax.Array, v: jax.Array, seq_lens: np.ndarray):
    """Packed k/v [sum seq, Hkv, D] of requests of one length L -> [R, L, Hkv, D] each
    (``flash_mha``'s layout); raises ValueError for unequal lengths."""
    seq_lens = np.asarray(seq_lens)
    if len(set(seq_lens.tolist())) != 1:
        raise ValueError(f"flash_mha takes one sequence length per call, got seq_lens {sorted(set(seq_lens))}")
    R, L = len(seq_lens), int(seq_lens[0])
    return k.reshape(R, L, *k.shape[1:]), v.reshape(R, L, *v.shape[1:])


# --------------------------------------------------------------------------- calls
def paged_call(fa3, *, sm_scale: float, num_splits: int):
    """f(q [B, Lq, Hq, D], k_cache, v_cache [P, S, Hkv, D], tables i32[B, W], seq_lens i32[B])
    -> [B, Lq, Hq, D]: ``flash_mha_with_kvcache``, causal (bottom-right), unjitted."""
    return functools.partial(_paged, fa3.flash_mha_with_kvcache, sm_scale=float(sm_scale), num_splits=int(num_splits))


def _paged(fn, q, k_cache, v_cache, tables, seq_lens, *, sm_scale, num_splits):
    return fn(q, k_cache, v_cache, cache_seqlens=seq_lens, page_table=tables, softmax_scale=sm_scale,
              is_causal=True, num_splits=num_splits)  # fmt: skip


def varlen_call(fa3, *, sm_scale: float, max_q: int, max_k: int):
    """f(q [T, Hq, D], k, v [N, Hkv, D], cu_q, cu_k i32[R + 1]) -> [T, Hq, D]:
    ``flash_mha_varlen``, causal (bottom-right per request)."""

    def run(q, k, v, cu_q, cu_k):
        return fa3.flash_mha_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
                                    softmax_scale=float(sm_scale), is_causal=True)  # fmt: skip

    return run


def dense_call(fa3, *, sm_scale: float):
    """f(q [B, L, Hq, D], k, v [B, L, Hkv, D]) -> [B, L, Hq, D]: ``flash_mha``, causal."""

    def run(q, k, v):
        return fa3.flash_mha(q, k, v, softmax_scale=float(sm_scale), is_causal=True)

    return run
