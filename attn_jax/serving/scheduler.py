"""Continuous batching with chunked prefill under a token budget (vLLM v1's scheme).

Every step the scheduler gives each running request its next tokens (one for a decode,
a chunk of the prompt for a prefill), oldest first, then admits waiting requests while
the token budget, the sequence limit and the free pages allow. A request that needs a
page when none is free preempts the newest running request (its pages are freed and it
is recomputed later from its prompt and the tokens it has generated), so no request
ever writes into another's pages.

With automatic prefix caching (``enable_prefix_caching``, ``kv_cache_manager.py``) a
request is admitted with the longest cached prefix of its tokens already computed: its
``num_computed`` starts there and only the rest is scheduled. Full blocks are hashed
into the cache once their k/v are dispatched (at each ``schedule``, and when a request
finishes or is preempted), so a request admitted in a later step reuses them.

Unlike vLLM, a block is shared only from the step after the one that computes it: the
attention ops do not promise that one request reads another's k/v written in the same
call (a fused kernel may write and read them in any order). So that requests arriving
together still compute a shared prefix once, a waiting request whose next block is
being computed in this step by another request is skipped for one step (vLLM shares it
in the same step, relying on its cache write running before attention).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import numbers
from collections import deque

from attn_jax.serving.block_allocator import BlockAllocator
from attn_jax.serving.cascade import num_common_prefix_blocks
from attn_jax.serving.kv_cache_manager import KVCacheManager
from attn_jax.serving.sampling import MAX_LOGPROBS
from attn_jax.types import SEED_LIMIT, validate_positive_int

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and when it stops.

    temperature 0 is greedy; otherwise logits / temperature, then top-k (0 = off) and
    top-p (1.0 = off) filtering, then a draw from a key derived from ``seed`` and the
    token's index, so a seeded request gives the same tokens in any batch. ``seed``
    None: the engine draws one from its own seed. ``stop``: strings that end the
    request (finish reason "stop") where its text first contains one; the text ends
    before it (the tokens keep the one that completed it). ``logprobs`` N (None: off):
    each token's log-probability and those of the N most likely tokens (0 to
    ``sampling.MAX_LOGPROBS``), from the logits before temperature and filters (after the
    penalties, when the request has any). ``prompt_logprobs`` N (None: off; vLLM's): each
    prompt token's log-probability given the tokens before it (the first has none: None) and
    those of the N most likely tokens there (0 to ``sampling.MAX_LOGPROBS``), from the float32
    log-softmax of the model's logits at every prompt position (no penalties, no
    temperature), computed in the prefill (``ModelRunner``); such a request takes no
    prefix-cache hits (each position's logits must be computed) and is never given a prefill
    chunk of one token that is not its prompt's last (so it never needs a decode-shaped
    program with every row's logits).

    Penalties (vLLM's and OpenAI's; ``sampling.apply_penalties``) change the logits before
    temperature, filters and greedy's argmax: ``presence_penalty`` and ``frequency_penalty``
    in [-2, 2] (0 = off) over the generated tokens, ``logit -= frequency * count + presence
    * (count > 0)``; ``repetition_penalty`` > 0 (1 = off) over the prompt's and the generated
    tokens, a seen token's logit divided by it when positive, multiplied when negative. The
    values are data on the device: none compiles a program. A request with a repetition
    penalty (or one with presence / frequency penalties recomputed after a preemption) takes
    no prefix-cache hits: the step counts the tokens it computes, so it computes them all.

    ``json_schema`` (None: off; structured outputs, ``structured_output.py``): a JSON Schema as
    JSON text the output must match (OpenAI's ``json_object`` is ``{"type": "object"}``); the
    engine masks each step's logits with the grammar's allowed tokens, ends the request with
    "stop" when the grammar is complete, and gives it one step of each call (its next mask
    needs its last token).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | tuple[str, ...] = ()  # strings that end the output text where they appear (not returned)
    logprobs: int | None = None  # alternatives per token whose log-probabilities come back; None: none
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    prompt_logprobs: int | None = None  # alternatives per prompt token whose log-probabilities come back
    json_schema: str | None = None  # the JSON Schema (JSON text) the output must match; None: free text

    def __post_init__(self) -> None:
        # Any real / integral number is accepted (NumPy scalars included) and stored as a Python one.
        def real(x) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool)

        def integral(x) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        set_ = functools.partial(object.__setattr__, self)
        set_("max_new_tokens", validate_positive_int("max_new_tokens", self.max_new_tokens))
        if not (real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        set_("temperature", float(self.temperature))
        if not (real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        set_("top_p", float(self.top_p))
        if not integral(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        set_("top_k", int(self.top_k))
        if self.seed is not None:
            if not integral(self.seed):
                raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**32) or None")
            if not 0 <= self.seed < SEED_LIMIT:
                raise ValueError(f"seed={self.seed!r} is outside [0, 2**32) (sampling keys take a uint32 seed)")
            set_("seed", int(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop={self.stop!r} must be a non-empty string or a list of non-empty strings")
        set_("stop", tuple(stop))
        if self.logprobs is not None:
            if not integral(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs={self.logprobs!r} must be an int in [0, {MAX_LOGPROBS}] (alternatives per token) or None"
                )
            set_("logprobs", int(self.logprobs))
        if self.prompt_logprobs is not None:
            if not integral(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs={self.prompt_logprobs!r} must be an int in [0, {MAX_LOGPROBS}] "
                    "(alternatives per prompt token) or None"
                )
            set_("prompt_logprobs", int(self.prompt_logprobs))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (real(value) and -2 <= value <= 2):
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0 = off)")
            set_(name, float(value))
        value = self.repetition_penalty
        if not (real(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"repetition_penalty={value!r} must be a finite number > 0 (1 = off)")
        set_("repetition_penalty", float(value))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(
                f"json_schema={self.json_schema!r} must be a JSON Schema as JSON text (str; json.dumps a dict) or None"
            )

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (the request's logits are changed; it needs token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


MIN_STEPS_CAP = 8
"""A multi-step decode call is capped at what its requests can still generate, never below
this (``Engine._decode_steps``; ``warmup.decode_step_counts``)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed (params.seed or drawn by the engine)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose k/v are in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_new_tokens) | "abort" | "error"
    error: str | None = None  # why the request failed (finish_reason "error")
    num_preemptions: int = 0
    cache_salt: str | None = None  # an extra key of the first block's hash: only equal salts share a prefix
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chained hashes of its full known blocks
    num_cached_tokens: int = 0  # tokens taken from the prefix cache at its (last) admission
    # Tokens sampled on the device but not read back yet (asynchronous scheduling: the last
    # call's, one or a multi-step decode's; the next step takes the last one's value from
    # the device).
    num_pending: int = 0
    # With penalties, while running: the row of the device's token counts it owns
    # (``ModelRunner``), -1 otherwise; and its tokens known when it took that row, which the
    # step counts from its inputs (the later ones are counted when sampled).
    penalty_slot: int = -1
    num_counted_inputs: int = 0
    # With a json_schema, while running: the row of the device's token masks it owns, -1 otherwise.
    guide_slot: int = -1

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Generated tokens, pending ones included."""
        return len(self.output_ids) + self.num_pending

    def known_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) that the host knows (a pending last token
        is left out: the list is then one shorter)."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        return (self.prompt_ids[start:] if start < num_prompt else []) + self.output_ids[
            max(start - num_prompt, 0) : stop - num_prompt
        ]

    @property
    def max_tokens(self) -> int:
        """Prompt + max_new_tokens: the longest this request can get."""
        return len(self.prompt_ids) + self.params.max_new_tokens


def wants_prompt_logprobs(request: Request) -> bool:
    """Whether ``request``'s next token to compute is a prompt position whose logits give a
    prompt log-probability it asks for (any but the prompt's last position)."""
    return request.params.prompt_logprobs is not None and request.num_computed < len(request.prompt_ids) - 1


@dataclasses.dataclass
class ScheduledBatch:
    """One step's work: ``num_new[i]`` tokens of ``requests[i]`` from its ``num_computed``."""

    requests: list[Request]
    num_new: list[int]
    preempted: list[Request]
    num_queried_tokens: int = 0  # known tokens of the requests admitted in this step
    num_cached_tokens: int = 0  # of them, taken from the prefix cache (not computed)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    """Chooses each step's requests and token counts; owns the block tables.

    Args:
      allocator: the pages of the KV cache.
      block_size: tokens per page.
      max_num_seqs: most requests in one step.
      max_num_batched_tokens: the token budget of one step (prefill chunks are cut to it).
      enable_prefix_caching: share cached full blocks between requests (the module
        docstring says how); the ``Engine`` turns it on by default.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.allocator = allocator
        self.block_size = validate_positive_int("block_size", block_size)
        self.max_num_seqs = validate_positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = validate_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.kv_cache_manager = KVCacheManager(allocator, block_size, enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._warned_full = False
        # Rows of the device's token counts (``ModelRunner``) free for a request with penalties,
        # and of its token masks for a request with a json_schema.
        self._free_penalty_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self._free_guide_slots = list(range(self.max_num_seqs - 1, -1, -1))

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_cache_manager.enable_caching

    def add(self, request: Request) -> None:
        pages = -(-request.max_tokens // self.block_size)
        if pages > self.allocator.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {pages} KV cache pages "
                f"({len(request.prompt_ids)} prompt + {request.params.max_new_tokens} new tokens, "
                f"block_size={self.block_size}) but the cache holds {self.allocator.num_blocks}: "
                "lower max_new_tokens or give the engine more num_blocks"
            )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release_slots(self, request: Request) -> None:
        """Gives back ``request``'s rows of the device's token counts and token masks."""
        if request.penalty_slot >= 0:
            self._free_penalty_slots.append(request.penalty_slot)
            request.penalty_slot = -1
        if request.guide_slot >= 0:
            self._free_guide_slots.append(request.guide_slot)
            request.guide_slot = -1

    @staticmethod
    def _counts_every_token(request: Request) -> bool:
        """Whether the step must see all of ``request``'s known tokens to count them (a
        repetition penalty counts the prompt; presence / frequency the generated tokens a
        recomputed request has), so that it takes no prefix-cache hits."""
        p = request.params
        return (
            p.repetition_penalty != 1
            or (p.has_penalties and bool(request.output_ids))
            or wants_prompt_logprobs(request)
        )

    def _preempt(self, request: Request) -> None:
        self._release_slots(request)
        self.kv_cache_manager.free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)
        logger.info(
            "KV cache full: request %r preempted (it will be recomputed; %d pages free)",
            request.request_id,
            self.allocator.num_free,
        )

    def schedule(self) -> ScheduledBatch:
        """The next step's batch; running requests first (oldest first), then new ones
        (each from the longest cached prefix of its tokens, with prefix caching). A new
        request whose next uncached block is one this step computes for another request
        waits a step and takes it from the cache (skipped, not blocking those behind it)."""
        manager = self.kv_cache_manager
        manager.cache_full_blocks(self.running)  # blocks filled by the dispatched steps join the prefix cache
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        num_new: list[int] = []
        preempted: list[Request] = []
        running, block_size = RequestStatus.RUNNING, self.block_size
        # The loop runs once per running request and step (256 a batch-256 step), so it reads the
        # fields that ``num_tokens``, ``num_generated`` and ``_new_pages`` would compute inline.
        for request in list(self.running):
            if request.status is not running:  # preempted by an older request this step
                continue
            num_generated = len(request.output_ids) + request.num_pending
            n = min(len(request.prompt_ids) + num_generated - request.num_computed, budget)
            if n <= 0 or num_generated >= request.params.max_new_tokens:
                continue  # nothing to compute, or its last token is pending and ends it
            if request.guide_slot >= 0 and request.num_pending:
                continue  # its next mask needs its pending token: it sits this call out, nobody waits
            if n == 1 and wants_prompt_logprobs(request):
                continue  # a one-token chunk would need a decode-shaped program with every row's logits
            if request.num_computed + n > len(request.blocks) * block_size:  # else its pages hold the tokens
                while not manager.allocate_slots(request, n):  # nothing taken when the pool cannot supply them
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if request.status is not running:
                    continue
            scheduled.append(request)
            num_new.append(n)
            budget -= n
            if budget == 0:
                break

        num_queried = num_cached = 0
        pending = set()  # the blocks this step completes, which a waiting request may take next step
        if self.waiting:
            pending = {h for r, n in zip(scheduled, num_new, strict=True) for h in manager.blocks_completed(r, n)}
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if request in preempted or request.num_pending:
                break  # not in the step that preempted it, nor before its last token is known
            hits, num_hit = manager.get_computed_blocks(request)
            if self._counts_every_token(request):
                hits, num_hit = [], 0
            elif manager.next_block_pending(request, len(hits), pending):
                continue  # its next block is computed in this step: it takes it from the cache in the next
            n = min(request.num_tokens - num_hit, budget)
            if n == 1 and wants_prompt_logprobs(request):
                break  # as for running requests: no one-token chunk before its prompt's last token
            if not manager.allocate_slots(request, n, hits):
                if not self._warned_full:
                    logger.info(
                        "KV cache full: request %r waits (%d pages needed, %d free)",
                        request.request_id,
                        manager.num_pages_needed(request, n, hits),
                        self.allocator.num_free,
                    )
                    self._warned_full = True
                break
            self.waiting.remove(request)
            request.num_computed = request.num_cached_tokens = num_hit
            pending.update(manager.blocks_completed(request, n))
            manager.record_admission(request, num_hit)
            if manager.enable_caching:
                num_queried += request.num_tokens
                num_cached += num_hit
            request.status = RequestStatus.RUNNING
            if request.params.has_penalties:  # its counts start over with this admission
                request.penalty_slot = self._free_penalty_slots.pop()
                request.num_counted_inputs = request.num_tokens
            if request.params.json_schema is not None:  # its mask is written into this row before its call
                request.guide_slot = self._free_guide_slots.pop()
            self.running.append(request)
            scheduled.append(request)
            num_new.append(n)
            budget -= n
        return ScheduledBatch(scheduled, num_new, preempted, num_queried, num_cached)

    def pending_elsewhere(self, sampled: set[Request]) -> bool:
        """Whether a running request that ``schedule`` may run next has a token pending that is
        not among ``sampled`` (the requests a call samples), e.g. a decode that call left out
        behind a token budget older requests used up. The ones ``schedule`` skips while their
        token is pending (at their length limit, or guided) do not count."""
        return any(
            r.num_pending and r not in sampled and r.guide_slot < 0 and r.num_generated < r.params.max_new_tokens
            for r in self.running
        )

    def reserve_decode_steps(self, batch: ScheduledBatch, num_steps: int) -> list[int] | None:
        """Pages for a multi-step decode of ``batch`` (decodes only): each request's steps
        (``num_steps``, or fewer when it has fewer tokens left; one for a guided request, whose
        next token mask needs its last token), with the pages for them allocated; None, with
        nothing allocated, when the free pages do not suffice."""
        manager = self.kv_cache_manager
        steps = [
            1 if r.guide_slot >= 0 else min(num_steps, r.params.max_new_tokens - r.num_generated)
            for r in batch.requests
        ]
        needs = [manager.num_pages_needed(r, n) for r, n in zip(batch.requests, steps, strict=True)]
        if not self.allocator.can_allocate(sum(needs)):
            return None
        for request, n in zip(batch.requests, steps, strict=True):
            manager.allocate_slots(request, n)
        return steps

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """Marks ``request`` (running or waiting) finished and frees its pages (its full
        computed blocks stay in the prefix cache, evictable)."""
        running = request.status is RequestStatus.RUNNING  # a running request is in self.running
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self._release_slots(request)
        self.kv_cache_manager.free(request)
        if running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._warned_full = False

    def num_common_prefix_blocks(self) -> int:
        """Leading pages every running request holds (``cascade.num_common_prefix_blocks``):
        the prefix cascade attention may read once for the step."""
        return num_common_prefix_blocks(self.allocator, self.running)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (with a logged warning, nothing changed) while
        any request holds pages, as vLLM's ``reset_prefix_cache``."""
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def prefix_cache_stats(self):
        """The ``PrefixCacheStats`` of every admission so far."""
        return self.kv_cache_manager.stats
