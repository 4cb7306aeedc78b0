"""The serving engine: requests in, tokens streamed out, one jitted step per batch.

Each ``Engine.step`` asks the scheduler for a batch (decodes and prefill chunks under a
token budget), builds its attention metadata on the host with the foundation's bucketed
builder (``build_common_attn_metadata`` + the backend's ``build_for_jit``), and runs
one jitted function: the model's forward over the packed tokens, the paged cache
updated in place (donated), and sampling. Shapes are padded to buckets, so the step
compiles once per bucket; ``num_compilations`` counts the traces.

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
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.xla import XLAAttentionMetadata
from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
from attn_jax.models.llama import LlamaModel
from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.serving.sampling import sample_tokens
from attn_jax.serving.scheduler import Request, SamplingParams, ScheduledBatch, Scheduler
from attn_jax.sharding import ShardedStep, check_num_devices, local_model_kwargs, make_mesh
from attn_jax.types import validate_positive_int

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request (what ``step`` and ``stream`` yield)."""

    request_id: str
    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" (EOS) or "length" (max_new_tokens) when finished


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its prompt and generated tokens and text."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine step did (per data shard summed)."""

    num_requests: int
    num_prefill_tokens: int  # tokens of requests with more than one new token
    num_decode_tokens: int
    num_sampled: int
    token_bucket: int
    host_seconds: float  # scheduling + metadata before the device call
    seconds: float  # the whole step, device included
    compiled: bool  # the step traced and compiled a new bucket


_FIXED_PREFILL_SCORES = 1 << 24
"""Largest prefill-group score tensor (requests x tokens x keys x query heads, float32)
for which the engine pads the XLA dense path's prefill group to the full buckets."""


def _powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    out = [b for b in (1 << k for k in range(32)) if start <= b < limit]
    return (*out, limit)


class Engine:
    """Continuous-batching generation over a ``LlamaModel`` and a paged KV cache.

    Args:
      model: the model (its attention layer fixes backend, block size and cache dtype).
      params: the model's weights (NumPy or jax arrays).
      tokenizer: a transformers tokenizer for text prompts and streamed text (optional
        when prompts are token ids).
      num_blocks: KV cache pages (per data shard); default: every request of
        ``max_num_seqs`` at ``max_model_len``, capped at ``kv_cache_bytes``.
      max_num_seqs: most requests per step (per data shard).
      max_num_batched_tokens: the step's token budget; longer prompts are prefilled in
        chunks of at most this many tokens.
      max_model_len: prompt + new tokens allowed per request (default: the model's
        context length, at most 2048).
      seed: draws the sampling seeds of requests that do not give one.
      mesh: a ``jax.sharding.Mesh`` from ``attn_jax.sharding.make_mesh`` to shard the
        step (requests over "data", heads over "model"); None: one device.
      buckets: padded sizes of the step's shapes (tokens, requests, pages per request);
        default: powers of two up to the limits above. Fewer buckets, fewer compilations.
      kv_cache_bytes: the default ``num_blocks``'s memory cap (all layers, per data
        shard); requests beyond it wait, are preempted, or are refused when alone too big.
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
        self.eos_token_ids = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))

        self._sharded = None if mesh is None else ShardedStep(model, mesh)
        self.num_shards = 1 if self._sharded is None else self._sharded.data_size
        self.schedulers = [
            Scheduler(BlockAllocator(self.num_blocks), self.block_size, max_num_seqs, max_num_batched_tokens)
            for _ in range(self.num_shards)
        ]
        if self._sharded is None:
            self.params = jax.device_put(params)
            self.kv_caches = model.init_kv_caches(self.num_blocks)
            self._jit_step = jax.jit(self._device_step, donate_argnums=1)
        else:
            self.params = self._sharded.put_params(params)
            self.kv_caches = self._sharded.init_kv_caches(self.num_blocks)
            self._jit_step = self._sharded.jit(self._device_step)
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, str] = {}
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

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat: bool = False,
    ) -> str:
        """Queues a request; returns its id. ValueError (naming the value) for an empty
        prompt, one longer than ``max_model_len`` with its new tokens, a token id outside
        the vocabulary, a duplicate id, or a request that cannot fit in the cache."""
        params = SamplingParams() if params is None else params
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character of text")
            ids = self.encode(prompt, chat=chat)
        else:
            ids = [int(i) for i in prompt]
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
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        seed = int(self._rng.integers(2**31)) if params.seed is None else params.seed
        request = Request(request_id, ids, params, seed=seed)
        shard = min(range(self.num_shards), key=lambda s: self._load(self.schedulers[s]))
        self.schedulers[shard].add(request)
        self._requests[request_id] = request
        self._texts[request_id] = ""
        return request_id

    @staticmethod
    def _load(scheduler: Scheduler) -> int:
        return len(scheduler.waiting) + len(scheduler.running)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def get_request(self, request_id: str) -> Request:
        return self._requests[request_id]

    # ------------------------------------------------------------------ the step

    def _device_step(self, params, kv_caches, token_ids, positions, md, logits_rows, sampling):
        """Traced once per bucket: forward, then sampling. Returns (i32[R] tokens, caches).

        Greedy batches skip the sampling work at run time (``lax.cond``), without a
        second compilation."""
        self.num_compilations += 1
        logits, kv_caches = self.model.step(params, kv_caches, token_ids, positions, md, logits_rows)
        temperature = sampling[0]
        tokens = jax.lax.cond(
            jnp.any(temperature > 0),
            lambda: sample_tokens(logits, *sampling),
            lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        )
        return tokens, kv_caches

    def _host_inputs(self, batch: ScheduledBatch, token_bucket: int, req_bucket: int, page_bucket: int):
        """NumPy inputs of one shard's batch, padded to the given buckets."""
        reqs, num_new = batch.requests, batch.num_new
        n = len(reqs)
        query_lens = np.asarray(num_new, np.int32)
        seq_lens = np.asarray([r.num_computed + q for r, q in zip(reqs, num_new, strict=True)], np.int32)
        block_table = np.zeros((n, page_bucket), np.int32)
        for i, r in enumerate(reqs):
            block_table[i, : len(r.blocks)] = r.blocks
        buckets = MetadataBuckets((token_bucket,), (req_bucket,), (page_bucket,))
        md = build_common_attn_metadata(query_lens, seq_lens, block_table, self.block_size, buckets)
        md = self.model.attn.metadata_builder.build_for_jit(md)
        if isinstance(md, XLAAttentionMetadata) and md.q_block:
            scores = req_bucket * token_bucket * page_bucket * self.block_size * self.model.num_heads
            if scores <= _FIXED_PREFILL_SCORES:
                # Small enough: one prefill-group shape per bucket (every request slot, the
                # whole token bucket) instead of one per pair of powers of two: fewer
                # compilations for some padding work.
                prefill_reqs = np.full(req_bucket, req_bucket, np.int32)
                prefill_reqs[: md.prefill_reqs.shape[0]] = md.prefill_reqs
                md = dataclasses.replace(md, prefill_reqs=prefill_reqs, q_block=token_bucket)
        token_ids = np.zeros(token_bucket, np.int32)
        positions = np.zeros(token_bucket, np.int32)
        offset = 0
        for r, q in zip(reqs, num_new, strict=True):
            token_ids[offset : offset + q] = r.all_ids[r.num_computed : r.num_computed + q]
            positions[offset : offset + q] = np.arange(r.num_computed, r.num_computed + q)
            offset += q
        logits_rows = np.zeros(req_bucket, np.int32)
        logits_rows[:n] = np.cumsum(query_lens) - 1
        temperature = np.zeros(req_bucket, np.float32)
        top_p = np.ones(req_bucket, np.float32)
        top_k = np.zeros(req_bucket, np.int32)
        seeds = np.zeros(req_bucket, np.uint32)
        counters = np.zeros(req_bucket, np.int32)
        for i, r in enumerate(reqs):
            temperature[i], top_p[i], top_k[i] = r.params.temperature, r.params.top_p, r.params.top_k
            seeds[i], counters[i] = r.seed, len(r.output_ids)
        sampling = (temperature, top_p, top_k, seeds, counters)
        return token_ids, positions, md, logits_rows, sampling

    def step(self) -> list[TokenEvent]:
        """Schedules and runs one batch; returns the tokens it generated (may be none,
        e.g. while a long prompt is prefilled in chunks)."""
        start = time.perf_counter()
        batches = [s.schedule() for s in self.schedulers]
        if not any(b.requests for b in batches):
            return []
        fits = MetadataBuckets.fit
        token_bucket = fits(self.buckets.token_buckets, max(b.num_tokens for b in batches), "num_tokens")
        req_bucket = fits(self.buckets.request_buckets, max(len(b.requests) for b in batches), "num_reqs")
        pages = max((len(r.blocks) for b in batches for r in b.requests), default=1)
        page_bucket = fits(self.buckets.blocks_per_request_buckets, pages, "blocks per request")
        inputs = [self._host_inputs(b, token_bucket, req_bucket, page_bucket) for b in batches]
        compilations = self.num_compilations
        host_done = time.perf_counter()
        if self._sharded is None:
            token_ids, positions, md, logits_rows, sampling = inputs[0]
            tokens, self.kv_caches = self._jit_step(
                self.params, self.kv_caches, token_ids, positions, md, logits_rows, sampling
            )
            tokens = [np.asarray(tokens)]
        else:
            tokens, self.kv_caches = self._sharded.run(self._jit_step, self.params, self.kv_caches, inputs)
        events = []
        num_prefill = num_decode = num_sampled = 0
        for shard, (batch, shard_tokens) in enumerate(zip(batches, tokens, strict=True)):
            for i, (request, n) in enumerate(zip(batch.requests, batch.num_new, strict=True)):
                request.num_computed += n
                if n > 1:
                    num_prefill += n
                else:
                    num_decode += n
                if request.num_computed < request.num_tokens:
                    continue  # a prefill chunk with more to come
                num_sampled += 1
                events.append(self._append_token(shard, request, int(shard_tokens[i])))
        end = time.perf_counter()
        self.stats.append(
            StepStats(
                num_requests=sum(len(b.requests) for b in batches),
                num_prefill_tokens=num_prefill,
                num_decode_tokens=num_decode,
                num_sampled=num_sampled,
                token_bucket=token_bucket,
                host_seconds=host_done - start,
                seconds=end - start,
                compiled=self.num_compilations > compilations,
            )
        )
        return events

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
        r = self._requests[request_id]
        if r.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished")
        text = "" if self.tokenizer is None else self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return Completion(r.request_id, list(r.prompt_ids), list(r.output_ids), text, r.finish_reason)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[Completion]:
        """Runs ``prompts`` concurrently to completion; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params, strict=True)]
        for _ in self.stream():
            pass
        return [self.completion(i) for i in ids]
