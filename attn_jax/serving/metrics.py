"""Step statistics of a long-running engine in bounded memory.

``StepStats`` says what one engine call did and how long it took until its tokens were
read back (the true time, also under asynchronous scheduling, where a call's ``step``
returns before the device has run it). ``StepStatsLog`` keeps the last
``maxlen`` of them under their absolute step numbers (``log[len(log) - 1]`` is the
newest, so ``first = len(log); ...; log[first:]`` reads the steps since ``first`` while
they are in the window). ``EngineTotals`` are running sums over every step ever read
back; the difference of two snapshots gives honest rates over a span:

    before = engine.totals
    engine.generate(prompts)
    span = engine.totals - before
    span.decode_tokens_per_s, span.prefill_tokens_per_s
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine call did (data shards summed).

    ``seconds`` and ``latency_seconds`` are None until the call's tokens are read back
    (with asynchronous scheduling: during the next ``step``)."""

    num_requests: int
    num_prefill_tokens: int  # tokens of requests with more than one new token
    num_decode_tokens: int
    num_sampled: int
    num_steps: int  # decode steps the call ran (``num_scheduler_steps`` in a multi-step decode, else 1)
    token_bucket: int
    host_seconds: float  # scheduling + metadata + packing before the device call
    dispatch_seconds: float  # the jitted call's return (enqueueing the step, not running it)
    # The call's share of the wall time: from the start of its ``step`` (or the previous call's
    # end, when later) to its tokens being computed (read back; or seen done when the dispatch
    # returned, for a runtime that runs the call inside it). The calls' shares do not overlap and
    # add up to the engine's busy wall time, host work included.
    seconds: float | None
    compiled: bool  # the call traced and compiled a new bucket
    latency_seconds: float | None = None  # from its dispatch to its tokens being read back
    num_queried_tokens: int = 0  # prefix cache: known tokens of the requests admitted in this call
    num_cached_tokens: int = 0  # prefix cache: of them, found cached (not computed)
    cascade_prefix_len: int = 0  # cascade attention: shared tokens read once for the batch (0: not used)


class StepStatsLog:
    """The last ``maxlen`` ``StepStats`` under absolute step numbers.

    ``len(log)`` counts every step recorded; ``log[i]`` (an int or a slice, negative
    numbers counted from ``len(log)``) raises IndexError for a step that has left the
    window; iterating yields the steps in the window, oldest first.
    """

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._items: collections.deque[StepStats] = collections.deque(maxlen=maxlen)
        self._first = 0  # the step number of _items[0]

    def __len__(self) -> int:
        return self._first + len(self._items)

    def __iter__(self):
        return iter(self._items)

    @property
    def first_index(self) -> int:
        """The oldest step still in the window."""
        return self._first

    def _position(self, i: int) -> int:
        if i < self._first or i >= len(self):
            where = "has left" if 0 <= i < self._first else "is outside"
            raise IndexError(
                f"step {i} {where} the window of steps [{self._first}, {len(self)}) "
                f"(the log keeps the last {self.maxlen})"
            )
        return i - self._first

    def __getitem__(self, index):
        if isinstance(index, slice):
            steps = range(*index.indices(len(self)))
            if len(steps) and min(steps[0], steps[-1]) < self._first:
                self._position(min(steps[0], steps[-1]))  # raises
            return [self._items[i - self._first] for i in steps]
        i = index + len(self) if index < 0 else index
        return self._items[self._position(i)]

    def append(self, stats: StepStats) -> int:
        """Records a step; returns its step number."""
        if len(self._items) == self.maxlen:
            self._first += 1
        self._items.append(stats)
        return len(self) - 1

    def replace(self, i: int, stats: StepStats) -> None:
        """Replaces step ``i`` (its timing filled in); a step that has left the window is skipped."""
        if self._first <= i < len(self):
            self._items[i - self._first] = stats


@dataclasses.dataclass(frozen=True)
class EngineTotals:
    """Running sums over every call read back. ``rate_*`` fields count the calls that
    compiled nothing: a call with prefill tokens counts as prefill, one of decodes only as
    decode (multi-step decodes included)."""

    steps: int = 0
    compiled_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    sampled_tokens: int = 0
    host_seconds: float = 0.0
    seconds: float = 0.0  # the calls' shares of the wall time (``StepStats.seconds``) added up
    rate_prefill_tokens: int = 0
    rate_prefill_seconds: float = 0.0
    rate_decode_tokens: int = 0
    rate_decode_seconds: float = 0.0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    cascade_steps: int = 0  # calls that ran cascade attention

    def add(self, s: StepStats) -> EngineTotals:
        """These totals with one more call (read back: its ``seconds`` known)."""
        warm = not s.compiled
        prefill = warm and s.num_prefill_tokens > 0
        decode = warm and not s.num_prefill_tokens
        return EngineTotals(
            steps=self.steps + 1,
            compiled_steps=self.compiled_steps + s.compiled,
            prefill_tokens=self.prefill_tokens + s.num_prefill_tokens,
            decode_tokens=self.decode_tokens + s.num_decode_tokens,
            sampled_tokens=self.sampled_tokens + s.num_sampled,
            host_seconds=self.host_seconds + s.host_seconds,
            seconds=self.seconds + s.seconds,
            rate_prefill_tokens=self.rate_prefill_tokens + (s.num_prefill_tokens if prefill else 0),
            rate_prefill_seconds=self.rate_prefill_seconds + (s.seconds if prefill else 0.0),
            rate_decode_tokens=self.rate_decode_tokens + (s.num_decode_tokens if decode else 0),
            rate_decode_seconds=self.rate_decode_seconds + (s.seconds if decode else 0.0),
            prefix_cache_queried_tokens=self.prefix_cache_queried_tokens + s.num_queried_tokens,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens + s.num_cached_tokens,
            cascade_steps=self.cascade_steps + (s.cascade_prefix_len > 0),
        )

    def __sub__(self, other: EngineTotals) -> EngineTotals:
        return EngineTotals(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prefill tokens per second of the calls with prefill tokens; None without any."""
        return self.rate_prefill_tokens / self.rate_prefill_seconds if self.rate_prefill_seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode tokens per second of the decode-only calls; None without any."""
        return self.rate_decode_tokens / self.rate_decode_seconds if self.rate_decode_seconds > 0 else None

    @property
    def mean_host_ms_per_step(self) -> float | None:
        return 1e3 * self.host_seconds / self.steps if self.steps else None
