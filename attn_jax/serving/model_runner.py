"""The model runner: everything on the device side of a serving step (vLLM v1's
``GPUModelRunner``, backend-neutral).

It owns the weights, the paged KV caches, the previous call's sampled tokens (kept on
the device for the next decode's input), the step's host inputs (bucket-padded, built
column by column, packed into one int32 buffer: one upload), the jitted step (the
model's forward, the cache update with the caches donated, sampling; ``num_steps`` > 1
runs a multi-step decode as a ``lax.scan``), and the attention metadata, which it builds
through the model's ``AttentionGroup`` only. The engine's core hands it each shard's
``ScheduledBatch`` and gets back the dispatched call's sampled tokens, still on the
device. ``execute`` is ``prepare`` (host work only; ``PreparedCall.key`` names the
compiled step the call needs) then ``dispatch``; ``Engine.warmup`` (``warmup.py``) uses the
two halves to compile each distinct key once, inside ``preserving_page``.

Penalties (``SamplingParams``' presence / frequency / repetition) read per-request token
counts kept on the device, i32[R_max, V] (per data shard; 256 slots x 49,152 tokens is 50 MB):
a running request with penalties owns a row (its ``penalty_slot``, taken by the scheduler at
admission). Counts rather than each row's token history: the history would have to travel
with the inputs (the whole prompt, for repetition) and be rebuilt into counts every step,
while the table is updated in place. The sampled program (``PreparedCall.sampled``, which any
row with penalties selects, and which every call in which a request computes more than one
token runs: greedy rows are exact there) gathers its rows' counts, starts a newly admitted
request's over, adds the input tokens it must count (``marks``: the prompt's, and a
recomputed request's generated ones; the step's own sampled tokens are added as they are
sampled, in every step of a multi-step call) and writes the rows back; the greedy program
(decode calls of greedy rows, with no request asking for log-probabilities) hands the table
through untouched (donated, so no copy): such calls pay nothing, and no program is added.
Continued decode calls (``continue_decode``) reuse inputs with nothing to mark and no row
starting over, so they need nothing more.

Structured outputs (``structured_output.py``) keep a token mask per guided request on the
device beside the counts, i32[R_max, ceil(V / 32)] (per data shard; 256 slots x 1,536 words is
1.5 MB): a guided request owns a row (its ``guide_slot``, taken by the scheduler at admission),
which the engine writes after reading back the request's last token (``write_guide_rows``: one
small program of ``GUIDE_ROWS_PER_WRITE`` rows, compiled once), and every step program sets the
logits its grammar forbids to -inf before its argmax or sampler (``sampling.apply_guides``; rows
without a guide unchanged, and a greedy guided row needs no sampler). A guided request takes one
step of a call.

Example::

    runner = ModelRunner(model, params, num_blocks=64, buckets=buckets, max_rows=8)
    rows = {r: ModelRunner.request_row(r, n, {}) for r, n in zip(batch.requests, batch.num_new)}
    call = runner.execute([batch], rows, [[1] * len(batch.requests)], num_steps=1)
    tokens = runner.read_tokens(call.tokens)          # i32[data, num_steps, R_max]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
from attn_jax.models.base import ServingModel
from attn_jax.platforms import is_cuda
from attn_jax.serving.cascade import CascadeConfig, common_prefix_len
from attn_jax.serving.executable_cache import ExecutableCache
from attn_jax.serving.layer_buffers import model_layout, pack_layers, unpack_copy, unpack_layer
from attn_jax.serving.sampling import (
    PROMPT_SEEN,
    apply_guides,
    apply_penalties,
    pack_scores,
    sample_tokens,
    token_logprobs,
    unpack_scores,
)
from attn_jax.serving.scheduler import Request, ScheduledBatch, wants_prompt_logprobs
from attn_jax.serving.step_inputs import PackedLayout, leaf_offsets, pack, repack, unpack
from attn_jax.serving.structured_output import mask_words
from attn_jax.sharding import ShardedStep
from attn_jax.types import SEED_LIMIT


@dataclasses.dataclass(frozen=True)
class DispatchedCall:
    """A jitted call that has been enqueued; its tokens may not be computed yet."""

    tokens: jax.Array  # i32[K, R_max] (or [data, K, R_max]): each step's and request row's sampled token
    # The tokens with their log-probabilities, ``sampling.pack_scores``' i32[.., K, R_max, 2 + 2L]; None
    # when no request of the call asks for them (every sampled program computes them; only these are copied).
    scores: jax.Array | None
    num_steps: int  # K
    token_bucket: int  # the padded token count
    compiled: bool  # the call traced and compiled a new bucket
    dispatch_start: float  # time.perf_counter() before the jitted call
    dispatch_end: float  # ... and when it returned (the step enqueued, not run)
    ready_at: float | None  # dispatch_end if the tokens were computed by then (a runtime that ran it
    # inside the call), else None: known when they are read back
    cascade_prefix_len: int = 0  # tokens cascade attention read once for the batch (the largest shard's); 0: off
    # A call with prompt log-probabilities (``PreparedCall.prompt_logprobs``): ``pack_scores`` of each
    # token row's next prompt token, i32[.., T, 2 + 2L]; else None.
    prompt_scores: jax.Array | None = None


NO_INDEX = np.iinfo(np.int32).max
"""A page delta's index that writes nothing (out of every buffer's bounds: dropped)."""

GUIDE_ROWS_PER_WRITE = 8
"""Mask rows one ``ModelRunner.write_guide_rows`` program writes (more are written in turns)."""


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBatch:
    """A call of decodes only (one step or several) whose input tokens are all the previous
    call's outputs in their own rows (the persistent batch): the next call continues it when
    it holds the same requests in the same rows with the same steps, each as many tokens on
    as it took steps (``ModelRunner.continue_decode``)."""

    requests: list[Request]  # each row's request
    steps: list[int]  # each request's steps in the call (one new token each)
    pages: np.ndarray  # i32[rows]: each request's pages when dispatched
    prefix_len: int  # the call's cascade prefix (tokens; 0: none)
    # Where the block table (offset, width) and the slot mapping (offset) lie in the packed buffer;
    # None: the call's pages may not change (another copy of the table, cascade's, holds them too).
    table: tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class PreparedCall:
    """A call's packed host inputs, not dispatched yet (``ModelRunner.prepare``)."""

    packed: list  # each data shard's (i32[n] buffer, PackedLayout); one layout for all
    num_steps: int  # K
    token_bucket: int
    cascade_prefix_len: int  # the largest shard's; 0: no cascade attention
    # The program that samples (``sampling.py``), keeps the token counts and computes the
    # log-probabilities: a row samples (temperature > 0) or has penalties, a request asks for
    # log-probabilities, or a request computes more than one token in the call (a prompt chunk). A
    # decode call of greedy rows without penalties or log-probabilities runs an argmax alone: the
    # sampler costs 0.12-0.32 ms a step over it at 64-256 rows on an H200
    # (``benchmarks/sampling_cost.py``), the log-probabilities alone 36-88 us at 1-256 rows (stop
    # 74), and decode calls are the steps that set the pace. A call
    # with a prompt chunk samples whatever its rows ask (greedy rows are exact there), so each of
    # its buckets has one program, not a greedy and a sampled twin; the sampler adds about 12 % to
    # such a call's device time at 256 rows, hidden behind its host work (BENCHMARKS.md, stops
    # 72-73).
    sampled: bool = False
    # A decode call the next one may continue, one ``DecodeBatch`` per data shard; None: other calls.
    decode: tuple[DecodeBatch, ...] | None = None
    # i32[data, 2, 2 * R_max]: each shard's (buffer index, value) pairs written before the step; None: none.
    page_delta: np.ndarray | None = None
    # A request wants prompt log-probabilities of this call's tokens: the packed inputs hold each token
    # row's next prompt token (``prompt_targets``, so the layout, and the key, differ) and the program
    # computes every token row's logits (always a sampled program).
    prompt_logprobs: bool = False
    # A request asks for its tokens' log-probabilities: the call samples (above) and copies them to the host.
    logprobs: bool = False

    @property
    def key(self) -> tuple:
        """What selects the compiled step: (layout, num_steps, sampled). Sampling values
        never do; whether the call samples does (``sampled``: decode calls of greedy rows skip
        the sampler); a call with prompt log-probabilities has a layout of its own
        (``prompt_targets``, in the largest token bucket)."""
        return (self.packed[0][1], self.num_steps, self.sampled)

    def describe(self) -> str:
        """The key in words (a log line's): the call's counts, then the packed inputs' tree
        (the attention metadata's static fields: block sizes, the kernels' split) and leaves."""
        layout = self.packed[0][1]
        sampling = "sampled" if self.sampled else "greedy"
        return (
            f"{self.token_bucket} tokens, {self.num_steps} step(s), {sampling}, cascade prefix "
            f"{self.cascade_prefix_len}, prompt logprobs {self.prompt_logprobs}; {layout.treedef}; {layout.leaves}"
        )


def _on_host(x: jax.Array, ndim: int) -> np.ndarray:
    """A call's output on the host (waits for it) with a leading data axis: one device's,
    of rank ``ndim``, gets one of 1; a mesh's (gathered over "data") has it."""
    out = np.asarray(x)
    return out[None] if out.ndim == ndim else out


def _write_guide_rows(table, index, rows):
    """``table`` i32[(data,) R_max, W] with ``rows`` i32[G, W] written at ``index`` i32[G] (a
    flat (shard, row) index: shard * R_max + row; out of bounds: dropped)."""
    flat = table.reshape(-1, table.shape[-1]).at[index].set(rows, mode="drop")
    return flat.reshape(table.shape)


CUBLAS_MIN_TOKENS = 256
"""Token buckets from which a CUDA step program's dots run on cuBLAS (``step_compiler_options``)."""


def step_compiler_options(device, token_bucket: int) -> dict[str, bool] | None:
    """XLA options a step program of ``token_bucket`` tokens compiles with on ``device``'s
    platform (a ``jax.Device``); None: XLA's defaults. On CUDA (``platforms.is_cuda``), from
    ``CUBLAS_MIN_TOKENS`` tokens, its dots run on cuBLAS rather than as Triton GEMM fusions
    (``xla_gpu_enable_triton_gemm=False``): XLA then autotunes no Triton tilings, so they
    compile a quarter faster, and batch-256 decode steps ran 9 % faster. Below, Triton's fused
    GEMMs stay: cuBLAS made batch-1 steps 11 % slower and batch-64 one-step calls slower
    (BENCHMARKS.md, "cuBLAS dots from 256 tokens"). An ``XLA_FLAGS`` that names the flag decides."""
    if token_bucket < CUBLAS_MIN_TOKENS or not is_cuda(device):
        return None
    if "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_gpu_enable_triton_gemm": False}


STATIC_STEP_ARGS = (4, 5, 6)
"""The jitted step's static arguments (layout, steps, sampled): ``_step_args``' positions (one
device's step and a mesh's, ``ShardedStep.global_step``, are jitted alike)."""

DONATED_STEP_ARGS = (1, 2, 3)
"""The jitted step's donated arguments (caches, the rows' state, the packed inputs): the
outputs that follow from them take their buffers, so a call that continues the last one's
decode batch finds its packed inputs where the last call left them. Every argument or output
at a new address makes XLA update the step's recorded CUDA graph before it launches it; the
packed inputs' were two of the four a continued call changed (BENCHMARKS.md, stop 59)."""


def _dynamic(step_args: tuple) -> tuple:
    """The step's arguments without its static ones: what a compiled program takes."""
    return tuple(a for i, a in enumerate(step_args) if i not in STATIC_STEP_ARGS)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write_pages(cache, pages, values, axis: int):
    """``cache`` with ``values`` written at ``pages`` along ``axis``, in place (donated)."""
    return cache.at[(slice(None),) * axis + (pages,)].set(values)


def kv_cache_bytes_per_block(model: ServingModel) -> int:
    """Bytes of one KV cache page over every layer (any cache pytree, fp8 scales included)."""
    shapes = jax.eval_shape(lambda: model.init_kv_caches(1))
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def _scatter_rows(out: np.ndarray, offsets: np.ndarray, rows: Sequence[Sequence[int]]) -> None:
    """Writes each list ``rows[i]`` into the flat view of ``out`` from ``offsets[i]`` on,
    with one NumPy call for all of them."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    total = int(lengths.sum())
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, total)
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out.reshape(-1)[np.repeat(offsets, lengths) + within] = flat


class ModelRunner:
    """Device state and the jitted step of one engine.

    Args:
      model: a ``ServingModel`` (``LlamaModel``); its ``attention_group`` builds the metadata.
      params: its weights (NumPy or jax arrays).
      num_blocks: KV cache pages (per data shard).
      buckets: padded sizes of the step's shapes (tokens, requests, pages per request).
      mesh: a ``make_mesh`` mesh to shard the step over (a model ``ShardedStep`` knows:
        ``LlamaModel``); None: one device.
      cascade: when the attention group may run cascade attention (``CascadeConfig``;
        default: whenever its builder says it pays).
    """

    def __init__(
        self, model: ServingModel, params, *, num_blocks: int, buckets: MetadataBuckets, mesh=None,
        cascade: CascadeConfig | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.cascade = CascadeConfig() if cascade is None else cascade
        self.attention_group = model.attention_group
        self.block_size = self.attention_group.block_size
        self.buckets = buckets
        self.max_rows = buckets.request_buckets[-1]  # the sampled-token buffer's length
        self._sharded = None if mesh is None else ShardedStep(model, mesh)
        device = (jax.devices() if mesh is None else mesh.devices.flat)[0]
        narrow, wide = (step_compiler_options(device, tokens) for tokens in (0, CUBLAS_MIN_TOKENS))
        self.num_shards = 1 if self._sharded is None else self._sharded.data_size
        vocab = model.config.vocab_size
        # A layer's [out, in] matrices that end in H in one buffer (``layer_buffers``: fewer
        # arguments a call), where the model names them and no model axis splits them.
        self._layer_layout = model_layout(model, params)
        if self._layer_layout is not None:
            params = {**params, "layers": pack_layers(params["layers"], self._layer_layout)}
        if self._sharded is None:
            self.step_params = jax.device_put(params)
            self.kv_caches = model.init_kv_caches(num_blocks)
            step = self._device_step
            self._last_tokens = jnp.zeros(self.max_rows, jnp.int32)
            self._token_counts = jnp.zeros((self.max_rows, vocab), jnp.int32)
            self._guide_masks = jnp.zeros((self.max_rows, mask_words(vocab)), jnp.int32)
            self._jit_write_guides = jax.jit(_write_guide_rows, donate_argnums=0)
        else:
            self.step_params = self._sharded.put_params(params)
            self.kv_caches = self._sharded.init_kv_caches(num_blocks)
            step = self._sharded.global_step(self._device_step)
            self._last_tokens = self._sharded.zeros_per_shard(self.max_rows)
            self._token_counts = self._sharded.zeros_per_shard(self.max_rows, vocab)
            self._guide_masks = self._sharded.zeros_per_shard(self.max_rows, mask_words(vocab))
            self._jit_write_guides = jax.jit(
                _write_guide_rows, donate_argnums=0, out_shardings=self._guide_masks.sharding
            )
        jit = functools.partial(jax.jit, step, donate_argnums=DONATED_STEP_ARGS, static_argnums=STATIC_STEP_ARGS)
        self._jit_step = jit(compiler_options=narrow)
        self._jit_step_wide = self._jit_step if wide == narrow else jit(compiler_options=wide)
        no_delta = np.full((self.num_shards, 2, 2 * self.max_rows), NO_INDEX, np.int32)
        self._no_page_delta = jax.device_put(no_delta[0]) if self._sharded is None else self._put_delta(no_delta)
        self.num_blocks = num_blocks
        # The last dispatched call, when a decode batch, and its inputs one step on, computed on
        # the device: the next call continues from them when it is that batch a token later.
        self._decode_chain: tuple[PreparedCall, jax.Array] | None = None
        self._table_slots: dict = {}  # PackedLayout -> ``DecodeBatch.table``
        self.num_compilations = 0
        self.dispatched_keys: set[tuple] = set()  # ``PreparedCall.key`` of every call dispatched so far
        self._loaded: dict[tuple, object] = {}  # key -> program loaded from an ``ExecutableCache`` (not jit's)
        self._exact_buckets: dict[tuple[int, int, int], MetadataBuckets] = {}  # one per bucket combination

    @property
    def _chains_decodes(self) -> bool:
        """Whether one-step decode calls hand their next inputs on (the decode chain): an
        attention group that advances its metadata (on a mesh too: each data shard's inputs)."""
        return self.supports_decode_advance

    def _put_delta(self, delta: np.ndarray) -> jax.Array | np.ndarray:
        """A page delta i32[data, 2, 2 * R_max] for the step: one device's is its only row, left
        on the host for the jitted call to upload with its other arguments (a ``device_put`` of
        its own cost 0.3 ms on an H200 host); a mesh's is split over "data" (each process
        uploads its own shards' rows)."""
        return delta[0] if self._sharded is None else self._sharded.put_per_shard(delta)

    @property
    def params(self):
        """The weights on the device in the model's layout (``fuse_params``'). The step takes
        ``step_params``, each layer's matrices in one buffer where ``layer_buffers`` packs them;
        then these are copies sliced out of them, made at each read."""
        if self._layer_layout is None:
            return self.step_params
        layers = [unpack_copy(layer, self._layer_layout) for layer in self.step_params["layers"]]
        return {**self.step_params, "layers": layers}

    @property
    def supports_decode_advance(self) -> bool:
        """Whether a call may run several decode steps (the group's metadata advances)."""
        return self.attention_group.supports_decode_advance

    # ------------------------------------------------------------------ host inputs

    @staticmethod
    def request_row(request: Request, num_new: int, rows_of_pending: dict[Request, int]) -> tuple:
        """One request's part of the step: (known input token ids, the row of its pending
        token in the previous call's output or -1, (temperature, top_p, top_k, seed,
        tokens generated, presence, frequency and repetition penalties, its token-count
        slot or -1, 1 when that slot starts over, how many of the known ids the step counts
        as prompt tokens, and after them as generated ones, its guide mask's row or -1));
        ``rows_of_pending`` maps a request to that row. Raises for a request whose values do not fit the step's
        arrays (a seed outside [0, 2**32), say), so the core can fail it alone."""
        # A decode with a pending token (most rows of a batch-256 call) knows none of its input.
        pending = num_new == 1 and request.num_pending > 0
        known = [] if pending else request.known_ids(request.num_computed, request.num_computed + num_new)
        src = -1
        if len(known) < num_new:  # the last token is the previous step's, still on the device
            src = rows_of_pending.get(request, -1)
            if src < 0:
                raise RuntimeError("its last token is pending but in no dispatched step")
        p = request.params
        if not 0 <= request.seed < SEED_LIMIT:
            raise OverflowError(f"seed={request.seed} does not fit the step's arrays: it must be in [0, {SEED_LIMIT})")
        if not 0 <= p.top_k < 2**31:
            raise OverflowError(f"top_k={p.top_k} does not fit the step's arrays: it must be in [0, {2**31})")
        values = (p.temperature, p.top_p, p.top_k, request.seed, request.num_generated)
        slot, guide = request.penalty_slot, request.guide_slot
        if slot < 0:
            return known, src, (*values, 0.0, 0.0, 1.0, -1, 0, 0, 0, guide)
        # Its known ids before ``num_counted_inputs`` are counted here (the prompt's as such),
        # the later ones were counted when sampled; its first call after admission starts over.
        start, counted = request.num_computed, request.num_counted_inputs
        num_prompt = min(max(min(counted, len(request.prompt_ids)) - start, 0), len(known))
        num_generated = min(max(counted - start, 0), len(known)) - num_prompt
        fresh = int(start == request.num_cached_tokens)
        penalties = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        return known, src, (*values, *penalties, slot, fresh, num_prompt, num_generated, guide)

    def cascade_prefix_lens(
        self, batches: Sequence[ScheduledBatch], num_common_blocks: Sequence[int] | None
    ) -> list[int]:
        """Each shard's cascade prefix (tokens; 0: no cascade attention) from its running
        requests' ``num_common_blocks`` shared pages (``cascade.num_common_prefix_blocks``;
        None: none counted):
        ``cascade.common_prefix_len`` of the shard's batch, kept when the attention group's
        builder says cascade pays (``CascadeConfig``'s thresholds; a builder may weigh the
        requests' lengths too, PALLAS_GPU's for float32). Every shard's metadata has
        one structure, so cascade attention runs only when every shard takes it; and only in
        calls of decodes only: cascade is a metadata structure of its own, so allowing it in
        prefill and mixed calls would double their programs, for steps whose time is mostly
        the new tokens' compute rather than the shared prefix's reads."""
        config = self.cascade
        if num_common_blocks is None or not config.enabled or not any(num_common_blocks):
            return [0] * len(batches)
        if any(n != 1 for b in batches for n in b.num_new):
            return [0] * len(batches)
        thresholds = dict(
            min_prefix_len=config.min_prefix_len, min_requests=config.min_requests,
            performance_model=config.performance_model,
        )  # fmt: skip
        lens = []
        for batch, blocks in zip(batches, num_common_blocks, strict=True):
            computed = [r.num_computed for r in batch.requests]
            prefix = common_prefix_len(blocks, self.block_size, computed)
            seq_lens = [c + n for c, n in zip(computed, batch.num_new, strict=True)]
            lens.append(self.attention_group.cascade_prefix_len(prefix, batch.num_new, seq_lens=seq_lens, **thresholds))
        return lens if all(lens) else [0] * len(batches)

    def _host_inputs(
        self, batch: ScheduledBatch, rows: dict[Request, tuple], buckets, step_query_lens, decode_steps: list[int],
        prefix_len: int = 0, prompt_logprobs: bool = False,
    ) -> dict:  # fmt: skip
        """One shard's batch as a tree of NumPy arrays, padded to ``buckets`` (tokens,
        requests, pages per request); ``rows`` holds each request's ``request_row``,
        ``decode_steps`` its steps in this call and ``prefix_len`` its cascade prefix (0:
        none). Built column by column (one NumPy call per array, not per request).
        ``prompt_logprobs``: add ``prompt_targets`` i32[T], each token row's next prompt token
        for requests that ask for prompt log-probabilities (0 elsewhere: not read)."""
        token_bucket, req_bucket, page_bucket = buckets
        reqs = batch.requests
        n = len(reqs)
        known, src, values = zip(*(rows[r] for r in reqs), strict=True) if n else ((), (), ())
        query_lens = np.asarray(batch.num_new, np.int32)
        starts = np.fromiter((r.num_computed for r in reqs), np.int32, n)
        ends = np.cumsum(query_lens, dtype=np.int32)
        num_tokens = int(ends[-1]) if n else 0

        block_table = np.zeros((n, page_bucket), np.int32)
        _scatter_rows(block_table, np.arange(n) * page_bucket, [r.blocks for r in reqs])
        token_ids = np.zeros(token_bucket, np.int32)
        _scatter_rows(token_ids, ends - query_lens, known)
        token_src = np.full(token_bucket, -1, np.int32)
        src = np.asarray(src, np.int32)
        token_src[ends[src >= 0] - 1] = src[src >= 0]
        positions = np.zeros(token_bucket, np.int32)
        positions[:num_tokens] = np.arange(num_tokens, dtype=np.int32) - np.repeat(
            ends - query_lens - starts, query_lens
        )
        num_rows = min(req_bucket, token_bucket)  # logits and sampling rows: at most one request per token
        logits_rows = np.zeros(num_rows, np.int32)
        logits_rows[:n] = ends - 1
        steps = np.zeros(num_rows, np.int32)
        steps[:n] = decode_steps
        columns = np.zeros((13, num_rows), np.float64)  # exact for every value in range
        columns[[1, 7]] = 1.0  # top_p, repetition penalty: off
        columns[[8, 12]] = -1  # no token-count slot, no guide
        columns[:, :n] = np.asarray(values, np.float64).reshape(n, 13).T
        marks = np.full(token_bucket, -1, np.int32)  # per token: 2 * row + 1 if generated, counted; -1: not
        for i in np.flatnonzero(columns[10, :n] + columns[11, :n]).tolist():  # rows counting their inputs
            first, num_prompt, num_generated = int(ends[i] - query_lens[i]), int(columns[10, i]), int(columns[11, i])
            marks[first : first + num_prompt] = 2 * i
            marks[first + num_prompt : first + num_prompt + num_generated] = 2 * i + 1
        exact = self._exact_buckets.get(buckets)
        if exact is None:  # built (and validated) once per combination, not per step
            exact = self._exact_buckets[buckets] = MetadataBuckets(*((b,) for b in buckets))
        md = build_common_attn_metadata(query_lens, starts + query_lens, block_table, self.block_size, exact)
        md = self.attention_group.build_for_jit(md, step_query_lens=step_query_lens, common_prefix_len=prefix_len)
        extra = {}
        if prompt_logprobs:
            targets = np.zeros(token_bucket, np.int32)
            for i, r in enumerate(reqs):
                if r.params.prompt_logprobs is not None:
                    first, start = int(ends[i] - query_lens[i]), int(starts[i])
                    nxt = r.prompt_ids[start + 1 : start + 1 + int(query_lens[i])]
                    targets[first : first + len(nxt)] = nxt
            extra["prompt_targets"] = targets
        return dict(
            **extra,
            token_ids=token_ids, token_src=token_src, positions=positions, md=md, logits_rows=logits_rows,
            decode_steps=steps, marks=marks,
            sampling=dict(
                temperature=columns[0].astype(np.float32), top_p=columns[1].astype(np.float32),
                top_k=columns[2].astype(np.int32), seeds=columns[3].astype(np.uint32),
                counters=columns[4].astype(np.int32), penalties=columns[5:8].astype(np.float32),
                slots=columns[8:10].astype(np.int32), guides=columns[12].astype(np.int32),
            ),
        )  # fmt: skip

    # ------------------------------------------------------------------ the call

    def prepare(
        self, batches: list[ScheduledBatch], rows: dict[Request, tuple], steps: list[list[int]], num_steps: int,
        num_common_blocks: Sequence[int] | None = None,
    ) -> PreparedCall:  # fmt: skip
        """Builds and packs every shard's inputs (one bucket for all) for one call of
        ``num_steps`` steps (``steps``: each request's steps in it; ``rows``: each request's
        ``request_row`` by request; ``num_common_blocks``: each shard's pages every running
        request holds, for cascade attention, None: none). Host work only: nothing is
        dispatched, and ``PreparedCall.key`` says which compiled step it needs.

        A call with a prefill pads its requests to the token bucket (up to the largest
        request bucket): its token count does not tell how many requests share it, so
        without this every (token bucket, request bucket) pair is a shape of its own
        (``serve_load.py``'s limits on PALLAS_GPU: 170 shapes without it, 70 with it,
        BENCHMARKS.md). Padded requests have no tokens: a few empty rows
        of metadata, logits and sampling. Decode-only calls keep the exact bucket.

        The call is a ``DecodeBatch`` per data shard (the next call may continue it,
        ``continue_decode``) when it is one step of decodes only, each input token the
        previous call's output in the request's own row. ``num_steps`` > 1 needs decodes only,
        without prompt log-probabilities (ValueError)."""
        prefix_lens = self.cascade_prefix_lens(batches, num_common_blocks)
        fits = MetadataBuckets.fit
        token_bucket = fits(self.buckets.token_buckets, max(b.num_tokens for b in batches), "num_tokens")
        prompt = any(wants_prompt_logprobs(r) for b in batches for r in b.requests)
        if prompt:  # the largest token bucket and the widest table: one program per batch kind
            token_bucket = self.buckets.token_buckets[-1]
        num_reqs = max(len(b.requests) for b in batches)
        prefills = any(max(b.num_new, default=0) > 1 for b in batches)
        if num_steps > 1 and (prefills or prompt):  # the later steps advance decode metadata
            raise ValueError(
                f"num_steps={num_steps} needs a batch of decodes only (one new token a request, no prompt "
                f"log-probabilities); got new tokens {[list(b.num_new) for b in batches]}, prompt logprobs {prompt}"
            )
        if prefills:  # see the docstring: one request bucket per token bucket
            num_reqs = max(num_reqs, min(token_bucket, self.buckets.request_buckets[-1]))
        req_bucket = fits(self.buckets.request_buckets, num_reqs, "num_reqs")
        pages = max((len(r.blocks) for b in batches for r in b.requests), default=1)
        page_bucket = fits(self.buckets.blocks_per_request_buckets, pages, "blocks per request")
        step_query_lens = np.concatenate([np.asarray(b.num_new, np.int32) for b in batches])
        if prompt:
            page_bucket = self.buckets.blocks_per_request_buckets[-1]
        buckets = (token_bucket, req_bucket, page_bucket)
        inputs = [
            self._host_inputs(b, rows, buckets, step_query_lens, s, p, prompt)
            for b, s, p in zip(batches, steps, prefix_lens, strict=True)
        ]
        packed = [pack(x) for x in inputs]
        decode = self._decode_batch(batches, rows, steps, num_steps, prefix_lens, packed[0][1])
        logprobs = any(r.params.logprobs is not None for b in batches for r in b.requests)
        sampled = (
            prompt
            or prefills
            or logprobs
            or any(bool((x["sampling"]["temperature"] > 0).any()) for x in inputs)
            or any(r.params.has_penalties for b in batches for r in b.requests)
        )
        return PreparedCall(
            packed, num_steps, token_bucket, max(prefix_lens), sampled, None if prompt else decode,
            prompt_logprobs=prompt, logprobs=logprobs,
        )  # fmt: skip

    def _decode_batch(
        self, batches, rows, steps, num_steps: int, prefix_lens: list[int], layout
    ) -> tuple[DecodeBatch, ...] | None:
        """The call as a ``DecodeBatch`` per data shard, or None when the next call cannot
        continue it (see ``prepare``)."""
        if not self._chains_decodes or not any(b.requests for b in batches):
            return None
        table = self._table_slot(layout) if max(prefix_lens) == 0 else None
        decodes = []
        for batch, shard_steps, prefix_len in zip(batches, steps, prefix_lens, strict=True):
            reqs = batch.requests
            ones = [1] * len(reqs)
            if batch.num_new != ones or (num_steps == 1 and shard_steps != ones):
                return None
            for i, r in enumerate(reqs):
                known, src, _ = rows[r]
                if known or src != i:
                    return None
            pages = np.fromiter(map(len, (r.blocks for r in reqs)), np.int32, len(reqs))
            decodes.append(DecodeBatch(list(reqs), list(shard_steps), pages, prefix_len, table))
        return tuple(decodes)

    def _table_slot(self, layout: PackedLayout) -> tuple[int, int, int] | None:
        """Where the metadata's block table and slot mapping lie in ``layout``'s buffer:
        (table offset, table width, slot mapping offset); None when the metadata holds
        another copy of the table (cascade's shifted tables) or lacks either."""
        if layout not in self._table_slots:
            md = jax.tree.unflatten(layout.treedef, list(range(len(layout.leaves))))["md"]
            table, slots = getattr(md, "block_tables", None), getattr(md, "slot_mapping", None)
            found = None
            if isinstance(table, int) and isinstance(slots, int) and getattr(md, "cascade_suffix_tables", None) is None:
                offsets = leaf_offsets(layout)
                found = (offsets[table], layout.leaves[table][0][1], offsets[slots])
            self._table_slots[layout] = found
        return self._table_slots[layout]

    def continue_decode(
        self, batches: list[ScheduledBatch], steps: list[list[int]], num_steps: int,
        num_common_blocks: Sequence[int] | None = None,
    ) -> PreparedCall | None:  # fmt: skip
        """The next call built from the last one on the device (vLLM's persistent batch), or
        None: when the last call was a ``DecodeBatch`` and this one is the same requests in
        the same rows, each as many tokens on as it took steps, with the same steps, sampling
        values and cascade prefix, its inputs are the ones the last call computed (positions,
        metadata and sampling counters moved on by ``advance_decode``) with only the page a
        request gained written in (``page_delta``: its block table entry, and, when the
        call's first token opens it, that token's slot, the page's first, which
        ``advance_decode`` computed from the table before): no per-request host work, no
        upload but those pages. A batch-1 decode step's host metadata and upload were most
        of its host time; a mesh's multi-step call stacked every shard's inputs."""
        if self._decode_chain is None or len(batches) != self.num_shards:
            return None
        previous, next_packed = self._decode_chain
        if num_steps != previous.num_steps:
            return None
        prefix_lens = self.cascade_prefix_lens(batches, num_common_blocks)
        decodes, delta = [], None
        for shard, (decode, batch, shard_steps) in enumerate(zip(previous.decode, batches, steps, strict=True)):
            reqs = batch.requests
            if batch.num_new != [1] * len(reqs) or shard_steps != decode.steps:
                return None
            if reqs != decode.requests or prefix_lens[shard] != decode.prefix_len:
                return None
            pages = np.fromiter(map(len, (r.blocks for r in reqs)), np.int32, len(reqs))
            grown = np.flatnonzero(pages != decode.pages)
            if grown.size:
                if decode.table is None or (pages[grown] != decode.pages[grown] + 1).any():
                    return None
                offset, width, slots = decode.table
                if pages.max() > width:
                    return None
                new_pages = np.asarray([reqs[i].blocks[-1] for i in grown.tolist()], np.int32)
                if delta is None:
                    delta = np.full((self.num_shards, 2, 2 * self.max_rows), NO_INDEX, np.int32)
                delta[shard, :, : grown.size] = offset + grown * width + decode.pages[grown], new_pages
                # The first token's slot where it opens the page; a later step's is computed in the call.
                opens = np.fromiter((reqs[i].num_computed for i in grown.tolist()), np.int32, grown.size)
                opens = opens == decode.pages[grown] * self.block_size
                first_slots = np.where(opens, slots + grown, NO_INDEX)
                delta[shard, :, grown.size : 2 * grown.size] = first_slots, new_pages * self.block_size
            decodes.append(dataclasses.replace(decode, pages=pages))
        return dataclasses.replace(
            previous, packed=[(next_packed, previous.packed[0][1])], decode=tuple(decodes), page_delta=delta
        )

    def jit_for(self, prepared: PreparedCall):
        """The jitted step that runs ``prepared``: its token bucket picks the compiler options
        (``step_compiler_options``; one function where they are the same for every bucket)."""
        return self._jit_step_wide if prepared.token_bucket >= CUBLAS_MIN_TOKENS else self._jit_step

    def _step_args(self, prepared: PreparedCall) -> tuple:
        """The jitted step's arguments for a prepared call (the sharded step's inputs stacked
        over data shards)."""
        packed, num_steps, sampled = prepared.packed, prepared.num_steps, prepared.sampled
        rows = (self._last_tokens, self._token_counts, self._guide_masks)
        delta = self._no_page_delta if prepared.page_delta is None else self._put_delta(prepared.page_delta)
        if self._sharded is None or isinstance(packed[0][0], jax.Array):  # one device's, or continued (on the mesh)
            buffer, layout = packed[0]
        else:
            buffer, layout = self._sharded.stack_inputs(packed)
        return self.step_params, self.kv_caches, rows, buffer, layout, num_steps, sampled, delta

    def compile(self, prepared: PreparedCall, cache: ExecutableCache | None = None) -> tuple[float, float]:
        """Compiles ``prepared``'s program without running it (jit's lowering cache keeps it,
        so its first dispatch runs at once). Safe from several threads: XLA compiles outside
        the GIL, which is how ``warm_up`` compiles programs in parallel. With ``cache``: the
        program is loaded from it when stored there (no trace; the call then runs it), else
        compiled, stored and called as the loaded ones are. Returns the wall seconds spent
        tracing and lowering it (Python, under the GIL) and in XLA's compile (0, 0 when loaded)."""
        args = self._step_args(prepared)
        if cache is not None:
            loaded = cache.load(prepared.key, _dynamic(args))
            if loaded is not None:
                self._loaded[prepared.key] = loaded
                return 0.0, 0.0
        start = time.perf_counter()
        lowered = self.jit_for(prepared).lower(*args)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        seconds = (lowered_at - start, time.perf_counter() - lowered_at)
        if cache is not None:
            cache.store(prepared.key, compiled)
            # Called as the loaded ones are: jit would trace it again for arguments that a loaded
            # program returned (their types compare unequal to a jitted program's, same as they print).
            self._loaded[prepared.key] = compiled
        return seconds

    def dispatch(self, prepared: PreparedCall) -> DispatchedCall:
        """Enqueues a prepared call on the device; returns without waiting for it."""
        compilations = self.num_compilations
        args = self._step_args(prepared)
        start = time.perf_counter()
        loaded = self._loaded.get(prepared.key) if self._loaded else None
        outputs = self.jit_for(prepared)(*args) if loaded is None else loaded(*_dynamic(args))
        tokens, rows, self.kv_caches, next_packed, (scores, *prompt) = outputs
        prompt_scores = prompt[0] if prompt else None
        if not prepared.logprobs:
            scores = None
        self._decode_chain = None if prepared.decode is None else (prepared, next_packed)
        self._last_tokens, self._token_counts, self._guide_masks = rows
        end = time.perf_counter()
        self.dispatched_keys.add(prepared.key)
        ready = end if tokens.is_ready() else None
        for x in (tokens if scores is None else scores, prompt_scores):  # scores hold the tokens too
            if x is not None:
                x.copy_to_host_async()
        return DispatchedCall(
            tokens, scores, prepared.num_steps, prepared.token_bucket, self.num_compilations > compilations, start,
            end, ready,
            prepared.cascade_prefix_len, prompt_scores,
        )  # fmt: skip

    def execute(
        self, batches: list[ScheduledBatch], rows: dict[Request, tuple], steps: list[list[int]], num_steps: int,
        num_common_blocks: Sequence[int] | None = None,
    ) -> DispatchedCall:  # fmt: skip
        """``prepare`` then ``dispatch``: one jitted call of ``num_steps`` steps for these
        batches (the arguments are ``prepare``'s). Returns without waiting for the device."""
        return self.dispatch(self.prepare(batches, rows, steps, num_steps, num_common_blocks))

    def write_guide_rows(self, rows: Sequence[tuple[int, int]], masks: Sequence[np.ndarray]) -> None:
        """Writes guided requests' token masks into the device's table: ``rows`` each mask's
        (data shard, guide slot), ``masks`` i32[ceil(V / 32)] each; ``GUIDE_ROWS_PER_WRITE``
        at a time (padding dropped), by one program compiled once (``compile_guide_writes``)."""
        g = GUIDE_ROWS_PER_WRITE
        for start in range(0, len(rows), g):
            index, values = self._guide_write_inputs(rows[start : start + g], masks[start : start + g])
            self._guide_masks = self._jit_write_guides(self._guide_masks, index, values)

    def _guide_write_inputs(self, rows, masks) -> tuple[np.ndarray, np.ndarray]:
        """One write's (i32[G] flat row index, i32[G, W] masks), padded to
        ``GUIDE_ROWS_PER_WRITE`` rows with indices that write nothing."""
        index = np.full(GUIDE_ROWS_PER_WRITE, NO_INDEX, np.int32)
        values = np.zeros((GUIDE_ROWS_PER_WRITE, self._guide_masks.shape[-1]), np.int32)
        for i, ((shard, slot), mask) in enumerate(zip(rows, masks, strict=True)):
            index[i], values[i] = shard * self.max_rows + slot, mask
        return index, values

    def compile_guide_writes(self) -> None:
        """Compiles ``write_guide_rows``' program (the warm-up's), writing nothing."""
        self._jit_write_guides.lower(self._guide_masks, *self._guide_write_inputs([], [])).compile()

    # ------------------------------------------------------------------ scratch pages (warm-up)

    def _page_axes(self) -> list[int | None]:
        """Each cache leaf's page axis (the one that grows with ``num_blocks``; None: a leaf
        without pages, e.g. a scale)."""
        one, two = (jax.tree.leaves(jax.eval_shape(lambda n=n: self.model.init_kv_caches(n))) for n in (1, 2))
        axes = []
        for a, b in zip(one, two, strict=True):
            grown = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
            axes.append(grown[0] if grown else None)
        return axes

    @contextlib.contextmanager
    def preserving_page(self, page: int):
        """Inside, calls may write KV page ``page`` (of every data shard) and the sampled-token
        buffer freely: on exit both hold what they held before (a copy of one page per
        shard and cache leaf is kept meanwhile). The warm-up's dummy calls run inside."""
        if not 0 <= page < self.num_blocks:
            raise ValueError(f"page={page} is outside the cache's pages [0, {self.num_blocks})")
        pages = jnp.asarray([s * self.num_blocks + page for s in range(self.num_shards)], jnp.int32)
        axes = self._page_axes()
        leaves, treedef = jax.tree.flatten(self.kv_caches)
        saved = [jnp.copy(x) if a is None else jnp.take(x, pages, axis=a) for x, a in zip(leaves, axes, strict=True)]
        last_tokens = jnp.copy(self._last_tokens)
        try:
            yield
        finally:
            self._decode_chain = None  # the calls inside ran dummy batches

            # Sharded arrays go back to their shardings; one device's stay uncommitted, as the
            # step's own outputs are: either way the next call hits the compiled step's cache.
            def like(new, old):
                return new if self._sharded is None else jax.device_put(new, old.sharding)

            leaves = jax.tree.leaves(self.kv_caches)
            restored = [  # in place (donated): a layer's copy may not fit beside a cache sized to the device
                like(keep if a is None else _write_pages(x, pages, keep, a), x)
                for x, keep, a in zip(leaves, saved, axes, strict=True)
            ]
            self.kv_caches = jax.tree.unflatten(treedef, restored)
            self._last_tokens = like(last_tokens, self._last_tokens)

    @staticmethod
    def read_tokens(tokens: jax.Array) -> np.ndarray:
        """A call's sampled tokens on the host, i32[data, K, R_max] (waits for the call)."""
        return _on_host(tokens, 2)

    @staticmethod
    def read_scores(scores: jax.Array, ndim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A call's ``DispatchedCall.scores`` (``ndim`` 2, each step's and row's) or
        ``prompt_scores`` (``ndim`` 1, each token row's) on the host (waits for the call), as
        ``unpack_scores``' four arrays, each with a leading data axis: i32[data, ...] the
        tokens, f32[data, ...] their log-probabilities, i32[data, ..., L] the likeliest tokens,
        f32[data, ..., L] theirs."""
        return unpack_scores(_on_host(scores, ndim + 1))

    def _device_step(
        self, params, kv_caches, rows, packed, layout: PackedLayout, num_steps: int, sampled: bool,
        page_delta=None,
    ):  # fmt: skip
        """Traced once per (layout, steps, sampled), whatever the sampling values: forward
        and sampling (with ``sampled`` False every row is greedy: an argmax), ``num_steps``
        times (with several, every step a decode, each later one's input the request's
        previous token).

        ``rows`` is the device's per-row state: (i32[R_max] the previous call's last sampled
        tokens, i32[R_max, V] the penalties' token counts by slot, i32[R_max, ceil(V / 32)]
        the guided requests' token masks by slot); rows whose ``token_src`` is >= 0 take their
        input token from the first. A sampled call applies each row's penalties from its
        slot's counts; every call applies each guided row's mask (the masks are only read);
        a greedy call has no row with penalties and hands the counts back untouched
        (donated: no copy).
        Returns (i32[num_steps, R_max] sampled tokens, ``rows`` after the call, caches, i32[n]
        packed inputs, scores: a tuple of the tokens with their log-probabilities,
        ``pack_scores``' i32[num_steps, R_max, 2 + 2L] (a sampled call's; None: a greedy one's), and with
        ``prompt_targets`` (one step, sampled) the prompt's, i32[T, 2 + 2L] per token row); the
        packed inputs are the call's moved on by each request's steps (with an attention group
        that advances its metadata, else ``packed`` itself), which the next call reuses when it
        is the same decode batch that many tokens later (``continue_decode``). ``page_delta``
        i32[2, 2 * R_max]: (buffer index, value) pairs written into ``packed`` first, the pages
        a continued call's requests gained (index ``NO_INDEX``: none)."""
        self.num_compilations += 1
        if self._layer_layout is not None:
            params = {**params, "layers": [unpack_layer(layer, self._layer_layout) for layer in params["layers"]]}
        last_tokens, all_counts, guide_masks = rows
        if page_delta is not None:
            packed = packed.at[page_delta[0]].set(page_delta[1], mode="drop")
        x = unpack(packed, layout)
        s, md = x["sampling"], x["md"]
        num_rows = x["logits_rows"].shape[0]
        max_rows = self.max_rows

        def pad(a):  # rows -> R_max
            return jnp.pad(a, [(0, max_rows - num_rows)] + [(0, 0)] * (a.ndim - 1))

        limits = x["decode_steps"]  # i32[R]: steps each request takes (0 for padding rows)
        token_ids = jnp.where(x["token_src"] >= 0, last_tokens[jnp.maximum(x["token_src"], 0)], x["token_ids"])
        slots, fresh = s["slots"]  # i32[R] each row's token-count slot (-1: no penalties), 1: it starts over
        counts = None
        if sampled:  # the rows' counts, started over where fresh, with the inputs' counted tokens added
            counts = jnp.where(((slots >= 0) & (fresh == 0))[:, None], all_counts[jnp.maximum(slots, 0)], 0)
            marks = x["marks"]
            row = jnp.where(marks >= 0, marks >> 1, num_rows)  # out of bounds: dropped
            # The prompt's first: a slot's generated counts are 0 while its prompt is counted.
            generated = (marks & 1) == 1
            counts = counts.at[jnp.where(generated, num_rows, row), token_ids].max(PROMPT_SEEN, mode="drop")
            counts = counts.at[jnp.where(generated, row, num_rows), token_ids].add(1, mode="drop")

        prompt_out = None

        def forward(kv_caches, token_ids, positions, md, counters, counts, active, targets=None):
            """(i32[R_max] tokens, their log-probabilities or None, caches, the counts with the
            ``active`` bool[R] rows' new tokens added); with ``targets`` (each token row's next
            prompt token) every token row's logits are computed, and their prompt
            log-probabilities set in ``prompt_out``."""
            nonlocal prompt_out
            if targets is None:
                logits, kv_caches = self.model.step(params, kv_caches, token_ids, positions, md, x["logits_rows"])
            else:
                every = jnp.arange(targets.shape[0], dtype=jnp.int32)
                logits, kv_caches = self.model.step(params, kv_caches, token_ids, positions, md, every)
                prompt_out = pack_scores(targets, *token_logprobs(logits, targets))
                logits = logits[x["logits_rows"]]
            raw = apply_guides(logits, guide_masks, s["guides"])  # what the log-probabilities are of
            if not sampled:  # an argmax alone: no request of the call asks for log-probabilities
                return pad(jnp.argmax(raw, axis=-1).astype(jnp.int32)), None, kv_caches, counts
            presence, frequency, repetition = s["penalties"]
            logits = apply_penalties(raw, counts, presence, frequency, repetition)
            tokens = sample_tokens(logits, s["temperature"], s["top_p"], s["top_k"], s["seeds"], counters)
            counts = counts.at[jnp.arange(num_rows), tokens].add(active.astype(jnp.int32))
            return pad(tokens), pad(pack_scores(tokens, *token_logprobs(raw, tokens))), kv_caches, counts

        def store(counts):
            """The device's counts with these rows' written back to their slots."""
            if counts is None:
                return all_counts
            return all_counts.at[jnp.where(slots >= 0, slots, max_rows)].set(counts, mode="drop")

        token_rows = jnp.arange(x["token_ids"].shape[0])
        token_req = jnp.minimum(token_rows, num_rows - 1)  # a decode batch's token r is request r's
        group = self.attention_group

        def moved(steps, active):
            """A decode batch's positions, metadata and sampling counters ``steps`` i32[rows] tokens
            on (the metadata's requests past the rows, padding, stay)."""
            positions = x["positions"] + jnp.where(token_rows < num_rows, steps[token_req], 0)
            widths = (0, md.seq_lens.shape[0] - num_rows)  # rows -> the metadata's requests
            next_md = group.advance_decode(md, jnp.pad(steps, widths), jnp.pad(active, widths))
            return positions, next_md, s["counters"] + steps

        next_packed = packed
        if self._chains_decodes:  # the next call's inputs, each request as many tokens on as it took steps
            positions, next_md, counters = moved(limits, limits > 0)
            later = dict(x, positions=positions, md=next_md, sampling=dict(s, counters=counters))
            next_packed = repack(packed, layout, x, later)
        if num_steps == 1:
            tokens, scores, kv_caches, counts = forward(
                kv_caches, token_ids, x["positions"], md, s["counters"], counts, limits > 0, x.get("prompt_targets")
            )
            prompt = () if prompt_out is None else (prompt_out,)
            scores = None if scores is None else scores[None]
            return tokens[None], (tokens, store(counts), guide_masks), kv_caches, next_packed, (scores, *prompt)

        # Every step of a multi-step call (a decode batch: ``prepare`` checks) is one scan step, the
        # first's inputs the call's own tokens and metadata (``moved`` by 0 steps): the program holds
        # the model once, where a first step unrolled beside the scan's body held it twice (twice
        # the HLO, 1.3-2.1x the compile time on a CPU: BENCHMARKS.md, stop 68).
        def decode(carry, step):
            kv_caches, last, counts = carry
            steps = jnp.clip(jnp.minimum(step, limits - 1), 0)
            active = step < limits
            inputs = jnp.where(step == 0, token_ids, last[jnp.minimum(token_rows, max_rows - 1)])
            positions, step_md, counters = moved(steps, active)
            new, new_scores, kv_caches, counts = forward(
                kv_caches, inputs, positions, step_md, counters, counts, active
            )
            last = jnp.where(jnp.pad(active, (0, max_rows - num_rows)) | (step == 0), new, last)
            return (kv_caches, last, counts), (new, new_scores)

        (kv_caches, last, counts), (tokens, scores) = jax.lax.scan(
            decode, (kv_caches, last_tokens, counts), jnp.arange(num_steps)
        )
        return tokens, (last, store(counts), guide_masks), kv_caches, next_packed, (scores,)
