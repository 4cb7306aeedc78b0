"""Hugging Face transformers (5.x, tested with 5.23) running attention through attn-stack.

Two attention implementations are registered with ``AttentionInterface.register``:

``"attn_stack"`` (``ATTN_IMPLEMENTATION``), for ``model(...)`` and ``model.generate``:
  transformers hands it dense, per-sequence keys and values from its own KV cache
  (``DynamicCache``). Each call copies them into a scratch paged cache (NHD pages of
  ``SCRATCH_BLOCK_SIZE``) and runs the backend on it. Correct, with causal masks and
  left padding; not fast: the copy is the price of transformers' dense cache layout.

``"attn_stack_flash_varlen"`` (``PAGED_ATTN_IMPLEMENTATION``), for ``model.generate_batch``:
  transformers' continuous batching keeps a paged KV cache (``PagedAttentionCache``) and
  gives the attention function the packed (varlen) batch: ``cu_seq_lens_q/k``, the
  cache, and each token's physical write and read rows. This implementation writes the
  new keys and values into that cache in place (the same ``index_copy_`` transformers
  does), derives block tables from the rows, and runs the backend directly over the
  cache's memory through a zero-copy view, so no step copies the cache. Continuous
  batching in 5.23 accepts only ``"paged|eager"``, ``"sdpa"`` or flash-named
  implementations and gives flash-named ones packed inputs with no mask, which is what a
  ragged op needs; hence the name. Full-attention layers only (no sliding-window groups),
  and the decode fast path (``block_table`` kwarg) must be off (its default). CUDA
  graphs must be off too (each step runs host code): ``use_attn_stack(model, paged=True)``
  turns them off for ``generate_batch`` and refuses a config that asks for them.

Importing this module registers both names (``register()``, idempotent), so
``AutoModelForCausalLM.from_pretrained(..., attn_implementation="attn_stack")`` works
after ``import attn_torch.integrations.transformers``; ``use_attn_stack`` switches an
already loaded model. Both go through ``attn_torch.Attention`` layers (one per decoder layer and path, made on
first use), so selection, backends and errors are the same as everywhere else. Usage::

    from attn_torch.integrations.transformers import use_attn_stack
    with use_attn_stack(model):                 # plain forward / generate
        out = model.generate(input_ids, max_new_tokens=16, do_sample=False)
    with use_attn_stack(model, paged=True):     # continuous batching over its paged cache
        results = model.generate_batch(inputs=list_of_token_lists, generation_config=cfg)

One copy the bridge does not avoid: transformers passes queries as a transposed view
([B, H, L, D] of a [B, L, H, D] computation after RoPE), so each call makes the query
contiguous (``T * Hq * D`` elements).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator

import numpy as np
import torch
import transformers
from transformers import AttentionInterface, ContinuousBatchingConfig
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

from attn_jax.metadata import CommonAttentionMetadata, MetadataBuckets
from attn_torch.forward_context import ForwardContext, use_forward_context
from attn_torch.kv_cache import write_to_kv_cache
from attn_torch.layer import Attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PAGED_ATTN_IMPLEMENTATION",
    "SCRATCH_BLOCK_SIZE",
    "attn_stack_attention_forward",
    "attn_stack_paged_attention_forward",
    "register",
    "use_attn_stack",
]

_ALLOCATOR_ATTRS = (
    "layer_type", "index", "layer_indices", "tokens_per_page", "pages_per_block", "block_physical_stride",
    "cache_tensor", "_kv_token_views",
)  # fmt: skip
"""What the paged path reads of a transformers 5.23 cache allocator."""

ATTN_IMPLEMENTATION = "attn_stack"
PAGED_ATTN_IMPLEMENTATION = "attn_stack_flash_varlen"
SCRATCH_BLOCK_SIZE = 16
_BUCKETS = MetadataBuckets()


def register() -> None:
    """Registers both implementations and their mask functions (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attn_stack_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, attn_stack_paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTN_IMPLEMENTATION, flash_attention_mask)


@contextlib.contextmanager
def use_attn_stack(model, paged: bool = False) -> Iterator[None]:
    """Runs ``model``'s attention through attn-stack inside the block, then restores it.

    ``paged=False``: ``"attn_stack"`` (forward, ``generate``); ``paged=True``:
    ``"attn_stack_flash_varlen"`` (``generate_batch``). The implementation is set on the
    config directly: transformers' ``set_attn_implementation`` would look for a flash
    kernel behind the flash-named one.
    """
    register()
    config = model.config.get_text_config()
    original = config._attn_implementation
    config._attn_implementation = PAGED_ATTN_IMPLEMENTATION if paged else ATTN_IMPLEMENTATION
    if paged:  # an instance attribute for the block's duration: generate_batch calls self.init_...
        model.init_continuous_batching = functools.partial(_init_without_cuda_graphs, model)
    try:
        yield
    finally:
        config._attn_implementation = original
        if paged:
            del model.init_continuous_batching


def _init_without_cuda_graphs(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """``model.init_continuous_batching`` with CUDA graphs off.

    transformers captures flash-named implementations in CUDA graphs by default, but this
    one runs host code every step (block tables, JAX dispatch), which a graph cannot
    replay: with graphs on, the capture fails and ``generate_batch`` returns no tokens.
    """
    cb_config = continuous_batching_config
    if cb_config is None:  # transformers' deprecated route: the config inside the GenerationConfig
        cb_config = getattr(generation_config or model.generation_config, "continuous_batching_config", None)
    generation_config = _with_explicit_no_eos(generation_config or model.generation_config)
    cb_config = ContinuousBatchingConfig() if cb_config is None else copy.copy(cb_config)
    if cb_config.use_cuda_graph not in (None, False, (False, False)):
        raise ValueError(
            f"continuous_batching_config.use_cuda_graph={cb_config.use_cuda_graph!r}, but "
            f"{PAGED_ATTN_IMPLEMENTATION!r} runs host code every step and cannot be captured in a CUDA graph: "
            "leave it None or set it False"
        )
    cb_config.use_cuda_graph = False
    return type(model).init_continuous_batching(
        model, generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=workload_hints
    )


def _with_explicit_no_eos(generation_config):
    """``generation_config`` with ``eos_token_id=None`` spelled as -1, transformers'
    "disabled": the same generation, without the warning transformers logs on every
    ``generate_batch`` call (and without it rewriting the caller's config in place)."""
    if generation_config is None or generation_config.eos_token_id is not None:
        return generation_config
    generation_config = copy.copy(generation_config)
    generation_config.eos_token_id = -1
    return generation_config


def _layer_for(module, kind: str, query: torch.Tensor, key: torch.Tensor, scaling: float, block_size: int) -> Attention:
    """The attn_torch layer serving ``module`` on path ``kind``, made on first use."""
    layers = module.__dict__.setdefault("_attn_stack_layers", {})
    spec = (kind, query.shape[1], key.shape[1], query.shape[-1], float(scaling), query.dtype, block_size)
    layer = layers.get(spec)
    if layer is None:
        sliding_window = getattr(module, "sliding_window", None)
        layer = Attention(
            num_heads=query.shape[1], head_size=query.shape[-1], scale=scaling, num_kv_heads=key.shape[1],
            per_layer_sliding_window=sliding_window, prefix=f"transformers.{id(module):x}.{kind}.{len(layers)}",
            block_size=block_size, dtype=query.dtype,
        )  # fmt: skip
        layers[spec] = layer
    return layer


def _scaling(module, query: torch.Tensor, scaling: float | None) -> float:
    if scaling is not None:
        return float(scaling)
    return float(getattr(module, "scaling", query.shape[-1] ** -0.5))


def _check_dropout(module, dropout: float) -> None:
    if dropout and module.training:
        raise NotImplementedError(f"attn_stack has no attention dropout; got dropout={dropout} in training mode")


# ------------------------------------------------------------------------- dense path


def _left_padding(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> np.ndarray:
    """i64[B]: leading padded keys per row, from transformers' boolean 4-D mask (None = 0).

    Raises ValueError unless the mask is causal with left padding, the one pattern a
    ragged, paged batch expresses.
    """
    if mask is None:
        return np.zeros(batch, np.int64)
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(
            f"attn_stack expects transformers' boolean [B, 1, Lq, Lk] mask, got {mask.dtype} {tuple(mask.shape)}"
        )
    pads = kv_len - mask[:, 0, -1, :].sum(-1)  # the last query row sees every unpadded key
    j = torch.arange(kv_len, device=mask.device)
    i = torch.arange(q_len, device=mask.device)[:, None]
    expected = (j >= pads[:, None, None]) & (j <= kv_len - q_len + i)  # [B, Lq, Lk]
    real_rows = (kv_len - q_len + i) >= pads[:, None, None]  # query rows that are not padding themselves
    bad = (mask[:, 0] != expected) & real_rows
    if bad.any():
        b, row, col = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"attention_mask[{b}, 0, {row}, {col}]={bool(mask[b, 0, row, col])} is not causal with left padding; "
            "attn_stack serves causal attention over left-padded batches only"
        )
    return pads.cpu().numpy().astype(np.int64)


def attn_stack_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]: the whole context from transformers' cache
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    attention_mask: torch.Tensor | None,  # bool [B, 1, Lq, Lk] or None (causal, no padding)
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature; returns ([B, Lq, Hq, D], None).

    Copies the context's keys and values into a scratch paged cache and runs the
    backend on the real (unpadded) query rows; padded query rows get zeros.
    """
    _check_dropout(module, dropout)
    batch, num_q_heads, q_len, head_size = query.shape
    _, num_kv_heads, kv_len, _ = key.shape
    layer = _layer_for(module, "dense", query, key, _scaling(module, query, scaling), SCRATCH_BLOCK_SIZE)
    pads = _left_padding(attention_mask, batch, q_len, kv_len)
    seq_lens = kv_len - pads  # i64[B]
    query_lens = np.minimum(q_len, seq_lens)
    bs = SCRATCH_BLOCK_SIZE
    pages = -(-seq_lens // bs)
    width = max(int(pages.max(initial=1)), 1)
    block_table = np.zeros((batch, width), np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages)])
    for b in range(batch):
        block_table[b, : pages[b]] = np.arange(offsets[b], offsets[b + 1])
    md = _metadata(query_lens, seq_lens, block_table)
    device = query.device

    # Real query rows, packed: row b's last query_lens[b] rows. Real keys: row b from pads[b] on.
    q_rows = np.concatenate([b * q_len + np.arange(q_len - n, q_len) for b, n in enumerate(query_lens)])
    k_rows = np.concatenate([b * kv_len + np.arange(p, kv_len) for b, p in enumerate(pads)])
    slots = np.concatenate(
        [block_table[b, np.arange(n) // bs] * bs + np.arange(n) % bs for b, n in enumerate(seq_lens)]
    )
    k_rows_t = torch.from_numpy(k_rows).to(device)
    num_blocks = MetadataBuckets.fit(_BUCKETS.blocks_per_request_buckets, max(int(offsets[-1]), 1), "scratch blocks")
    kv_cache = torch.empty(layer.kv_cache_shape(num_blocks), dtype=layer.kv_cache_torch_dtype, device=device)
    flat_k = key.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, head_size)
    flat_v = value.transpose(1, 2).reshape(batch * kv_len, num_kv_heads, head_size)
    write_to_kv_cache(kv_cache, flat_k, flat_v, torch.from_numpy(slots).to(device), k_rows_t)
    layer.kv_cache = [kv_cache]

    q_rows_t = torch.from_numpy(q_rows).to(device)
    packed = torch.zeros(md.num_tokens, num_q_heads, head_size, dtype=query.dtype, device=device)
    packed[: len(q_rows)] = query.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_size)[q_rows_t]
    with use_forward_context(ForwardContext(md)):
        out = layer(packed, None, None)  # [T, Hq * D]
    result = torch.zeros(batch * q_len, num_q_heads, head_size, dtype=query.dtype, device=device)
    result.index_copy_(0, q_rows_t, out[: len(q_rows)].view(-1, num_q_heads, head_size))
    layer.unbind_kv_cache()
    return result.view(batch, q_len, num_q_heads, head_size), None


def _metadata(query_lens: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray, num_tokens: int | None = None):
    """Bucket-padded CommonAttentionMetadata with every slot -1 (the caller writes k/v)."""
    num_reqs = len(query_lens)
    r_pad = MetadataBuckets.fit(_BUCKETS.request_buckets, num_reqs, "num_reqs")
    p_pad = MetadataBuckets.fit(_BUCKETS.blocks_per_request_buckets, block_table.shape[1], "blocks per request")
    qsl = np.zeros(r_pad + 1, np.int32)
    qsl[1 : num_reqs + 1] = np.cumsum(query_lens)
    qsl[num_reqs + 1 :] = qsl[num_reqs]
    num_actual = int(qsl[-1])
    if num_tokens is None:
        num_tokens = MetadataBuckets.fit(_BUCKETS.token_buckets, num_actual, "num_tokens")
    lens = np.zeros(r_pad, np.int32)
    lens[:num_reqs] = seq_lens
    computed = lens.copy()
    computed[:num_reqs] -= np.asarray(query_lens, np.int32)
    table = np.zeros((r_pad, p_pad), np.int32)
    table[:num_reqs, : block_table.shape[1]] = block_table
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens,
        num_computed_tokens_cpu=computed, num_reqs=r_pad, num_actual_tokens=num_actual,
        max_query_len=int(np.max(query_lens, initial=0)), block_table_tensor=table,
        slot_mapping=np.full(num_tokens, -1, np.int32),
    )  # fmt: skip


# ------------------------------------------------------------------------- paged path


@dataclasses.dataclass(eq=False)
class _PagedStep:
    """One continuous-batching step of one allocator: shared by all its layers."""

    context: ForwardContext


def _paged_step(cache, allocator, kwargs, num_tokens: int, first_layer: bool) -> _PagedStep:
    """Block tables from transformers' physical rows; rebuilt at the allocator's first layer."""
    steps = cache.__dict__.setdefault("_attn_stack_steps", {})
    step = steps.get(allocator.index)
    if step is not None and not first_layer:
        return step
    cu_q = kwargs["cu_seq_lens_q"].cpu().numpy().astype(np.int64)
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k = (cu_k[allocator.layer_type] if isinstance(cu_k, dict) else cu_k).cpu().numpy().astype(np.int64)
    read_index = kwargs["read_index"][allocator.index]
    write_index = kwargs["write_index"][allocator.index]
    query_lens, seq_lens = np.diff(cu_q), np.diff(cu_k)
    if read_index.numel():  # rows of every position of each request
        rows, starts = read_index.cpu().numpy(), cu_k
    else:  # prefills only: the written rows are all of them
        rows, starts = write_index.cpu().numpy(), cu_q
        if np.any(query_lens != seq_lens):
            raise ValueError("transformers sent no read_index for a batch with cached tokens")
    ps, stride, num_layers = allocator.tokens_per_page, allocator.block_physical_stride, allocator.pages_per_block
    pages = -(-seq_lens // ps)
    table = np.zeros((len(seq_lens), max(int(pages.max(initial=1)), 1)), np.int32)
    for r, n in enumerate(pages):
        first_rows = rows[starts[r] + np.arange(n) * ps]
        table[r, :n] = (first_rows // stride) * num_layers  # pair index of layer 0's page of that block
    md = _metadata(query_lens, seq_lens, table, num_tokens=num_tokens)
    steps[allocator.index] = step = _PagedStep(ForwardContext(md))
    return step


def _paired_view(allocator, layer_idx: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """[M, 2, ps, Hkv, D] view of the cache: pair m = (block * L + 0)'s K and V pages of layer
    ``layer_idx``, shifted so one block table serves every layer of the allocator."""
    ps, num_layers = allocator.tokens_per_page, allocator.pages_per_block
    local = allocator.layer_indices.index(layer_idx)
    rows = allocator.cache_tensor.view(-1, num_kv_heads, head_size)  # [token rows, Hkv, D]
    num_pairs = rows.shape[0] // (2 * ps) - num_layers + 1
    start = 2 * local * ps
    return rows[start : start + num_pairs * 2 * ps].view(num_pairs, 2, ps, num_kv_heads, head_size)


def attn_stack_paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D], packed
    key: torch.Tensor,  # [1, Hkv, T, D]: the new tokens only
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature for continuous batching; returns ([1, T, Hq, D], None).

    Writes the new k/v into transformers' paged cache at ``write_index`` (in place), then
    attends over the cache through a zero-copy [M, 2, S, Hkv, D] view.
    """
    _check_dropout(module, dropout)
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{PAGED_ATTN_IMPLEMENTATION!r} runs host code every step and cannot be captured in a CUDA graph: "
            "call generate_batch inside use_attn_stack(model, paged=True), which turns the graphs off, or pass "
            "ContinuousBatchingConfig(use_cuda_graph=False)"
        )
    if cache is None:
        raise ValueError(
            f"{PAGED_ATTN_IMPLEMENTATION!r} serves transformers' continuous batching (generate_batch) and needs its "
            f"paged cache; use {ATTN_IMPLEMENTATION!r} (use_attn_stack(model)) for forward and generate"
        )
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            "transformers' decode fast path (block_table) is not supported; leave max_blocks_per_request unset"
        )
    layer_idx = module.layer_idx
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    missing = [a for a in _ALLOCATOR_ATTRS if not hasattr(allocator, a)]
    if missing:
        raise NotImplementedError(
            f"transformers {transformers.__version__}'s paged cache lacks {missing}: {PAGED_ATTN_IMPLEMENTATION!r} "
            "is written against transformers 5.23's PagedAttentionCache"
        )
    if allocator.layer_type != "full_attention":
        raise NotImplementedError(f"layer {layer_idx}: {allocator.layer_type} groups are not supported yet")
    _, num_q_heads, num_tokens, head_size = query.shape
    num_kv_heads = key.shape[1]
    step = _paged_step(cache, allocator, kwargs, num_tokens, first_layer=layer_idx == allocator.layer_indices[0])
    layer = _layer_for(module, "paged", query, key, _scaling(module, query, scaling), allocator.tokens_per_page)
    layer.kv_cache_layout = "paired"
    pairs = _paired_view(allocator, layer_idx, num_kv_heads, head_size)
    layer.kv_cache = [pairs]
    # The write transformers' own paged attention does: new rows into this layer's token views.
    k_rows, v_rows = allocator._kv_token_views[layer_idx]
    write_index = kwargs["write_index"][allocator.index]
    k_rows.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_rows.index_copy_(0, write_index, value[0].transpose(0, 1))
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    with use_forward_context(step.context):
        out = layer(q, None, None)
    return out.view(1, num_tokens, num_q_heads, head_size), None


register()  # attn_implementation="attn_stack" works once this module is imported
