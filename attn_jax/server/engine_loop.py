"""The engine in a thread of its own, fed by the server's event loop.

The HTTP side never calls the engine: ``submit`` and ``abort`` put a command on a list
(under a lock held only to swap that list) and wake the engine thread, which owns the
``Engine`` alone: it encodes prompts (chat template included), adds and aborts requests,
steps while any request is unfinished, and sleeps otherwise. After each step it hands
each request its new tokens' text, one ``Delta`` per token (a multi-step call's K tokens
stream as K events, written in one send: ``RequestHandle.delta_batches``), to that
request's ``asyncio.Queue`` with one ``call_soon_threadsafe`` for the whole step, so the
event loop only ever moves finished data around. A step that
compiled a new shape (none after a complete ``Engine.warmup``) is counted in
``attn_stack_step_compilations_total`` and logged.

Stop strings (``stop``) are matched here, on each request's new text only; a match ends
the request at once (``abort_request`` frees its pages before the next step). A request
whose client has gone is aborted the same way. An exception from ``Engine.step`` itself
(not one request's failure, which the engine contains) leaves the engine in an unknown
state: every request ends with an error and the loop stops; ``/health`` then says so.

Example (inside a running event loop)::

    loop = EngineLoop(engine, ServerMetrics("m"))
    loop.start(asyncio.get_running_loop())
    handle = await loop.submit(GenerationSpec(prompt="Hello", max_tokens=8))
    async for delta in handle.deltas():
        print(delta.text, end="")
    loop.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from attn_jax.server.engine_probe import read_counts
from attn_jax.server.metrics import ServerMetrics
from attn_jax.server.stop_strings import StopMatcher

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take; ``param`` names the field at fault (OpenAI's
    error ``param``), None when no one field is; ``code`` is OpenAI's error code, if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class EngineUnavailableError(RuntimeError):
    """The engine loop is not running (stopped, or stopped by an engine failure)."""


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """One request as the server hands it to the engine thread."""

    prompt: str | Sequence[int] | Sequence[Mapping[str, str]]  # text, token ids, or chat messages
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    chat: bool = False  # prompt holds chat messages, rendered with the model's chat template
    prompt_param: str = "prompt"  # the request field errors about the prompt name
    max_tokens_param: str = "max_tokens"


@dataclasses.dataclass(slots=True)  # not frozen: one is made per token, and a frozen init costs 4x
class Delta:
    """What one request got from one engine step: new text and tokens, and its end."""

    text: str
    num_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    error: str | None = None


class RequestHandle:
    """The event loop's side of one request: its deltas, in order, until it finishes.

    ``close`` aborts it if it has not finished (a client that went away); it is safe to
    call more than once."""

    def __init__(self, request_id: str, owner: EngineLoop) -> None:
        self.request_id = request_id
        self.prompt_tokens = 0  # set once the engine thread has admitted it
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()

    async def deltas(self) -> AsyncIterator[Delta]:
        async for batch in self.delta_batches():
            for delta in batch:
                yield delta

    async def delta_batches(self) -> AsyncIterator[list[Delta]]:
        """The deltas in order, each batch all that had arrived when it was taken (a multi-step
        call's K tokens come together): a stream writes them in one send, one event each."""
        while not self.finished:
            batch = [await self._queue.get()]
            while batch[-1].finish_reason is None and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self.finished = batch[-1].finish_reason is not None
            yield batch

    async def collect(self) -> tuple[str, int, str, str | None]:
        """Waits for the end: (text, generated tokens, finish reason, error)."""
        parts, tokens = [], 0
        async for d in self.deltas():
            parts.append(d.text)
            tokens += d.num_tokens
        return "".join(parts), tokens, d.finish_reason, d.error

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


@dataclasses.dataclass(eq=False)
class _Live:
    """The engine thread's record of one admitted request."""

    handle: RequestHandle
    stop: StopMatcher
    arrival: float
    num_tokens: int = 0
    last_token_at: float | None = None


class EngineLoop:
    """Runs ``engine`` in a daemon thread; ``submit`` / ``abort`` from the event loop.

    Args:
      engine: an ``attn_jax.serving.Engine`` (only its public API is used, plus
        ``engine_probe`` for the metrics' counts).
      metrics: where the loop records tokens, latencies and the engine's counts.
    """

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.failure: str | None = None  # why the loop stopped, when an engine step failed
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._closed = False  # no more commands are taken (the thread is ending)
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _Live] = {}  # engine thread only
        self._compilations: int | None = None  # the engine's step compilations so far (engine thread only)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ event loop side

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread; deltas are delivered on ``aloop``."""
        if self._thread is not None:
            raise RuntimeError("this EngineLoop was already started")
        self._aloop = aloop
        self._thread = threading.Thread(target=self._run, name="attn-stack-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every request (reason "abort") and joins the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    async def submit(self, spec: GenerationSpec, request_id: str | None = None) -> RequestHandle:
        """Queues a request; returns its handle once the engine thread has admitted it.
        Raises ``RequestError`` for one it refuses (naming the field),
        ``EngineUnavailableError`` when the loop is not running."""
        if not self.running or self._stopping:
            raise EngineUnavailableError(self.failure or "the engine loop is not running")
        handle = RequestHandle(request_id or f"req-{next(self._ids)}", self)
        admitted = asyncio.get_running_loop().create_future()
        self._command(("submit", spec, handle, admitted, time.perf_counter()))
        try:
            await admitted
        except asyncio.CancelledError:  # the client went away while it was being admitted
            handle.close()
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Ends a request (reason "abort") and frees its pages; thread-safe, idempotent."""
        self._command(("abort", request_id))

    def _command(self, command: tuple) -> None:
        with self._cond:
            if self._closed:
                if command[0] == "abort":
                    return
                raise EngineUnavailableError(self.failure or "the engine loop has stopped")
            self._commands.append(command)
            self._cond.notify()

    def _settle(self, future: asyncio.Future, handle: RequestHandle, error: Exception | None) -> None:
        """(On the event loop.) Tells ``submit`` how admission went."""
        if future.done():  # submit was cancelled; the handle's close aborted the request
            return
        if error is None:
            future.set_result(handle)
        else:
            future.set_exception(error)

    @staticmethod
    def _deliver(batch: list[tuple[RequestHandle, list[Delta]]]) -> None:
        """(On the event loop.) Hands each request its deltas, in order."""
        for handle, deltas in batch:
            for delta in deltas:
                handle._queue.put_nowait(delta)

    def _post(self, callback, *args) -> None:
        try:
            self._aloop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        self._compilations = getattr(self.engine, "num_compilations", None)  # the warm-up's are not counted
        try:
            self._update_counts()
            while self._iterate():
                pass
        except Exception as e:  # an engine step failed as a whole: its state is unknown
            self.failure = f"the engine failed: {type(e).__name__}: {e}"
            logger.exception("the engine loop stopped")
            self._end_all("error", self.failure)
        else:
            self._end_all("abort", None)

    def _iterate(self) -> bool:
        """One round: run the queued commands, step once if there is work; False to stop."""
        with self._cond:
            while not self._commands and not self._stopping and not self.engine.has_unfinished():
                self._cond.wait()
            commands, self._commands = self._commands, []
            stopping = self._stopping
        out: dict[str, list] = {}
        for command in commands:
            if command[0] == "submit":
                self._admit(*command[1:])
            else:
                self._abort(command[1], out)
        if stopping:
            self._send(out)
            return False
        if self.engine.has_unfinished():
            events = self.engine.step()
            self._on_events(events, time.perf_counter(), out)
            self._count_compilations()
        self._send(out)
        self._update_counts()
        return True

    def _count_compilations(self) -> None:
        """Counts (and logs) step shapes compiled while serving: each stalled every stream."""
        total = getattr(self.engine, "num_compilations", None)
        if total is None:
            return
        new, self._compilations = total - (self._compilations or 0), total
        if new > 0:
            self.metrics.step_compilations.inc(new)
            logger.warning(
                "the engine compiled %d new step shape(s) while serving (every stream waited for it); "
                "start without --no-warmup, or with a larger --warmup-max-shapes / more --warmup-sampling variants",
                new,
            )

    def _update_counts(self) -> None:
        """The request and KV page gauges (the server's own counts where the engine's are unknown)."""
        started = sum(live.num_tokens > 0 for live in self._live.values())
        self.metrics.set_counts(read_counts(self.engine), started, len(self._live) - started)

    def _admit(self, spec: GenerationSpec, handle: RequestHandle, admitted: asyncio.Future, arrival: float) -> None:
        try:
            ids, params = self._prepare(spec)
            self.engine.add_request(ids, params, request_id=handle.request_id)
        except RequestError as e:
            self._post(self._settle, admitted, handle, e)
            return
        except (ValueError, TypeError) as e:  # the engine's own checks
            self._post(self._settle, admitted, handle, RequestError(str(e), spec.prompt_param))
            return
        handle.prompt_tokens = len(ids)
        self._live[handle.request_id] = _Live(handle, StopMatcher(spec.stop), arrival)
        self.metrics.prompt_tokens.inc(len(ids))
        self._post(self._settle, admitted, handle, None)

    def _prepare(self, spec: GenerationSpec):
        """The prompt's token ids and the engine's ``SamplingParams``; RequestError naming
        the field for a prompt that does not fit the context or the cache."""
        from attn_jax.serving import SamplingParams

        engine, name = self.engine, spec.prompt_param
        try:
            if spec.chat:
                ids = self._chat_ids(spec.prompt)
            elif isinstance(spec.prompt, str):
                ids = engine.encode(spec.prompt)
            else:
                ids = [int(i) for i in spec.prompt]
        except RequestError:
            raise
        except Exception as e:  # a template that refuses the messages, a missing tokenizer, ...
            raise RequestError(f"{name} could not be encoded: {e}", name) from None
        if not ids:
            raise RequestError(f"{name} encodes to no tokens: give some text", name)
        vocab = engine.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab})", name)
        limit = engine.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"{name} has {len(ids)} tokens; this model's context is max_model_len={limit} tokens, "
                "prompt and completion together: shorten it",
                name,
            )
        max_tokens = limit - len(ids) if spec.max_tokens is None else spec.max_tokens
        if len(ids) + max_tokens > limit:
            raise RequestError(
                f"{spec.max_tokens_param}={max_tokens} with a {name} of {len(ids)} tokens exceeds this model's "
                f"context, max_model_len={limit}: ask for at most {limit - len(ids)}",
                spec.max_tokens_param,
            )
        block_size, num_blocks = getattr(engine, "block_size", None), getattr(engine, "num_blocks", None)
        if block_size and num_blocks and -(-(len(ids) + max_tokens) // block_size) > num_blocks:
            fits = num_blocks * block_size - len(ids)
            raise RequestError(
                f"{spec.max_tokens_param}={max_tokens} with a {name} of {len(ids)} tokens needs more KV cache than "
                f"the engine has ({num_blocks} pages of {block_size} tokens): ask for at most {fits}",
                spec.max_tokens_param if fits > 0 else name,
            )
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            seed=spec.seed, ignore_eos=spec.ignore_eos,
        )  # fmt: skip
        return ids, params

    def _chat_ids(self, messages) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template: use /v1/completions", "messages")
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _abort(self, request_id: str, out: dict) -> None:
        live = self._live.get(request_id)
        if live is None:  # already finished (its last delta is on its way) or never admitted
            return
        self._engine_abort(request_id)
        self._finish(live, "abort", None, out)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except KeyError:  # the engine has already let go of it
            pass

    def _on_events(self, events, now: float, out: dict) -> None:
        """Turns the step's ``TokenEvent``s into each request's delta (stop strings applied);
        the step's tokens and latencies reach the metrics in one call each."""
        first, gaps = [], []
        for event in events:
            live = self._live.get(event.request_id)
            if live is None:  # ended here already (a stop string, an abort)
                continue
            if event.token_id >= 0:
                live.num_tokens += 1
                if live.last_token_at is None:
                    first.append(now - live.arrival)
                else:
                    gaps.append(now - live.last_token_at)
                live.last_token_at = now
            text, stopped = live.stop.feed(event.text)
            self._add(out, live, text, int(event.token_id >= 0))
            if stopped:
                if not event.finished:
                    self._engine_abort(event.request_id)
                self._finish(live, "stop", None, out)
            elif event.finished:
                self._add(out, live, live.stop.flush(), 0)
                self._finish(live, event.finish_reason, event.error, out)
        if first or gaps:
            self.metrics.generation_tokens.inc(len(first) + len(gaps))
            self.metrics.time_to_first_token.observe_many(first)
            self.metrics.inter_token_latency.observe_many(gaps)

    @staticmethod
    def _add(out: dict, live: _Live, text: str, num_tokens: int) -> None:
        """Queues a request's next piece: a token's text as a delta of its own (so a
        multi-step call's tokens stream one chunk each), text without a token joined to
        the piece before it."""
        entry = out.setdefault(live.handle.request_id, [live.handle, [], None, None])
        if num_tokens or not entry[1]:
            entry[1].append([text, num_tokens])
        else:
            entry[1][-1][0] += text

    def _finish(self, live: _Live, reason: str, error: str | None, out: dict) -> None:
        self._add(out, live, "", 0)
        out[live.handle.request_id][2:] = [reason, error]
        del self._live[live.handle.request_id]
        self.metrics.request_finished(reason)
        self.metrics.e2e_request_latency.observe(time.perf_counter() - live.arrival)

    def _send(self, out: dict) -> None:
        if out:
            batch = []
            for handle, pieces, reason, error in out.values():
                *first, (text, n) = pieces
                batch.append((handle, [*(Delta(t, k) for t, k in first), Delta(text, n, reason, error)]))
            self._post(self._deliver, batch)

    def _end_all(self, reason: str, error: str | None) -> None:
        """Ends every live request (the loop is stopping) and tells its client."""
        out: dict = {}
        for request_id, live in list(self._live.items()):
            try:
                self._engine_abort(request_id)
            except Exception:  # a failed engine may refuse even this; the request ends anyway
                pass
            self._finish(live, reason, error, out)
        self._send(out)
        with self._cond:  # submissions that arrived meanwhile will never be admitted
            pending, self._commands = self._commands, []
            self._closed = True
        for command in pending:
            if command[0] == "submit":
                self._post(self._settle, command[3], command[2], EngineUnavailableError(error or "server stopping"))
