"""The serving engine: requests in, tokens streamed out, one jitted step per batch.

Each ``Engine.step`` asks the scheduler for a batch (decodes and prefill chunks under a
token budget), builds its attention metadata on the host with the foundation's bucketed
builder (``build_common_attn_metadata`` + the backend's ``build_for_jit``), packs every
host input into one buffer (one upload), and runs one jitted function: the model's
forward over the packed tokens, the paged cache updated in place (donated), and
sampling. Shapes are padded to buckets, so the step compiles once per bucket (and
sampling mode); ``num_compilations`` counts the traces.

Asynchronous scheduling (the default, vLLM's ``async_scheduling``): ``step`` dispatches
the next batch before it reads back the previous one's sampled tokens, so the host
schedules step N+1 while the device runs step N. A decode's input token then comes from
the device (the previous step's output, never copied to the host first), and tokens
reach the caller one ``step`` late. Stop tokens and max lengths still end requests
exactly: a request whose last token is pending is not scheduled again, and a token
computed after its request stopped at EOS is dropped.

Multi-step decoding (``num_scheduler_steps`` K > 1, vLLM's multi-step scheduling): when a
step holds decodes only and no request waits to be admitted, one call runs K decode steps
on the device (a ``lax.scan``; each step's metadata is the first's moved on by the
backend's ``advance_decode``), so the host's scheduling and the call's dispatch are paid
once per K tokens. A request with fewer than K tokens left stops writing after its last;
tokens after EOS are dropped; tokens reach the caller K at a time.

Example::

    engine = Engine.from_gguf()                       # the embedded SmolLM2-135M-Instruct
    engine.add_request("The capital of France is", SamplingParams(max_new_tokens=16))
    while engine.has_unfinished():
        for event in engine.step():
            print(event.request_id, repr(event.text))
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
from attn_jax.models.llama import LlamaModel
from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.serving.kv_cache_manager import PrefixCacheStats
from attn_jax.serving.sampling import num_candidates_for, sample_tokens
from attn_jax.serving.scheduler import Request, RequestStatus, SamplingParams, ScheduledBatch, Scheduler
from attn_jax.serving.step_inputs import PackedLayout, pack, unpack
from attn_jax.sharding import ShardedStep, check_num_devices, local_model_kwargs, make_mesh
from attn_jax.types import SEED_LIMIT, validate_positive_int

logger = logging.getLogger(__name__)


class UnknownRequestError(KeyError):
    """A request id the engine does not know."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request (what ``step`` and ``stream`` yield); a request
    that fails or is aborted ends with an event of token_id -1."""

    request_id: str
    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" (EOS), "length" (max_new_tokens), "abort" or "error" when finished
    error: str | None = None  # what went wrong, for finish_reason "error"


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its prompt and generated tokens and text."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine step did (per data shard summed)."""

    num_requests: int
    num_prefill_tokens: int  # tokens of requests with more than one new token
    num_decode_tokens: int
    num_sampled: int
    num_steps: int  # decode steps the call ran (``num_scheduler_steps`` in a multi-step decode, else 1)
    token_bucket: int
    host_seconds: float  # scheduling + metadata + packing before the device call
    dispatch_seconds: float  # the jitted call's return (enqueueing the step, not running it)
    seconds: float  # the whole ``step`` call (with asynchronous scheduling: the device's step time)
    compiled: bool  # the step traced and compiled a new bucket
    num_queried_tokens: int = 0  # prefix cache: known tokens of the requests admitted in this step
    num_cached_tokens: int = 0  # prefix cache: of them, found cached (not computed)


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose sampled tokens are not read back yet."""

    tokens: jax.Array  # i32[K, R_max] (or [data, K, R_max]): each step's and request row's sampled token
    sampled: list[tuple[int, int, int, Request]]  # (data shard, step, row, request) of each sampled token


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A checked request, ready to queue."""

    ids: list[int]
    params: SamplingParams
    request_id: str | None


def _powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    out = [b for b in (1 << k for k in range(32)) if start <= b < limit]
    return (*out, limit)


def _computed_tokens(num_new: int, steps: int) -> int:
    """Tokens a request computes in a call: its new tokens, plus the later steps of a
    multi-step decode (``steps`` sampled tokens; 0 for a prefill chunk that samples none)."""
    return num_new + max(steps - 1, 0)


def _scatter_rows(out: np.ndarray, offsets: np.ndarray, rows: Sequence[Sequence[int]]) -> None:
    """Writes each list ``rows[i]`` into the flat view of ``out`` from ``offsets[i]`` on,
    with one NumPy call for all of them."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    total = int(lengths.sum())
    if total:
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, total)
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out.reshape(-1)[np.repeat(offsets, lengths) + within] = flat


def _token_ids(prompt) -> list[int]:
    """A prompt given as token ids: integers only (no bools, floats, strings or bytes)."""
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"prompt={bytes(prompt)[:20]!r}... is bytes: give text (str) or a list of int token ids")
    try:
        ids = list(prompt)
    except TypeError:
        raise TypeError(f"prompt={prompt!r} must be text (str) or a sequence of int token ids") from None
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt token {i} is {t!r} ({type(t).__name__}): token ids must be integers")
    return [int(t) for t in ids]


class Engine:
    """Continuous-batching generation over a ``LlamaModel`` and a paged KV cache.

    Args:
      model: the model (its attention layer fixes backend, block size and cache dtype).
      params: the model's weights (NumPy or jax arrays).
      tokenizer: for text prompts and streamed text (optional when prompts are token
        ids): ``load_tokenizer``'s ``GGUFTokenizer`` or a transformers tokenizer, anything
        with ``tokenizer(text)["input_ids"]``, ``decode(ids, skip_special_tokens=True)``,
        ``apply_chat_template`` and ``eos_token_id``.
      num_blocks: KV cache pages (per data shard); default: every request of
        ``max_num_seqs`` at ``max_model_len``, capped at ``kv_cache_bytes``.
      max_num_seqs: most requests per step (per data shard).
      max_num_batched_tokens: the step's token budget; longer prompts are prefilled in
        chunks of at most this many tokens.
      max_model_len: prompt + new tokens allowed per request (default: the model's
        context length, at most 2048).
      seed: in [0, 2**32); draws the sampling seeds of requests that do not give one.
      mesh: a ``jax.sharding.Mesh`` from ``attn_jax.sharding.make_mesh`` to shard the
        step (requests over "data", heads over "model"); None: one device.
      buckets: padded sizes of the step's shapes (tokens, requests, pages per request);
        default: powers of two up to the limits above. Fewer buckets, fewer compilations.
      kv_cache_bytes: the default ``num_blocks``'s memory cap (all layers, per data
        shard); requests beyond it wait, are preempted, or are refused when alone too big.
      async_scheduling: dispatch each step before reading back the last one's tokens
        (the module docstring says how); False: each ``step`` returns its own tokens.
      num_scheduler_steps: decode steps per call when a step holds decodes only (the
        module docstring says when); 1: one step per call. Backends whose metadata cannot
        advance on the device (``supports_decode_advance``) run one.
      enable_prefix_caching: automatic prefix caching (vLLM V1's, on by default): a
        request starts from the longest cached run of full blocks of its tokens
        (``serving/kv_cache_manager.py``); ``prefix_cache_stats`` counts the hits.
    """

    def __init__(
        self,
        model: LlamaModel,
        params,
        tokenizer=None,
        *,
        num_blocks: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        mesh=None,
        buckets: MetadataBuckets | None = None,
        kv_cache_bytes: int = 256 << 20,
        async_scheduling: bool = True,
        num_scheduler_steps: int = 1,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.block_size = model.block_size
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
        max_pages = -(-self.max_model_len // self.block_size)
        if num_blocks is None:
            page_bytes = int(np.prod(model.kv_cache_shape(1))) * model.dtype.itemsize * config.num_layers
            num_blocks = max(min(max_num_seqs * max_pages, kv_cache_bytes // page_bytes), 1)
        self.num_blocks = num_blocks
        validate_positive_int("num_blocks", self.num_blocks)
        if buckets is None:
            buckets = MetadataBuckets(
                token_buckets=_powers_of_two_up_to(self.max_num_batched_tokens, start=min(16, max_num_batched_tokens)),
                request_buckets=_powers_of_two_up_to(self.max_num_seqs),
                blocks_per_request_buckets=_powers_of_two_up_to(max_pages, start=min(4, max_pages)),
            )
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

        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._sharded = None if mesh is None else ShardedStep(model, mesh)
        self.num_shards = 1 if self._sharded is None else self._sharded.data_size
        self.schedulers = [
            Scheduler(
                BlockAllocator(self.num_blocks),
                self.block_size,
                max_num_seqs,
                max_num_batched_tokens,
                enable_prefix_caching=self.enable_prefix_caching,
            )
            for _ in range(self.num_shards)
        ]
        self._max_rows = buckets.request_buckets[-1]  # the sampled-token buffer's length
        if self._sharded is None:
            self.params = jax.device_put(params)
            self.kv_caches = model.init_kv_caches(self.num_blocks)
            self._jit_step = jax.jit(self._device_step, donate_argnums=1, static_argnums=(4, 5, 6))
            self._last_tokens = jnp.zeros(self._max_rows, jnp.int32)
        else:
            self.params = self._sharded.put_params(params)
            self.kv_caches = self._sharded.init_kv_caches(self.num_blocks)
            self._jit_step = self._sharded.jit(self._device_step)
            self._last_tokens = self._sharded.zeros_per_shard(self._max_rows)
        self._in_flight: _InFlight | None = None
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, str] = {}
        self._shard_of: dict[str, int] = {}
        self.num_compilations = 0
        self.stats: list[StepStats] = []

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
        progress: Callable[[str, int, int], None] | None = None,
        **engine_kwargs,
    ) -> Engine:
        """An engine on a Llama GGUF (default: the embedded SmolLM2-135M-Instruct).

        ``devices`` N > 1 builds ``make_mesh(N, num_kv_heads=...)`` (give ``mesh`` or
        ``devices``, not both). ``progress(stage, done, total)`` is called while the
        weights load ("weights") and around the tokenizer ("tokenizer"). Raises
        ``ModelLoadError`` for a missing or corrupt file, ValueError for bad devices.
        """
        if mesh is not None and devices is not None:
            raise ValueError("give mesh or devices, not both")
        if devices is not None:
            check_num_devices(devices)
        from attn_jax.models.gguf_loader import load_gguf, load_tokenizer
        from attn_jax.models.smollm2 import gguf_path

        path = gguf_path() if path is None else path
        config, params = load_gguf(path, progress=None if progress is None else lambda d, t: progress("weights", d, t))
        if progress is not None:
            progress("tokenizer", 0, 1)
        tokenizer = load_tokenizer(path)
        if progress is not None:
            progress("tokenizer", 1, 1)
        if devices is not None and devices > 1:
            mesh = make_mesh(devices, num_kv_heads=config.num_kv_heads)
        local = {} if mesh is None else local_model_kwargs(config, mesh)
        model = LlamaModel(config, block_size=block_size, attn_backend=attn_backend, **local)
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
            ids = _token_ids(prompt)
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
        if request_id is not None:
            request_id = str(request_id)
            if request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
        return _Prepared(ids, params, request_id)

    def _queue(self, prepared: _Prepared) -> str:
        request_id = f"req-{next(self._ids)}" if prepared.request_id is None else prepared.request_id
        while request_id in self._requests:  # a user id took the generated name
            request_id = f"req-{next(self._ids)}"
        params = prepared.params
        seed = int(self._rng.integers(2**31)) if params.seed is None else int(params.seed)
        request = Request(request_id, prepared.ids, params, seed=seed)
        shard = min(range(self.num_shards), key=lambda s: self._load(self.schedulers[s]))
        self.schedulers[shard].add(request)
        self._requests[request_id] = request
        self._texts[request_id] = ""
        self._shard_of[request_id] = shard
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
        with its new tokens, a duplicate id, or a request that cannot fit in the cache."""
        return self._queue(self._prepare(prompt, params, request_id, chat))

    def abort_request(self, request_id: str) -> None:
        """Cancels a request (waiting or running) and frees its pages; it finishes with
        reason "abort". Aborting a finished request does nothing."""
        request = self.get_request(request_id)
        if request.status is not RequestStatus.FINISHED:
            self.schedulers[self._shard_of[request_id]].finish(request, "abort")

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

    @staticmethod
    def _load(scheduler: Scheduler) -> int:
        return len(scheduler.waiting) + len(scheduler.running)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a dispatched step is unread."""
        return self._in_flight is not None or any(s.has_unfinished() for s in self.schedulers)

    def get_request(self, request_id: str) -> Request:
        """The request with this id (UnknownRequestError, a KeyError, if there is none)."""
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            known = list(self._requests)
            shown = ", ".join(map(repr, known[-5:])) + (" ..." if len(known) > 5 else "")
            raise UnknownRequestError(
                f"unknown request_id={request_id!r}; this engine has {len(known)} request(s)"
                + (f": {shown}" if known else "")
            ) from None

    # ------------------------------------------------------------------ the step

    def _device_step(
        self, params, kv_caches, last_tokens, packed, layout: PackedLayout, num_candidates: int, num_steps: int
    ):
        """Traced once per (bucket, sampling mode, steps): forward and sampling, ``num_steps``
        times (the later steps decodes only, each request's input its previous token).

        ``last_tokens`` i32[R_max] are the previous call's last sampled tokens (still on the
        device); rows whose ``token_src`` is >= 0 take their input token from there.
        Returns (i32[num_steps, R_max] sampled tokens, i32[R_max] each row's last sampled
        token, caches)."""
        self.num_compilations += 1
        x = unpack(packed, layout)
        s, md = x["sampling"], x["md"]
        num_rows = x["logits_rows"].shape[0]

        def forward(kv_caches, token_ids, positions, md, counters):
            logits, kv_caches = self.model.step(params, kv_caches, token_ids, positions, md, x["logits_rows"])
            tokens = sample_tokens(
                logits, s["temperature"], s["top_p"], s["top_k"], s["seeds"], counters, num_candidates=num_candidates
            )
            return jnp.pad(tokens, (0, self._max_rows - num_rows)), kv_caches

        token_ids = jnp.where(x["token_src"] >= 0, last_tokens[jnp.maximum(x["token_src"], 0)], x["token_ids"])
        tokens, kv_caches = forward(kv_caches, token_ids, x["positions"], md, s["counters"])
        if num_steps == 1:
            return tokens[None], tokens, kv_caches

        limits = x["decode_steps"]  # i32[R]: steps each request takes (0 for padding rows)
        token_rows = jnp.arange(token_ids.shape[0])
        token_req = jnp.minimum(token_rows, num_rows - 1)  # a decode batch's token r is request r's
        builder = self.model.attn.metadata_builder

        def decode(carry, step):
            kv_caches, last = carry
            steps = jnp.clip(jnp.minimum(step, limits - 1), 0)
            active = step < limits
            token_ids = last[jnp.minimum(token_rows, self._max_rows - 1)]
            positions = x["positions"] + jnp.where(token_rows < num_rows, steps[token_req], 0)
            new, kv_caches = forward(
                kv_caches, token_ids, positions, builder.advance_decode(md, steps, active), s["counters"] + steps
            )
            last = jnp.where(jnp.pad(active, (0, self._max_rows - num_rows)), new, last)
            return (kv_caches, last), new

        (kv_caches, last), later = jax.lax.scan(decode, (kv_caches, tokens), jnp.arange(1, num_steps))
        return jnp.concatenate([tokens[None], later]), last, kv_caches

    @staticmethod
    def _request_row(request: Request, num_new: int, rows_of_pending: dict[int, int]) -> tuple:
        """One request's part of the step: (known input token ids, the row of its pending
        token in the previous step's output or -1, (temperature, top_p, top_k, seed,
        tokens generated)). Raises for a request whose values do not fit the step's arrays
        (a seed outside [0, 2**32), say)."""
        known = request.known_ids(request.num_computed, request.num_computed + num_new)
        src = -1
        if len(known) < num_new:  # the last token is the previous step's, still on the device
            if id(request) not in rows_of_pending:
                raise RuntimeError("its last token is pending but in no dispatched step")
            src = rows_of_pending[id(request)]
        p = request.params
        for name, value, limit in (("seed", request.seed, SEED_LIMIT), ("top_k", p.top_k, 2**31)):
            if not 0 <= value < limit:
                raise OverflowError(f"{name}={value} does not fit the step's arrays: it must be in [0, {limit})")
        return known, src, (p.temperature, p.top_p, p.top_k, request.seed, request.num_generated)

    def _host_inputs(
        self, batch: ScheduledBatch, rows: dict[int, tuple], buckets, step_query_lens, decode_steps: list[int]
    ) -> dict:
        """One shard's batch as a tree of NumPy arrays, padded to ``buckets`` (tokens,
        requests, pages per request); ``rows`` holds each request's ``_request_row`` and
        ``decode_steps`` its steps in this call. Built column by column (one NumPy call per
        array, not per request)."""
        token_bucket, req_bucket, page_bucket = buckets
        reqs = batch.requests
        n = len(reqs)
        known, src, values = zip(*(rows[id(r)] for r in reqs), strict=True) if n else ((), (), ())
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
        logits_rows = np.zeros(req_bucket, np.int32)
        logits_rows[:n] = ends - 1
        steps = np.zeros(req_bucket, np.int32)
        steps[:n] = decode_steps
        columns = np.zeros((5, req_bucket), np.float64)  # exact for every value in range
        columns[1] = 1.0
        columns[:, :n] = np.asarray(values, np.float64).reshape(n, 5).T
        md = build_common_attn_metadata(
            query_lens, starts + query_lens, block_table, self.block_size, MetadataBuckets(*((b,) for b in buckets))
        )  # fmt: skip
        md = self.model.attn.metadata_builder.build_for_jit(md, step_query_lens=step_query_lens)
        return dict(
            token_ids=token_ids, token_src=token_src, positions=positions, md=md, logits_rows=logits_rows,
            decode_steps=steps,
            sampling=dict(
                temperature=columns[0].astype(np.float32), top_p=columns[1].astype(np.float32),
                top_k=columns[2].astype(np.int32), seeds=columns[3].astype(np.uint32),
                counters=columns[4].astype(np.int32),
            ),
        )  # fmt: skip

    def _fail(self, shard: int, request: Request, error: Exception) -> TokenEvent:
        """Ends one request with reason "error" (its pages freed); the others go on."""
        message = f"{type(error).__name__}: {error}"
        logger.error("request %r failed and was ended: %s", request.request_id, message)
        request.num_pending = 0
        self.schedulers[shard].finish(request, "error", message)
        return TokenEvent(request.request_id, -1, "", True, "error", message)

    def _schedule(self, events: list[TokenEvent]) -> tuple[list[ScheduledBatch], list, list, int] | None:
        """Each shard's next batch, its host inputs and its requests' decode steps, and the
        call's step count (a request whose inputs cannot be built fails alone, with an
        event in ``events``); None when there is no work."""
        batches = [s.schedule() for s in self.schedulers]
        if not any(b.requests for b in batches):
            return None
        rows_of_pending = {}
        if self._in_flight is not None:
            rows_of_pending = {id(r): row for _, _, row, r in self._in_flight.sampled}
        rows = {}
        for shard, batch in enumerate(batches):
            for i in reversed(range(len(batch.requests))):
                request = batch.requests[i]
                try:
                    rows[id(request)] = self._request_row(request, batch.num_new[i], rows_of_pending)
                except Exception as e:  # one bad request must not stop the others
                    events.append(self._fail(shard, request, e))
                    del batch.requests[i], batch.num_new[i]
        if not any(b.requests for b in batches):
            return None
        steps, num_steps = self._decode_steps(batches)
        fits = MetadataBuckets.fit
        token_bucket = fits(self.buckets.token_buckets, max(b.num_tokens for b in batches), "num_tokens")
        req_bucket = fits(self.buckets.request_buckets, max(len(b.requests) for b in batches), "num_reqs")
        pages = max((len(r.blocks) for b in batches for r in b.requests), default=1)
        page_bucket = fits(self.buckets.blocks_per_request_buckets, pages, "blocks per request")
        step_query_lens = np.concatenate([np.asarray(b.num_new, np.int32) for b in batches])
        buckets = (token_bucket, req_bucket, page_bucket)
        inputs = [self._host_inputs(b, rows, buckets, step_query_lens, s) for b, s in zip(batches, steps, strict=True)]
        return batches, inputs, steps, num_steps

    def _decode_steps(self, batches: list[ScheduledBatch]) -> tuple[list[list[int]], int]:
        """Each request's steps in this call and the call's step count: a multi-step decode
        (``reserve_decode_steps``) when every shard's batch holds decodes only, no request
        could be admitted instead, the backend advances its metadata, and the pages are
        free; else one step (0 for a prefill chunk that samples nothing)."""
        k = self.num_scheduler_steps
        multi = (
            k > 1
            and self.model.attn.metadata_builder.supports_decode_advance
            and all(
                n == 1 and r.num_computed + 1 == r.num_tokens
                for b in batches
                for r, n in zip(b.requests, b.num_new, strict=True)
            )
            and all(not s.waiting or len(s.running) >= s.max_num_seqs for s in self.schedulers)
        )
        if multi:
            steps = [s.reserve_decode_steps(b, k) for s, b in zip(self.schedulers, batches, strict=True)]
            if all(x is not None for x in steps):
                return steps, k
        samples = [
            [int(r.num_computed + n == r.num_tokens) for r, n in zip(b.requests, b.num_new, strict=True)]
            for b in batches
        ]
        return samples, 1

    def step(self) -> list[TokenEvent]:
        """Schedules and dispatches one batch and returns the tokens that have become
        known: with asynchronous scheduling the previous step's (read back while this one
        runs), else this step's. May return none, e.g. while a long prompt is prefilled in
        chunks."""
        start = time.perf_counter()
        events: list[TokenEvent] = []
        scheduled = self._schedule(events)
        if scheduled is None:
            events += self._resolve(self._in_flight)
            self._in_flight = None
            return events
        batches, inputs, steps, num_steps = scheduled
        compilations = self.num_compilations
        packed = [pack(x) for x in inputs]
        layout = packed[0][1]
        temps = np.concatenate([x["sampling"]["temperature"] for x in inputs])
        top_p = np.concatenate([x["sampling"]["top_p"] for x in inputs])
        top_k = np.concatenate([x["sampling"]["top_k"] for x in inputs])
        num_candidates = num_candidates_for(temps, top_p, top_k, self.model.config.vocab_size)
        host_done = time.perf_counter()
        if self._sharded is None:
            tokens, self._last_tokens, self.kv_caches = self._jit_step(
                self.params, self.kv_caches, self._last_tokens, packed[0][0], layout, num_candidates, num_steps
            )
        else:
            tokens, self._last_tokens, self.kv_caches = self._sharded.run(
                self._jit_step, self.params, self.kv_caches, self._last_tokens, packed, num_candidates, num_steps
            )
        dispatched_at = time.perf_counter()
        tokens.copy_to_host_async()
        dispatched = self._account(batches, steps, tokens)
        if self.async_scheduling:
            events += self._resolve(self._in_flight)
            self._in_flight = dispatched
        else:
            events += self._resolve(dispatched)
        num_prefill = sum(n for b in batches for n in b.num_new if n > 1)
        num_decode = sum(
            _computed_tokens(n, k)
            for b, ks in zip(batches, steps, strict=True)
            for n, k in zip(b.num_new, ks, strict=True)
            if n == 1
        )
        self.stats.append(
            StepStats(
                num_requests=sum(len(b.requests) for b in batches),
                num_prefill_tokens=num_prefill,
                num_decode_tokens=num_decode,
                num_sampled=len(dispatched.sampled),
                num_steps=num_steps,
                token_bucket=inputs[0]["token_ids"].shape[0],
                host_seconds=host_done - start,
                dispatch_seconds=dispatched_at - host_done,
                seconds=time.perf_counter() - start,
                compiled=self.num_compilations > compilations,
                num_queried_tokens=sum(b.num_queried_tokens for b in batches),
                num_cached_tokens=sum(b.num_cached_tokens for b in batches),
            )
        )
        return events

    def _account(self, batches: list[ScheduledBatch], steps: list[list[int]], tokens) -> _InFlight:
        """Advances the host's view of a dispatched call: computed tokens, and a pending
        token for each token a request samples in it (``steps``: each request's count)."""
        sampled = []
        for shard, (batch, counts) in enumerate(zip(batches, steps, strict=True)):
            for row, (request, n, k) in enumerate(zip(batch.requests, batch.num_new, counts, strict=True)):
                request.num_computed += _computed_tokens(n, k)
                request.num_pending += k
                sampled += [(shard, step, row, request) for step in range(k)]
        return _InFlight(tokens, sampled)

    def _resolve(self, step: _InFlight | None) -> list[TokenEvent]:
        """Reads a dispatched call's tokens back and appends them (EOS and length end
        requests); tokens of requests that ended meanwhile are dropped."""
        if step is None or not step.sampled:
            return []
        tokens = np.asarray(step.tokens)
        tokens = tokens[None] if tokens.ndim == 2 else tokens
        events = []
        for shard, k, row, request in step.sampled:
            if request.status is RequestStatus.FINISHED:
                continue  # stopped (EOS), aborted or failed after this call was dispatched
            request.num_pending -= 1
            try:
                events.append(self._append_token(shard, request, int(tokens[shard, k, row])))
            except Exception as e:  # e.g. the tokenizer fails on this request alone
                events.append(self._fail(shard, request, e))
        return events

    def synchronize(self) -> None:
        """Waits for the dispatched step to finish on the device (timing)."""
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight.tokens)

    def _append_token(self, shard: int, request: Request, token: int) -> TokenEvent:
        request.output_ids.append(token)
        reason = None
        if token in self.eos_token_ids and not request.params.ignore_eos:
            reason = "stop"
        elif len(request.output_ids) >= request.params.max_new_tokens:
            reason = "length"
        if reason is not None:
            self.schedulers[shard].finish(request, reason)
        text = ""
        if self.tokenizer is not None:
            full = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
            if not full.endswith("\ufffd"):  # an incomplete multi-byte character waits
                text = full[len(self._texts[request.request_id]) :]
                self._texts[request.request_id] = full
        return TokenEvent(request.request_id, token, text, reason is not None, reason)

    # ------------------------------------------------------------------ conveniences

    def stream(self) -> Iterator[TokenEvent]:
        """Steps until every request has finished, yielding each token as it comes."""
        while self.has_unfinished():
            yield from self.step()

    def completion(self, request_id: str) -> Completion:
        """The result of a finished request."""
        r = self.get_request(request_id)
        if r.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished")
        text = "" if self.tokenizer is None else self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return Completion(r.request_id, list(r.prompt_ids), list(r.output_ids), text, r.finish_reason, r.error)

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
        for _ in self.stream():
            pass
        return [self.completion(i) for i in ids]
