"""The serving engine's core: requests in, tokens and text streamed out.

The engine is split as vLLM v1 splits it. This core owns the requests (their state,
arrival times, incremental text), scheduling (one ``Scheduler`` per data shard), the
events each ``step`` returns and the completions of finished requests. The model
runner (``serving/model_runner.py``) owns the device side: weights, KV caches, the
packed step inputs, the jitted step (multi-step decoding included), sampling and the
attention metadata, built through the model's ``AttentionGroup``. The model is a
``attn_jax.models.base.ServingModel`` (``LlamaModel`` is one), so another family plugs in
without changes here. Nothing here names an attention backend.

Each ``Engine.step`` asks the schedulers for a batch (decodes and prefill chunks under a
token budget) and hands it to the runner, which dispatches one jitted call. The step's
shapes are the engine's limits (requests padded to the ``max_num_seqs`` slots, tokens to a
power of two; ``default_buckets``), so it compiles once per token bucket and batch kind, not
per batch size, context length or sampling value; ``num_compilations`` counts the traces.
A decode batch that is the last call's one token on continues it on the device (the
persistent batch, ``ModelRunner.continue_decode``): no per-request inputs are built.
``warmup()`` compiles every program before the first request (``serving/warmup.py``), as
``attn-stack serve`` does before it listens.

Asynchronous scheduling (the default, vLLM's ``async_scheduling``): ``step`` dispatches
the next batch before it reads back the previous one's sampled tokens, so the host
schedules step N+1 while the device runs step N. A decode's input token then comes from
the device (the previous step's output, never copied to the host first), and tokens
reach the caller one ``step`` late. Stop tokens and max lengths still end requests
exactly: a request whose last token is pending is not scheduled again, and a token
computed after its request stopped at EOS is dropped. A one-step call with prompt tokens
(an admission call) dispatched behind a call still running is short on the device, shorter
than the host's work to read the older call back and build the next, so the same ``step``
builds and dispatches the next call right behind it and then reads both older calls back
(when every input the next call may need is pending in the admission call's output).

Multi-step decoding (``num_scheduler_steps`` K > 1, vLLM's multi-step scheduling): when a
step holds decodes only and no request waits to be admitted, one call runs K decode steps
on the device (a ``lax.scan``; each step's metadata is the call's moved on by the
attention group's ``advance_decode``, by 0 steps in the first), so the host's scheduling
and the call's dispatch are paid once per K tokens. A request with fewer than K tokens
left stops writing after its last; tokens after EOS are dropped; tokens reach the caller
K at a time.

Structured outputs (``SamplingParams.json_schema``, ``serving/structured_output.py``): a
guided request's next-token mask depends on its last token, so it takes one step of a
call (the unguided requests beside it keep their multi-step calls) and sits out the call
dispatched while that token is pending (nobody waits for it: the pipeline stays
asynchronous); it joins the one after, once its token has been read back, its grammar
advanced and its mask row written on the device. So a guided request gets a token every
other call; alone, its calls run synchronously.

Long-running: a request leaves every engine structure once its final event has been
returned (``completion(id)`` and ``get_request(id)`` then read a bounded record of the
last ``max_finished_requests``); text is decoded incrementally (``serving/detokenizer.py``,
stop strings checked on the new text only); ``stats`` keeps the last ``stats_window``
calls and ``totals`` running sums. Each call is timed from its dispatch to its tokens
being read back, and each request's time to first token is measured when that token is
read back.

Example::

    engine = Engine.from_gguf()                       # the embedded SmolLM2-135M-Instruct
    engine.add_request("The capital of France is", SamplingParams(max_new_tokens=16))
    while engine.has_unfinished():
        for event in engine.step():
            print(event.request_id, repr(event.text))
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import logging
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.base import ServingModel
from attn_jax.models.llama import LlamaConfig, LlamaModel
from attn_jax.ops.ragged_paged_attention.config import next_pow2
from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.serving.cascade import CascadeConfig
from attn_jax.serving.detokenizer import IncrementalDetokenizer
from attn_jax.serving.dispatch_pacer import DispatchPacer
from attn_jax.serving.kv_cache_manager import PrefixCacheStats
from attn_jax.serving.kv_cache_sizing import default_limits, kv_cache_plan
from attn_jax.serving.layer_buffers import model_layout
from attn_jax.serving.metrics import EngineTotals, StepStats, StepStatsLog
from attn_jax.serving.model_runner import DispatchedCall, ModelRunner, PreparedCall, kv_cache_bytes_per_block
from attn_jax.serving.scheduler import MIN_STEPS_CAP, Request, RequestStatus, SamplingParams, ScheduledBatch, Scheduler
from attn_jax.serving.structured_output import Guide, GuideTokenizer, compile_json_schema
from attn_jax.serving.warmup import WarmupReport, warm_up
from attn_jax.sharding import MODEL, check_num_devices, make_mesh, shard_model
from attn_jax.types import SEED_LIMIT, validate_positive_int

__all__ = ["Completion", "Engine", "StepStats", "TokenEvent", "UnknownRequestError"]

logger = logging.getLogger(__name__)

MAX_FINISHED_REQUESTS = 1024
"""Finished requests whose ``Completion`` an engine keeps by default (oldest dropped first)."""

STATS_WINDOW = 1024
"""Calls whose ``StepStats`` an engine keeps by default (``totals`` count every call)."""


class UnknownRequestError(KeyError):
    """A request id the engine does not know."""

    def __str__(self) -> str:
        return str(self.args[0])


class TokenEvent(NamedTuple):
    """One generated token of one request (what ``step`` and ``stream`` yield); a request
    that fails or is aborted ends with an event of token_id -1. Immutable; a named tuple
    rather than a frozen dataclass, which cost five times as much to build (about 1.5 us
    against 0.3 on the project's CPU: a batch-256 step builds 256)."""

    request_id: str
    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" (EOS), "length" (max_new_tokens), "abort" or "error" when finished
    error: str | None = None  # what went wrong, for finish_reason "error"
    # With ``SamplingParams.logprobs`` N: the token's log-probability and the N most likely
    # tokens' (id, log-probability), most likely first; else None.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    # With ``SamplingParams.prompt_logprobs`` N, on the request's first event only: one entry per
    # prompt token, None for the first, else (its log-probability, the N most likely tokens' (id,
    # log-probability) at its position, most likely first); else None.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]] | None, ...] | None = None


class TokenRun(NamedTuple):
    """One request's tokens from one engine call (what ``step_runs`` returns): one per step
    the call sampled for it (up to ``num_scheduler_steps``), in order, each token's text, and
    the request's end. A request that fails or is aborted ends with a run of no tokens.
    ``step`` gives the same news as one ``TokenEvent`` per token (``token_events``); a server
    takes runs, which cost the host a K-th of the per-token objects of a K-step call."""

    request_id: str
    token_ids: list[int]
    texts: list[str]  # each token's new text
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None  # each token's, when asked
    prompt_logprobs: tuple | None = None  # with the request's first token (``TokenEvent.prompt_logprobs``)


def token_events(runs: list[TokenRun]) -> list[TokenEvent]:
    """The ``TokenEvent`` of each token of ``runs``, in order (a run of no tokens: one event of
    token id -1)."""
    events = []
    for run in runs:
        ids = run.token_ids
        if not ids:
            events.append(TokenEvent(run.request_id, -1, "", run.finished, run.finish_reason, run.error))
            continue
        last = len(ids) - 1
        for i, (token, text) in enumerate(zip(ids, run.texts, strict=True)):
            logprob, top = (None, None) if run.logprobs is None else run.logprobs[i]
            prompt = run.prompt_logprobs if i == 0 else None
            end = run.finished and i == last  # the run's end is its last token's
            reason, error = (run.finish_reason, run.error) if end else (None, None)
            events.append(TokenEvent(run.request_id, token, text, end, reason, error, logprob, top, prompt))
    return events


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its prompt and generated tokens and text, and its latencies
    (None when it produced no token)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    ttft_seconds: float | None = None  # from add_request to its first token read back
    latency_seconds: float | None = None  # from add_request to its last token read back
    # With ``SamplingParams.logprobs``: each output token's (log-probability, top_logprobs) as
    # its ``TokenEvent`` had them; else None.
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # With ``SamplingParams.prompt_logprobs``: as ``TokenEvent.prompt_logprobs``; else None.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]] | None, ...] | None = None


@dataclasses.dataclass(eq=False, slots=True)
class _RequestState:
    """The core's view of one live request."""

    request: Request
    shard: int
    detokenizer: IncrementalDetokenizer | None
    arrival: float  # time.perf_counter() at add_request
    first_token: float | None = None  # ... when its first token was read back
    last_token: float | None = None
    logprobs: list | None = None  # each output token's (logprob, top_logprobs) when the request asks
    prompt_logprobs: list | None = None  # each prompt token's (logprob, top_logprobs) (the first None)
    guide: Guide | None = None  # the output grammar's state, with a json_schema


@dataclasses.dataclass(eq=False)
class _Finished:
    """A finished request in the bounded record: the request and its completion."""

    request: Request
    completion: Completion


@dataclasses.dataclass
class _InFlight:
    """A dispatched call whose sampled tokens are not read back yet."""

    call: DispatchedCall
    sampling: list[tuple[int, int, Request, int]]  # (data shard, row, request, steps) of each request sampled
    # (request, its first token row, the first prompt position, how many) of each prompt chunk whose
    # prompt log-probabilities the call computes (position p's row gives prompt token p + 1's)
    prompt: list[tuple[Request, int, int, int]]
    stats: StepStats  # its statistics, timing still unknown
    stats_index: int  # its step number in ``Engine.stats``
    step_start: float  # time.perf_counter() when its ``step`` began


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A checked request, ready to queue."""

    ids: list[int]
    params: SamplingParams
    request_id: str | None
    grammar: str | None = None  # the json_schema's llguidance grammar


def _powers_up_to(limit: int, start: int = 1, factor: int = 2) -> tuple[int, ...]:
    """``start`` times the powers of ``factor`` below ``limit``, then ``limit``."""
    out = [start * factor**k for k in range(32) if start * factor**k < limit]
    return (*out, limit)


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int, max_pages: int, *, fixed_pages: bool):
    """An engine's step shapes (tpu-inference's and vLLM's persistent batch): the request
    dimension fixed at the slot count ``max_num_seqs`` (every call pads to it; logits and
    sampling rows are the token bucket's, at most one per token), the block table's width
    fixed at ``max_pages`` when the backend reads only live pages (``fixed_pages``, see
    ``AttentionMetadataBuilder.reads_live_pages_only``) else powers of two, and the tokens
    in powers of four from 16 (16, 64, 256, 1024, ..., then ``max_num_batched_tokens``): the
    compile key is the token bucket and the batch's kind. Powers of four, not two, halve the
    programs (issue 46: 40 -> 30 at 64 sequences and 2048-token steps on PALLAS_GPU); a
    decode batch's padded rows cost its weight-bound matmuls little and its attention
    nothing (empty rows), a prefill chunk at most 4x its tokens' compute."""
    return MetadataBuckets(
        token_buckets=_powers_up_to(max_num_batched_tokens, start=min(16, max_num_batched_tokens), factor=4),
        request_buckets=(max_num_seqs,),
        blocks_per_request_buckets=(max_pages,) if fixed_pages else _powers_up_to(max_pages, start=min(4, max_pages)),
    )  # fmt: skip


def prompt_token_ids(prompt) -> list[int]:
    """A prompt given as token ids: integers only (no bools, floats, strings or bytes)."""
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"prompt={bytes(prompt)[:20]!r}... is bytes: give text (str) or a list of int token ids")
    try:
        ids = list(prompt)
    except TypeError:
        raise TypeError(f"prompt={prompt!r} must be text (str) or a sequence of int token ids") from None
    if set(map(type, ids)) <= {int}:  # the common case, checked at C speed (the loop below: 2 us a token)
        return ids
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt token {i} is {t!r} ({type(t).__name__}): token ids must be integers")
    return [int(t) for t in ids]


class Engine:
    """Continuous-batching generation over a ``ServingModel`` and a paged KV cache.

    Args:
      model: the model (``LlamaModel`` or another ``attn_jax.models.base.ServingModel``;
        its attention group fixes backend, block size and cache dtype).
      params: the model's weights (NumPy or jax arrays). Where the model names its [out, in]
        matrices (``LlamaModel.row_matrices``), a layer's that end in H are held in one buffer
        (``serving/layer_buffers.py``): NumPy ones are packed on their way to the device, jax
        arrays copied into it (the caller's arrays stay as they are; the KV budget counts the
        copy).
      tokenizer: for text prompts and streamed text (optional when prompts are token
        ids): ``load_tokenizer``'s ``GGUFTokenizer`` or a transformers tokenizer, anything
        with ``tokenizer(text)["input_ids"]``, ``decode(ids, skip_special_tokens=True)``,
        ``apply_chat_template`` and ``eos_token_id``.
      num_blocks: KV cache pages (per data shard); default: what ``kv_cache_bytes`` holds,
        or on an accelerator what ``gpu_memory_utilization`` leaves (``kv_cache_sizing.py``),
        at most every one of the ``max_num_seqs`` slots at ``max_model_len`` (so an engine
        of a few slots leaves the device to others; vLLM takes the whole budget).
      max_num_seqs: most requests per step (per data shard), the step's request slots;
        default 256 on an accelerator, 8 on a CPU (``kv_cache_sizing.default_limits``).
      max_num_batched_tokens: the step's token budget; longer prompts are prefilled in
        chunks of at most this many tokens; default 2048 on an accelerator, 256 on a CPU.
      max_model_len: prompt + new tokens allowed per request (default: the model's
        context length, at most 2048).
      seed: in [0, 2**32); draws the sampling seeds of requests that do not give one.
      mesh: a ``jax.sharding.Mesh`` from ``attn_jax.sharding.make_mesh`` to shard the
        step (requests over "data", heads over "model"); None: one device.
      buckets: padded sizes of the step's shapes (tokens, requests, pages per request);
        default: powers of two up to the limits above. Fewer buckets, fewer compilations.
      kv_cache_bytes: the KV cache's bytes (all layers, per data shard; vLLM's
        ``kv_cache_memory``); requests beyond it wait, are preempted, or are refused when
        alone too big. None: sized from the device (below), 256 MiB on a CPU.
      gpu_memory_utilization: on an accelerator, the share of the device's allocator limit
        the engine may fill: the KV cache gets what the weights and the step's activations
        leave of it (vLLM's flag, default 0.9); ``kv_cache_plan`` says how it was sized.
      async_scheduling: dispatch each step before reading back the last one's tokens
        (the module docstring says how); False: each ``step`` returns its own tokens.
      num_scheduler_steps: decode steps per call when a step holds decodes only (the
        module docstring says when); 1: one step per call. Backends whose metadata cannot
        advance on the device (``supports_decode_advance``) run one.
      max_finished_requests: finished requests kept for ``completion`` / ``get_request``
        (default ``MAX_FINISHED_REQUESTS`` = 1024; the oldest leave first).
      stats_window: calls kept in ``stats`` (default ``STATS_WINDOW`` = 1024).
      enable_prefix_caching: automatic prefix caching (vLLM V1's, on by default): a
        request starts from the longest cached run of full blocks of its tokens
        (``serving/kv_cache_manager.py``); ``prefix_cache_stats`` counts the hits.
      cascade_attention: a ``CascadeConfig`` or a bool (True: the default config; False:
        off). Each step the pages every running request holds (shared through the prefix
        cache) are offered to the attention group's builder, which runs cascade attention
        (the shared prefix read once for the batch) when it pays (``serving/cascade.py``);
        ``StepStats.cascade_prefix_len`` and ``totals.cascade_steps`` count it.
    """

    def __init__(
        self,
        model: ServingModel,
        params,
        tokenizer=None,
        *,
        num_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        mesh=None,
        buckets: MetadataBuckets | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        async_scheduling: bool = True,
        num_scheduler_steps: int = 1,
        max_finished_requests: int = MAX_FINISHED_REQUESTS,
        stats_window: int = STATS_WINDOW,
        enable_prefix_caching: bool = True,
        cascade_attention: CascadeConfig | bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.block_size = model.attention_group.block_size
        self.mesh = mesh  # None: one device
        # This process's device: sized from another process's, a device not addressable here
        # reports no memory (CPU limits in that process alone: two processes built different
        # programs and hung, issue 48).
        device = jax.local_devices()[0] if mesh is None else mesh.local_devices[0]
        default_seqs, default_tokens = default_limits(device)
        max_num_seqs = default_seqs if max_num_seqs is None else max_num_seqs
        max_num_batched_tokens = default_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        self.max_num_seqs = validate_positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = validate_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.max_model_len = min(config.max_position_embeddings, 2048) if max_model_len is None else max_model_len
        validate_positive_int("max_model_len", self.max_model_len)
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length "
                f"{config.max_position_embeddings}"
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32)")
        self.max_finished_requests = validate_positive_int("max_finished_requests", max_finished_requests)
        validate_positive_int("stats_window", stats_window)
        max_pages = -(-self.max_model_len // self.block_size)
        leaves = jax.tree.leaves(params)
        bytes_per_block = kv_cache_bytes_per_block(model)
        on_device = all(isinstance(x, jax.Array) for x in leaves)
        layout = model_layout(model, params)  # the runner's per-layer buffers: a copy of device weights
        self.kv_cache_plan = kv_cache_plan(
            config, params_bytes=sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
            // (1 if mesh is None else mesh.shape.get(MODEL, 1)),  # weights split over the model axis
            max_num_batched_tokens=max_num_batched_tokens, max_rows=min(max_num_seqs, max_num_batched_tokens),
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes, device=device,
            params_on_device=on_device,
            copied_bytes=layout.nbytes * len(params["layers"]) if on_device and layout is not None else 0,
        )  # fmt: skip
        affordable = self.kv_cache_plan.kv_cache_bytes // bytes_per_block
        if jax.process_count() > 1:  # every process builds the same cache: the one all can afford
            affordable = int(multihost_utils.process_allgather(np.int64(affordable)).min())
        self._kv_cache_capped = num_blocks is None and affordable > max_num_seqs * max_pages
        if num_blocks is None:  # what the budget holds, at most every slot at max_model_len
            num_blocks = max(min(max_num_seqs * max_pages, affordable), 1)
        self.num_blocks = num_blocks
        validate_positive_int("num_blocks", self.num_blocks)
        if buckets is None:
            buckets = default_buckets(
                max_num_seqs, max_num_batched_tokens, max_pages,
                fixed_pages=model.attention_group.metadata_builder.reads_live_pages_only,
            )  # fmt: skip
        for name, limit, largest in (
            ("token_buckets", self.max_num_batched_tokens, buckets.token_buckets[-1]),
            ("request_buckets", self.max_num_seqs, buckets.request_buckets[-1]),
            ("blocks_per_request_buckets", max_pages, buckets.blocks_per_request_buckets[-1]),
        ):
            if largest < limit:
                raise ValueError(f"buckets.{name} ends at {largest}, below the engine's limit {limit}")
        self.buckets = buckets
        self.async_scheduling = bool(async_scheduling)
        self.num_scheduler_steps = validate_positive_int("num_scheduler_steps", num_scheduler_steps)
        self.eos_token_ids = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

        self.runner = ModelRunner(
            model, params, num_blocks=self.num_blocks, buckets=buckets, mesh=mesh,
            cascade=CascadeConfig.of(cascade_attention),
        )  # fmt: skip
        self.num_shards = self.runner.num_shards
        self._enable_prefix_caching = bool(enable_prefix_caching)
        self.schedulers = [
            Scheduler(
                BlockAllocator(self.num_blocks),
                self.block_size,
                max_num_seqs,
                max_num_batched_tokens,
                enable_prefix_caching=self._enable_prefix_caching,
            )  # fmt: skip
            for _ in range(self.num_shards)
        ]
        self._in_flight: _InFlight | None = None
        self._last_end: float = 0.0  # when the last call's tokens were known computed
        self._pacer = DispatchPacer()
        # ``PreparedCall.describe`` of the last calls that compiled a program (a server logs them).
        self.recent_compilations: collections.deque[str] = collections.deque(maxlen=8)
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._requests: dict[str, _RequestState] = {}  # live requests (waiting, running, or aborted unreported)
        self._aborted: list[_RequestState] = []  # aborted, their final event not returned yet
        self._finished: collections.OrderedDict[str, _Finished] = collections.OrderedDict()
        self._collectors: list[dict[str, Completion | None]] = []  # generate()'s requests, filled as they finish
        self.stats = StepStatsLog(stats_window)
        self.totals = EngineTotals()
        self._guide_tokenizer: GuideTokenizer | None = None  # built on the first guided request (or the warm-up)

    # ------------------------------------------------------------------ device state (the runner's)

    @property
    def params(self):
        """The weights on the device in the model's layout (``ModelRunner.params``: copies sliced
        out of the step's per-layer buffers, made at each read)."""
        return self.runner.params

    @property
    def kv_caches(self):
        """The paged KV caches (donated to each call: read them between calls only)."""
        return self.runner.kv_caches

    @kv_caches.setter
    def kv_caches(self, caches) -> None:
        self.runner.kv_caches = caches

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether automatic prefix caching is on; settable while no request is live (e.g. to
        compare both settings on one engine's compiled steps): turning it off empties the cache."""
        return self._enable_prefix_caching

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, on: bool) -> None:
        if self._requests:
            raise ValueError(
                f"enable_prefix_caching can change only while no request is live ({len(self._requests)} are)"
            )
        if not on:
            self.reset_prefix_cache()
        for scheduler in self.schedulers:
            scheduler.kv_cache_manager.enable_caching = bool(on)
        self._enable_prefix_caching = bool(on)

    @property
    def cascade_attention(self) -> CascadeConfig:
        """When cascade attention may run (``CascadeConfig``); settable between steps (a bool
        or a config), e.g. to compare with and without it on one engine's compiled steps."""
        return self.runner.cascade

    @cascade_attention.setter
    def cascade_attention(self, setting: CascadeConfig | bool) -> None:
        self.runner.cascade = CascadeConfig.of(setting)

    def kv_cache_summary(self) -> str:
        """The start-up line: the KV cache in tokens, how it was sized, and the concurrency
        it allows at ``max_model_len`` (vLLM's)."""
        return self.kv_cache_plan.summary(
            num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len,
            capped=self._kv_cache_capped,
        )  # fmt: skip

    @property
    def num_compilations(self) -> int:
        """Traces of the jitted step so far."""
        return self.runner.num_compilations

    def warmup(
        self,
        *,
        max_shapes: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        workers: int | None = None,
        executable_cache: str | os.PathLike | None = None,
    ) -> WarmupReport:
        """Compiles every step shape this engine can meet (its buckets, the query-length
        patterns a backend may key on, cascade attention, multi-step counts; sampling values
        are data and add none) with dummy calls that change no state a request can see;
        returns how many shapes, compilations and seconds (``serving/warmup.py``). Call it
        on an idle engine, before the first request (ValueError otherwise); ``max_shapes``
        bounds the shapes warmed (the likeliest first; the report counts those skipped);
        ``workers`` threads compile at once (default: one per core, at most 16);
        ``executable_cache`` a folder of compiled programs loaded without tracing (and filled
        with those compiled; ``serving/executable_cache.py``). With a tokenizer and llguidance
        installed, it also builds structured outputs' tokenizer."""
        report = warm_up(
            self, max_shapes=max_shapes, progress=progress, workers=workers, executable_cache=executable_cache
        )
        if self.tokenizer is not None and importlib.util.find_spec("llguidance") is not None:
            self.guide_tokenizer()
        return report

    def guide_tokenizer(self) -> GuideTokenizer:
        """Structured outputs' tokenizer (llguidance's, over the model's vocabulary), built once."""
        if self._guide_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("json_schema needs text: this engine has no tokenizer")
            self._guide_tokenizer = GuideTokenizer(self.tokenizer, self.model.config.vocab_size)
        return self._guide_tokenizer

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike | None = None,
        *,
        attn_backend=None,
        block_size: int = 16,
        mesh=None,
        devices: int | None = None,
        model_parallel: int | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        dtype="float32",
        **engine_kwargs,
    ) -> Engine:
        """An engine on a Llama GGUF (default: the embedded SmolLM2-135M-Instruct), its weights
        dequantised to ``dtype`` (float32, bfloat16 or float16: the activations' too).

        ``devices`` N > 1 builds ``make_mesh(N, model_parallel=..., num_kv_heads=...)`` (give
        ``mesh`` or ``devices``, not both). ``progress(stage, done, total)`` is called while the
        weights load ("weights") and around the tokenizer ("tokenizer"). Raises
        ``ModelLoadError`` for a missing or corrupt file, ValueError for bad devices
        (``from_llama``'s, after the file loads).
        """
        from attn_jax.models.gguf_loader import load_gguf, load_tokenizer
        from attn_jax.models.smollm2 import gguf_path

        path = gguf_path() if path is None else path
        on_weights = None if progress is None else lambda d, t: progress("weights", d, t)
        config, params = load_gguf(path, dtype=jnp.dtype(dtype), progress=on_weights)
        if progress is not None:
            progress("tokenizer", 0, 1)
        tokenizer = load_tokenizer(path)
        if progress is not None:
            progress("tokenizer", 1, 1)
        return cls.from_llama(
            config, params, tokenizer, attn_backend=attn_backend, block_size=block_size, mesh=mesh, devices=devices,
            model_parallel=model_parallel, dtype=dtype, **engine_kwargs,
        )  # fmt: skip

    @classmethod
    def from_llama(
        cls,
        config: LlamaConfig,
        params,
        tokenizer=None,
        *,
        attn_backend=None,
        block_size: int = 16,
        mesh=None,
        devices: int | None = None,
        model_parallel: int | None = None,
        dtype="float32",
        **engine_kwargs,
    ) -> Engine:
        """An engine on a Llama-family ``config`` and its weights (``fuse_params``' layout),
        sharded over ``mesh``, or over ``make_mesh(N, model_parallel=..., num_kv_heads=...)``
        for ``devices`` N > 1 (give ``mesh`` or ``devices``, not both; KV heads copied where
        the model axis exceeds them, ``sharding.shard_model``). ``dtype``: the weights' and
        activations' (floating weights of another dtype are converted to it). ValueError for
        bad devices."""
        if mesh is not None and devices is not None:
            raise ValueError("give mesh or devices, not both")
        if devices is not None:
            check_num_devices(devices)
        if devices is not None and devices > 1:
            mesh = make_mesh(devices, model_parallel=model_parallel, num_kv_heads=config.num_kv_heads)
        elif model_parallel not in (None, 1):
            raise ValueError(f"model_parallel={model_parallel!r} needs devices > 1 (devices={devices!r})")
        dtype = jnp.dtype(dtype)

        def convert(a):  # floating weights of another dtype only: those already in it are not copied
            return a.astype(dtype) if a.dtype != dtype and jnp.issubdtype(a.dtype, jnp.floating) else a

        params = jax.tree.map(convert, params)
        local = {}
        if mesh is not None:
            config, params, local = shard_model(config, params, mesh)
        model = LlamaModel(config, block_size=block_size, attn_backend=attn_backend, dtype=dtype, **local)
        return cls(model, params, tokenizer, mesh=mesh, **engine_kwargs)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``: the tokenizer's default encoding, or with ``chat`` the
        model's chat template around one user message (generation prompt added)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompts as lists of token ids")
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def _prepare(self, prompt, params, request_id, chat: bool) -> _Prepared:
        """Checks one request without queueing it (ValueError / TypeError naming the value)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(
                f"params={params!r} is a {type(params).__name__}, not a SamplingParams: "
                "pass SamplingParams(...) (e.g. SamplingParams(**that_dict))"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character of text")
            ids = self.encode(prompt, chat=chat)
        else:
            ids = prompt_token_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty: it encodes to no tokens")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} = {total} exceeds "
                f"max_model_len={self.max_model_len} (the model's context length is "
                f"{self.model.config.max_position_embeddings})"
            )
        pages = -(-total // self.block_size)
        if pages > self.num_blocks:
            raise ValueError(
                f"the request needs up to {pages} KV cache pages ({len(ids)} prompt + {params.max_new_tokens} "
                f"new tokens, block_size={self.block_size}) but the cache holds {self.num_blocks}: "
                "lower max_new_tokens or give the engine more num_blocks"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} needs text: this engine has no tokenizer")
        grammar = None
        if params.json_schema is not None:
            grammar = compile_json_schema(params.json_schema)
            self.guide_tokenizer()
        if request_id is not None:
            request_id = str(request_id)
            if request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
        return _Prepared(ids, params, request_id, grammar)

    def _queue(self, prepared: _Prepared) -> str:
        request_id = f"req-{next(self._ids)}" if prepared.request_id is None else prepared.request_id
        while request_id in self._requests or (prepared.request_id is None and request_id in self._finished):
            request_id = f"req-{next(self._ids)}"  # a user id took the generated name
        params = prepared.params
        seed = int(self._rng.integers(2**31)) if params.seed is None else int(params.seed)
        request = Request(request_id, prepared.ids, params, seed=seed)
        shard = min(range(self.num_shards), key=lambda s: self._load(self.schedulers[s]))
        self.schedulers[shard].add(request)
        self._finished.pop(request_id, None)  # an id reused after its request finished
        detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, params.stop)
        guide = None if prepared.grammar is None else Guide(self.guide_tokenizer(), prepared.grammar)
        self._requests[request_id] = _RequestState(request, shard, detokenizer, time.perf_counter(), guide=guide)
        return request_id

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat: bool = False,
    ) -> str:
        """Queues a request; returns its id. ValueError / TypeError (naming the value) for
        an empty prompt, token ids that are not integers or lie outside the vocabulary,
        params that are not a ``SamplingParams``, a prompt longer than ``max_model_len``
        with its new tokens, an id of a request still running, stop strings without a
        tokenizer, or a request that cannot fit in the cache."""
        return self._queue(self._prepare(prompt, params, request_id, chat))

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's semantics): True when done; False, with a logged
        warning and nothing changed, while a request still holds KV cache pages (in any
        shard: then no shard's cache is reset)."""
        if any(s.allocator.num_used for s in self.schedulers):
            used = sum(s.allocator.num_used for s in self.schedulers)
            logger.warning("prefix cache not reset: %d KV cache pages are still held by requests", used)
            return False
        return all([s.reset_prefix_cache() for s in self.schedulers])

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix cache lookups so far, all shards: tokens queried, hit, and the hit rate."""
        return sum((s.prefix_cache_stats for s in self.schedulers), PrefixCacheStats())

    def abort_request(self, request_id: str) -> None:
        """Cancels a request (waiting or running) and frees its pages; it finishes with
        reason "abort", its final event (token_id -1) coming from the next ``step``.
        Aborting a finished request does nothing."""
        state = self._requests.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            self.get_request(request_id)  # finished (nothing to do) or unknown (raises)
            return
        request = state.request
        if request.status is not RequestStatus.FINISHED:
            request.num_pending = 0
            self.schedulers[state.shard].finish(request, "abort")
            self._aborted.append(state)

    @staticmethod
    def _load(scheduler: Scheduler) -> int:
        return len(scheduler.waiting) + len(scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, a dispatched step is unread, or an
        abort's final event is still to come."""
        return self._in_flight is not None or bool(self._aborted) or any(s.has_unfinished() for s in self.schedulers)

    def get_request(self, request_id: str) -> Request:
        """The request with this id, live or among the last ``max_finished_requests``
        finished (UnknownRequestError, a KeyError, if there is none)."""
        try:
            return self._requests[request_id].request
        except (KeyError, TypeError):
            pass
        try:
            return self._finished[request_id].request
        except (KeyError, TypeError):
            known = list(self._requests) + list(self._finished)
            shown = ", ".join(map(repr, known[-5:])) + (" ..." if len(known) > 5 else "")
            raise UnknownRequestError(
                f"unknown request_id={request_id!r}; this engine has {len(known)} request(s)"
                + (f": {shown}" if known else "")
                + f" (it keeps the last {self.max_finished_requests} finished ones)"
            ) from None

    @property
    def num_live_requests(self) -> int:
        """Requests the engine still holds state for (waiting, running, or aborted with
        their final event to come)."""
        return len(self._requests)

    # ------------------------------------------------------------------ the step

    def _fail(self, state: _RequestState, error: Exception) -> TokenRun:
        """Ends one request with reason "error" (its pages freed); the others go on."""
        request = state.request
        message = f"{type(error).__name__}: {error}"
        logger.error("request %r failed and was ended: %s", request.request_id, message)
        request.num_pending = 0
        self.schedulers[state.shard].finish(request, "error", message)
        self._retire(state)
        return TokenRun(request.request_id, [], [], True, "error", message)

    def _retire(self, state: _RequestState) -> None:
        """Moves a finished request from the live structures to the bounded record."""
        request = state.request
        text = ""
        if state.detokenizer is not None:
            try:
                text = state.detokenizer.text + state.detokenizer.finish(request.output_ids)
            except Exception:  # the tokenizer failed on this request: keep what was streamed
                text = state.detokenizer.text
        ttft = None if state.first_token is None else state.first_token - state.arrival
        latency = None if state.last_token is None else state.last_token - state.arrival
        completion = Completion(
            request.request_id, list(request.prompt_ids), list(request.output_ids), text, request.finish_reason,
            request.error, ttft, latency, None if state.logprobs is None else tuple(state.logprobs),
            None if state.prompt_logprobs is None else tuple(state.prompt_logprobs),
        )  # fmt: skip
        del self._requests[request.request_id]
        self._finished[request.request_id] = _Finished(request, completion)
        for wanted in self._collectors:
            if request.request_id in wanted:
                wanted[request.request_id] = completion
        while len(self._finished) > self.max_finished_requests:
            self._finished.popitem(last=False)

    def _schedule(self, runs: list[TokenRun]) -> tuple[list[ScheduledBatch], list, PreparedCall] | None:
        """Each shard's next batch, each request's steps in the call and the prepared call
        (a request whose inputs cannot be built fails alone, with a run in ``runs``);
        None when there is no work. A batch that continues the last call on the device
        (``ModelRunner.continue_decode``: the persistent batch) builds no per-request inputs."""
        batches = [s.schedule() for s in self.schedulers]
        if not any(b.requests for b in batches):
            return None
        self._write_guides(batches)
        steps, num_steps = self._decode_steps(batches)
        common = [s.num_common_prefix_blocks() for s in self.schedulers]
        prepared = self.runner.continue_decode(batches, steps, num_steps, num_common_blocks=common)
        if prepared is not None:
            return batches, steps, prepared
        rows_of_pending = {}
        if self._in_flight is not None:
            rows_of_pending = {r: row for _, row, r, _ in self._in_flight.sampling}
        rows, failed = {}, False
        for batch, counts in zip(batches, steps, strict=True):
            for i in reversed(range(len(batch.requests))):
                request = batch.requests[i]
                try:
                    rows[request] = ModelRunner.request_row(request, batch.num_new[i], rows_of_pending)
                except Exception as e:  # one bad request must not stop the others (its pages freed)
                    runs.append(self._fail(self._requests[request.request_id], e))
                    del batch.requests[i], batch.num_new[i], counts[i]
                    failed = True
        if not any(b.requests for b in batches):
            return None
        if failed:
            common = [s.num_common_prefix_blocks() for s in self.schedulers]  # after the failed requests left
        return batches, steps, self.runner.prepare(batches, rows, steps, num_steps, num_common_blocks=common)

    def _write_guides(self, batches: list[ScheduledBatch]) -> None:
        """Writes the token mask of each guided request in ``batches`` whose device row does not
        hold its current one (it changed, or the request took a row at admission); a request
        preempted in this step lost its row."""
        rows, masks = [], []
        for shard, batch in enumerate(batches):
            for request in batch.preempted:
                guide = self._requests[request.request_id].guide
                if guide is not None:
                    guide.row = -1
            for request in batch.requests:
                if request.guide_slot < 0:  # not guided (a running guided request holds a row)
                    continue
                guide = self._requests[request.request_id].guide
                if guide is not None and guide.row != request.guide_slot:
                    rows.append((shard, request.guide_slot))
                    masks.append(guide.mask)
                    guide.row = request.guide_slot
        if rows:
            self.runner.write_guide_rows(rows, masks)

    def _decode_steps(self, batches: list[ScheduledBatch]) -> tuple[list[list[int]], int]:
        """Each request's steps in this call and the call's step count: a multi-step decode
        (``reserve_decode_steps``) when every shard's batch holds decodes only, no request
        could be admitted instead, the attention group advances its metadata, some request is
        not guided and the pages are free; else one step (0 for a prefill chunk that samples
        nothing). A guided request takes one step of a multi-step call (its next mask needs its
        last token), so the unguided ones beside it keep their multi-step calls.

        A call runs no more steps than its batch can still use: K is capped at the power of
        two >= the most new tokens any of its requests has left, and never below
        ``MIN_STEPS_CAP`` (a few spare steps cost less than another compiled variant). So
        ``num_scheduler_steps=100000`` costs a few compiled variants, not 100,000-step calls."""
        k = self.num_scheduler_steps
        multi = (  # the batch-wide tests before the per-request ones (an admission call fails the first)
            k > 1
            and self.runner.supports_decode_advance
            and all(not s.waiting or len(s.running) >= s.max_num_seqs for s in self.schedulers)
            and all(max(b.num_new, default=1) == 1 for b in batches)
            and all(r.num_computed + 1 == r.num_tokens for b in batches for r in b.requests)
            and any(r.guide_slot < 0 for b in batches for r in b.requests)
        )
        if multi:
            left = max((r.max_tokens - r.num_tokens for b in batches for r in b.requests), default=0)
            k = min(k, max(next_pow2(max(left, 1)), MIN_STEPS_CAP))
            steps = [s.reserve_decode_steps(b, k) for s, b in zip(self.schedulers, batches, strict=True)]
            if all(x is not None for x in steps):
                return steps, k
        samples = [
            [int(r.num_computed + n == r.num_tokens) for r, n in zip(b.requests, b.num_new, strict=True)]
            for b in batches
        ]
        return samples, 1

    def step(self) -> list[TokenEvent]:
        """Schedules and dispatches one batch (two when the first is an admission call behind
        a call still running: see the module's docstring) and returns the tokens that have
        become known: with asynchronous scheduling the previous calls' (read back while the
        last one runs), else this step's; and the final events of requests aborted since the
        last call. May return none, e.g. while a long prompt is prefilled in chunks."""
        return token_events(self.step_runs())

    def step_runs(self) -> list[TokenRun]:
        """``step``, its news as one ``TokenRun`` per request and call (a request's K tokens of
        a K-step call together) rather than one ``TokenEvent`` per token."""
        start = time.perf_counter()
        runs = [self._report_abort(state) for state in self._aborted]
        self._aborted.clear()
        scheduled = self._schedule(runs)
        if scheduled is None:
            runs += self._resolve(self._in_flight)
            self._in_flight = None
            return runs
        dispatched = self._dispatch(scheduled, start)
        if not self.async_scheduling:
            return runs + self._resolve(dispatched)
        previous, self._in_flight = self._in_flight, dispatched
        if previous is not None and dispatched.stats.num_prefill_tokens and self._runs_from(dispatched):
            # An admission call behind a call still running: the device runs it in a few ms,
            # less than the host needs to read the older call back and build the next one, so
            # the next call is built and dispatched now, before either is read back. It cannot
            # see the older call's EOS (a token after one is dropped, as always).
            follow_start = time.perf_counter()
            try:
                follow = self._schedule(runs)
                if follow is not None:
                    self._in_flight = self._dispatch(follow, follow_start)
            except BaseException:  # the older call's tokens are kept; the admission call stays in flight
                self._resolve(previous)
                raise
            if follow is not None:
                return runs + self._resolve(previous) + self._resolve(dispatched)
        return runs + self._resolve(previous)

    def _runs_from(self, call: _InFlight) -> bool:
        """Whether the next call can take every pending input it may need from ``call``'s
        output (the one a call reads): not when ``call`` left out a decode that the next
        schedule may run (``Scheduler.pending_elsewhere``)."""
        sampled = {request for _, _, request, _ in call.sampling}
        return not any(s.pending_elsewhere(sampled) for s in self.schedulers)

    def _dispatch(self, scheduled: tuple[list[ScheduledBatch], list, PreparedCall], start: float) -> _InFlight:
        """Dispatches ``_schedule``'s call and accounts for it (``start``: when its step began)."""
        batches, steps, prepared = scheduled
        call = self.runner.dispatch(prepared)
        if not call.compiled:
            self._pacer.observe_host(call.dispatch_end - start)
        else:
            self.recent_compilations.append(prepared.describe())
        return self._account(batches, steps, call, start)

    def _report_abort(self, state: _RequestState) -> TokenRun:
        self._retire(state)
        return TokenRun(state.request.request_id, [], [], True, "abort")

    def _account(self, batches: list[ScheduledBatch], steps: list[list[int]], call: DispatchedCall, start) -> _InFlight:
        """Advances the host's view of a dispatched call: computed tokens, a pending token
        for each token a request samples in it (``steps``: each request's count), and the
        call's statistics (timing to come when its tokens are read back)."""
        sampling, prompt = [], []
        num_prefill = num_decode = num_sampled = 0
        prompt_scores = call.prompt_scores is not None
        for shard, (batch, counts) in enumerate(zip(batches, steps, strict=True)):
            first_row = 0
            for row, (request, n, k) in enumerate(zip(batch.requests, batch.num_new, counts, strict=True)):
                if prompt_scores and request.params.prompt_logprobs is not None:
                    start = request.num_computed
                    count = min(n, len(request.prompt_ids) - 1 - start)
                    if count > 0:
                        prompt.append((shard, request, first_row, start, count))
                first_row += n
                # Its new tokens, plus the later steps of a multi-step decode (k sampled tokens; 0 for
                # a prefill chunk that samples none); inline, as this runs once per request and call.
                computed = n + k - 1 if k > 1 else n
                request.num_computed += computed
                request.num_pending += k
                if k:
                    sampling.append((shard, row, request, k))
                    num_sampled += k
                if n > 1:
                    num_prefill += n
                else:
                    num_decode += computed
        stats = StepStats(
            num_requests=sum(len(b.requests) for b in batches),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_sampled=num_sampled,
            num_steps=call.num_steps,
            token_bucket=call.token_bucket,
            host_seconds=call.dispatch_start - start,
            dispatch_seconds=call.dispatch_end - call.dispatch_start,
            seconds=None,
            compiled=call.compiled,
            num_queried_tokens=sum(b.num_queried_tokens for b in batches),
            num_cached_tokens=sum(b.num_cached_tokens for b in batches),
            cascade_prefix_len=call.cascade_prefix_len,
        )
        return _InFlight(call, sampling, prompt, stats, self.stats.append(stats), start)

    def _resolve(self, step: _InFlight | None) -> list[TokenRun]:
        """Reads a dispatched call's tokens back (timing the call) and appends them (EOS,
        length and stop strings end requests); tokens of requests that ended meanwhile
        are dropped."""
        if step is None:
            return []
        call = step.call
        waited = call.ready_at is None and not call.tokens.is_ready()  # so its end is seen exactly
        logprobs = None
        if call.scores is None:
            tokens = self.runner.read_tokens(call.tokens).tolist()  # [data][K][R_max]: indexed per token below
        else:  # Python lists once a call (indexing NumPy per token costs more)
            n = max((r.params.logprobs or 0 for _, _, r, _ in step.sampling), default=0)
            tokens, chosen, ids, top = self.runner.read_scores(call.scores, 2)
            tokens, logprobs = tokens.tolist(), (chosen.tolist(), ids[..., :n].tolist(), top[..., :n].tolist())
        now = time.perf_counter()
        end = now if call.ready_at is None else call.ready_at
        begin = min(max(step.step_start, self._last_end), end)
        if waited and not call.compiled:
            device_seconds = end - max(call.dispatch_end, self._last_end)
            self._pacer.observe_device((call.num_steps, call.token_bucket), device_seconds)
        self._last_end = end
        stats = dataclasses.replace(step.stats, seconds=end - begin, latency_seconds=now - call.dispatch_start)
        self.stats.replace(step.stats_index, stats)
        self.totals = self.totals.add(stats)
        runs: list[TokenRun] = []
        if step.prompt:
            self._record_prompt_logprobs(step.prompt, self.runner.read_scores(call.prompt_scores, 1)[1:])
        finished, states, eos_ids = RequestStatus.FINISHED, self._requests, self.eos_token_ids
        for shard, row, request, k in step.sampling:
            if request.status is finished:
                continue  # stopped (EOS), aborted or failed after this call was dispatched
            request.num_pending -= k
            calls = tokens[shard]
            state = states[request.request_id]
            if k == 1 and state.first_token is not None and state.detokenizer is state.guide is None:
                # The hot path of a one-step call: a token that ends nothing, with no text, grammar or
                # log-probabilities, appended inline (``_append_run``'s rules, as it would run them).
                token, out, params = calls[0][row], request.output_ids, request.params
                if params.logprobs is None and len(out) + 1 < params.max_new_tokens:
                    if params.ignore_eos or token not in eos_ids:
                        out.append(token)
                        state.last_token = now
                        runs.append(TokenRun(request.request_id, [token], [""], False, None))
                        continue
            ids = [calls[0][row]] if k == 1 else [calls[j][row] for j in range(k)]
            scores = None
            if logprobs is not None and request.params.logprobs is not None:
                n, (chosen, alt_ids, alt_top) = request.params.logprobs, logprobs
                scores = []
                for j in range(k):
                    alternatives = zip(alt_ids[shard][j][row][:n], alt_top[shard][j][row][:n], strict=True)
                    scores.append((chosen[shard][j][row], tuple(alternatives)))
            self._append_run(runs, state, ids, now, scores)
        return runs

    def _record_prompt_logprobs(self, chunks, arrays) -> None:
        """Keeps each chunk's prompt log-probabilities in its request's state (a recomputed
        request writes the same positions again); ``arrays`` have a leading data axis."""
        for shard, request, first_row, start, count in chunks:
            if request.status is RequestStatus.FINISHED:
                continue
            state = self._requests[request.request_id]
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None] * len(request.prompt_ids)
            n = request.params.prompt_logprobs
            rows = slice(first_row, first_row + count)
            chosen, ids, top = (a[shard] for a in arrays)
            values, alt_ids, alt_values = chosen[rows].tolist(), ids[rows, :n].tolist(), top[rows, :n].tolist()
            for j in range(count):
                state.prompt_logprobs[start + j + 1] = (values[j], tuple(zip(alt_ids[j], alt_values[j], strict=True)))

    def dispatch_delay(self) -> float:
        """Seconds a server may still collect arrivals before its next ``step`` and keep the
        device busy: the call in flight's predicted end on the device, less the host's recent
        cost to schedule and dispatch a call and a margin (``serving/dispatch_pacer.py``).
        0 when no call is in flight, it has run already, or calls of its kind are not timed yet."""
        flight = self._in_flight
        if flight is None or flight.call.ready_at is not None:
            return 0.0
        call = flight.call
        start = max(call.dispatch_end, self._last_end)
        return self._pacer.delay((call.num_steps, call.token_bucket), start, time.perf_counter())

    def synchronize(self) -> None:
        """Waits for the dispatched step to finish on the device (timing)."""
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight.call.tokens)

    def _append_run(
        self, runs: list[TokenRun], state: _RequestState, ids: list[int], now: float, scores: list | None
    ) -> None:
        """Appends a request's tokens from one call (``scores``: each one's (logprob,
        top_logprobs) when the request asks for them) and its run to ``runs``; ends the request
        at EOS, length, a completed grammar or a stop string (the tokens after it dropped). A
        token the request cannot take (the tokenizer fails on it) fails the request alone: the
        tokens before it keep their run, and a run of no tokens ends it."""
        request = state.request
        params, output_ids = request.params, request.output_ids
        eos = () if params.ignore_eos else self.eos_token_ids
        guide, detokenizer, limit = state.guide, state.detokenizer, params.max_new_tokens
        prompt = None
        if state.first_token is None:
            state.first_token = now
            if params.prompt_logprobs is not None:
                if state.prompt_logprobs is None:  # a one-token prompt
                    state.prompt_logprobs = [None] * len(request.prompt_ids)
                prompt = tuple(state.prompt_logprobs)
        state.last_token = now
        texts: list[str] = []
        reason = None
        try:
            for token in ids:
                output_ids.append(token)
                if token in eos:
                    reason = "stop"
                elif guide is not None and guide.advance(token):
                    reason = "stop"  # the output grammar is complete
                elif len(output_ids) >= limit:
                    reason = "length"
                if detokenizer is None:
                    texts.append("")
                else:
                    text, stopped = detokenizer.add(token)
                    if stopped:
                        reason = "stop"
                    elif reason is not None:
                        text += detokenizer.finish(output_ids)
                    texts.append(text)
                if reason is not None:
                    break
        except Exception as e:  # e.g. the tokenizer fails on this request alone
            taken = len(texts)
            if taken:
                runs.append(self._run(state, ids[:taken], texts, None, scores, prompt))
            runs.append(self._fail(state, e))
            return
        taken = len(texts)
        if reason is not None:
            request.num_pending = 0  # tokens of a multi-step call after this one are dropped
            self.schedulers[state.shard].finish(request, reason)
        runs.append(self._run(state, ids if taken == len(ids) else ids[:taken], texts, reason, scores, prompt))
        if reason is not None:
            self._retire(state)

    @staticmethod
    def _run(state: _RequestState, ids: list[int], texts: list[str], reason, scores, prompt) -> TokenRun:
        """The run of ``ids`` (the first ``len(ids)`` of ``scores``, kept in the request's
        log-probabilities)."""
        if scores is not None:
            scores = scores[: len(ids)]
            if state.logprobs is None:
                state.logprobs = []
            state.logprobs += scores
        return TokenRun(state.request.request_id, ids, texts, reason is not None, reason, None, scores, prompt)

    # ------------------------------------------------------------------ conveniences

    def stream(self) -> Iterator[TokenEvent]:
        """Steps until every request has finished, yielding each token as it comes."""
        while self.has_unfinished():
            yield from self.step()

    def completion(self, request_id: str) -> Completion:
        """The result of a finished request (one of the last ``max_finished_requests``)."""
        finished = self._finished.get(request_id) if isinstance(request_id, str) else None
        if finished is not None:
            return finished.completion
        r = self.get_request(request_id)
        if r.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished")
        state = self._requests[request_id]  # aborted, its final event still to come
        text = "" if self.tokenizer is None else self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        ttft = None if state.first_token is None else state.first_token - state.arrival
        latency = None if state.last_token is None else state.last_token - state.arrival
        return Completion(
            r.request_id, list(r.prompt_ids), list(r.output_ids), text, r.finish_reason, r.error, ttft, latency,
            None if state.logprobs is None else tuple(state.logprobs),
            None if state.prompt_logprobs is None else tuple(state.prompt_logprobs),
        )  # fmt: skip

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[Completion]:
        """Runs ``prompts`` concurrently to completion; results in prompt order. Every
        prompt and its params are checked before any is queued."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts; for one prompt, pass [prompt]")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, Sequence) or len(params) != len(prompts):
            got = f"{len(params)} params" if isinstance(params, Sequence) else f"params={params!r}"
            raise ValueError(f"{got} for {len(prompts)} prompts: give one SamplingParams for all, or one per prompt")
        prepared = [self._prepare(p, sp, None, chat) for p, sp in zip(prompts, params, strict=True)]
        ids = [self._queue(x) for x in prepared]
        wanted: dict[str, Completion | None] = dict.fromkeys(ids)  # filled as they finish (the record may drop them)
        self._collectors.append(wanted)
        try:
            while self.has_unfinished():
                self.step_runs()
        finally:
            self._collectors = [c for c in self._collectors if c is not wanted]
        return [wanted[i] for i in ids]
