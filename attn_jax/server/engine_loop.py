"""The server's side of the engine: ``submit`` and ``abort`` from the event loop, deltas back.

The engine itself is driven by an ``EngineCore`` (``engine_core``), the only code that
touches it, in a daemon thread of this process (``EngineLoop(engine, metrics)``) or in an
engine process of its own (``EngineLoop(EngineProcess(factory), metrics)``, what
``attn-stack serve`` runs: the engine then has a GIL of its own). Either way the event
loop only sends commands (submit, abort, stop) and takes the core's round messages: it
settles each submission, hands each request its new tokens' text as one ``Delta`` per
token (a multi-step call's K tokens stream as K events, written in one send:
``RequestHandle.delta_batches``) and applies the round's metrics in one call. A step
that compiled a new shape (none after a complete ``Engine.warmup``) is counted in
``attn_stack_step_compilations_total`` and logged.

Stop strings (``stop``) are matched by the core, on each request's new text only; a
match ends the request at once (its pages are freed before the next step). A request
whose client has gone is aborted the same way. An engine that fails as a whole (a step
that raised, or an engine process that died) ends every request with an error;
``/health`` then says so.

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
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable

from attn_jax.server.engine_core import EngineCore, GenerationSpec, RequestError
from attn_jax.server.metrics import ServerMetrics

__all__ = ["Delta", "EngineLoop", "EngineUnavailableError", "GenerationSpec", "RequestError", "RequestHandle"]


@typing.runtime_checkable
class CoreHandle(typing.Protocol):
    """What ``EngineLoop`` drives an engine core through (``EngineProcess``'s methods): the
    core runs elsewhere, takes commands (``send``) and hands each round's message to the
    callback ``start`` gave it, on the event loop."""

    max_model_len: int

    def start(self, aloop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None]) -> None: ...

    def send(self, command: tuple) -> None: ...

    def alive(self) -> bool: ...

    def join(self, timeout: float) -> None: ...


class EngineUnavailableError(RuntimeError):
    """The engine loop is not running (stopped, or stopped by an engine failure)."""


@dataclasses.dataclass(slots=True)  # not frozen: one is made per token, and a frozen init costs 4x
class Delta:
    """What one request got from one engine step: new text and tokens, and its end."""

    text: str
    num_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    error: str | None = None
    # The token's (text, logprob, ((text, logprob), ...) alternatives) when the request asked
    # for log-probabilities (``GenerationSpec.logprobs``); else None. An echoed prompt's delta
    # (``GenerationSpec.echo``, no tokens) holds a list of them, one per prompt token.
    scores: tuple | list | None = None


class RequestHandle:
    """The event loop's side of one request: its deltas, in order, until it finishes.

    ``close`` aborts it if it has not finished (a client that went away); it is safe to
    call more than once."""

    def __init__(self, request_id: str, owner: EngineLoop) -> None:
        self.request_id = request_id
        self.prompt_tokens = 0  # set once the engine core has admitted it
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

    async def collect(self) -> tuple[str, int, str, str | None, list[tuple]]:
        """Waits for the end: (text, generated tokens, finish reason, error, each token's
        ``Delta.scores`` when the request asked for log-probabilities)."""
        parts, tokens, scores = [], 0, []
        async for d in self.deltas():
            parts.append(d.text)
            tokens += d.num_tokens
            if isinstance(d.scores, list):  # an echoed prompt's
                scores.extend(d.scores)
            elif d.scores is not None:
                scores.append(d.scores)
        return "".join(parts), tokens, d.finish_reason, d.error, scores

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class _EngineThread:
    """An ``EngineCore`` in a daemon thread of this process: commands on a list, swapped
    under a lock; messages posted to the event loop."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.max_model_len: int = engine.max_model_len
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._thread: threading.Thread | None = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, aloop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None]) -> None:
        def emit(message: tuple) -> None:
            try:
                aloop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

        core = EngineCore(self.engine, self._receive, emit)
        self._thread = threading.Thread(target=core.run, name="attn-stack-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float | None) -> list[tuple]:
        with self._cond:
            self._cond.wait_for(lambda: self._commands, timeout)
            commands, self._commands = self._commands, []
        return commands

    def send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class EngineLoop:
    """Submits requests to an engine core and delivers their deltas on the event loop.

    Args:
      engine: an ``attn_jax.serving.Engine``, run by a core in a thread of this process,
        or an ``EngineProcess``, whose core runs in its own process (or anything with its
        ``CoreHandle`` methods: ``benchmarks/http_process_cpu.py``'s stand-in core).
      metrics: where the loop records tokens, latencies and the engine's counts.
    """

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.failure: str | None = None  # why the loop stopped, when the engine failed
        self._core = engine if isinstance(engine, CoreHandle) else _EngineThread(engine)
        self.max_model_len: int = self._core.max_model_len
        self._started = self._stopping = self._closed = False
        self._aloop: asyncio.AbstractEventLoop | None = None  # the event loop deltas go to, once started
        self._pending: dict[str, tuple[asyncio.Future, RequestHandle]] = {}  # submitted, not yet admitted
        self._handles: dict[str, RequestHandle] = {}  # admitted, not yet finished
        self._ids = itertools.count()

    @property
    def running(self) -> bool:
        return self._started and not self._closed and self._core.alive()

    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine core; call from ``aloop``, where deltas are delivered."""
        if self._started:
            raise RuntimeError("this EngineLoop was already started")
        self._started = True
        self._aloop = aloop
        self._core.start(aloop, self._on_message)

    def stop_after(self, seconds: float) -> None:
        """In ``seconds``, ends every request (reason "abort") and stops the core, unless it
        has stopped by then (thread-safe; a server's bounded graceful shutdown)."""

        def stop() -> None:
            if not self._stopping:
                self._stopping = True
                self._core.send(("stop",))

        if self._aloop is not None:  # not started: nothing to end (the lifespan's stop does the rest)
            self._aloop.call_soon_threadsafe(self._aloop.call_later, seconds, stop)

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every request (reason "abort") and waits for the core to end (thread-safe)."""
        if not self._stopping:
            self._stopping = True
            self._core.send(("stop",))
        self._core.join(timeout)

    async def submit(self, spec: GenerationSpec, request_id: str | None = None) -> RequestHandle:
        """Queues a request; returns its handle once the engine core has admitted it.
        Raises ``RequestError`` for one it refuses (naming the field),
        ``EngineUnavailableError`` when the loop is not running."""
        if not self.running or self._stopping:
            raise EngineUnavailableError(self.failure or "the engine loop is not running")
        handle = RequestHandle(request_id or f"req-{next(self._ids)}", self)
        admitted = asyncio.get_running_loop().create_future()
        self._pending[handle.request_id] = (admitted, handle)
        self._core.send(("submit", handle.request_id, spec, time.perf_counter()))
        try:
            await admitted
        except asyncio.CancelledError:  # the client went away while it was being admitted
            handle.close()
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Ends a request (reason "abort") and frees its pages; idempotent."""
        if not self._closed:
            self._core.send(("abort", request_id))

    def _on_message(self, message: tuple) -> None:
        """(On the event loop.) Settles submissions, delivers deltas, records metrics."""
        received = time.perf_counter()
        kind, admitted, outputs, report, *failure = message
        for request_id, prompt_tokens, refusal in admitted:
            self._settle(request_id, prompt_tokens, refusal)
        for request_id, pieces, reason, error in outputs:
            handle = self._handles.get(request_id)
            if handle is None:
                continue
            *first, (text, n, scores) = pieces
            for t, k, c in first:
                handle._queue.put_nowait(Delta(t, k, None, None, c))
            handle._queue.put_nowait(Delta(text, n, reason, error, scores))
            if reason is not None:
                del self._handles[request_id]
        if report is not None:
            self.metrics.record(report, received)
        if kind == "closed":
            self._close(*failure)

    def _settle(self, request_id: str, prompt_tokens: int, refusal: tuple | None) -> None:
        future, handle = self._pending.pop(request_id)
        if refusal is None:
            handle.prompt_tokens = prompt_tokens
            self._handles[request_id] = handle
            if not future.done():  # else submit was cancelled; the handle's close aborted the request
                future.set_result(handle)
        elif not future.done():
            future.set_exception(RequestError(*refusal))

    def _close(self, failure: str | None) -> None:
        """The core has ended: waiting submissions fail, requests it did not end (an engine
        process that died) end with an error."""
        self._closed = True
        self.failure = failure
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(failure or "the server is stopping"))
        self._pending.clear()
        reason = "abort" if failure is None else "error"
        for handle in self._handles.values():
            handle._queue.put_nowait(Delta("", 0, reason, failure))
            self.metrics.request_finished(reason)
        self._handles.clear()
