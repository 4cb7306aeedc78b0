"""The engine side of the server: commands in, one message of plain data per round out.

An ``EngineCore`` owns an ``Engine`` alone, from one thread: the server's engine thread
(``EngineLoop(engine, ...)``) or the main thread of an engine process of its own
(``engine_process``). Each round it takes the commands queued since the last one, admits
and aborts requests, steps the engine while any request is unfinished, matches stop
strings on each request's new text only, and emits what happened as one picklable tuple.
A submission's prompt is encoded (chat template applied) and its limits checked, so a
refusal names the field, on a thread of its own as soon as it arrives (vLLM's API server
tokenizes outside its engine loop too): the tokenizers' Rust encoder releases the GIL, so
a long prompt never holds the steps of the requests already running; a submission is
admitted, in arrival order, at the first round after its encoding is done.

- ``("round", admitted, outputs, report)``: ``admitted`` is ``(request_id, prompt_tokens,
  refusal)`` per submission taken this round (``refusal`` None or ``(message, param,
  code)``, a ``RequestError``'s parts); ``outputs`` is ``(request_id, pieces,
  finish_reason, error)`` per request with news, ``pieces`` ``[text, num_tokens, scores]``
  per token (a multi-step call's K tokens are K pieces; ``scores``: its log-probabilities
  when the request asked, else None); ``report`` the round's metric updates (``RoundReport``).
- ``("closed", admitted, outputs, report, failure)``: the loop has ended; ``failure``
  says why the engine failed, or is None for a requested stop; ``outputs`` end every
  request still live (reason "error" or "abort").

Commands: ``("submit", request_id, GenerationSpec, arrival)`` (``arrival`` a
``time.perf_counter()``: CLOCK_MONOTONIC, which the processes of one Linux host share),
``("abort", request_id)``, ``("stop",)``.

An exception from ``Engine.step`` itself (not one request's failure, which the engine
contains) leaves the engine in an unknown state: every request ends with an error and
the loop stops.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from attn_jax.server.engine_probe import EngineCounts, read_counts
from attn_jax.server.stop_strings import StopMatcher
from attn_jax.serving.engine import prompt_token_ids, token_events

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take; ``param`` names the field at fault (OpenAI's
    error ``param``), None when no one field is; ``code`` is OpenAI's error code, if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """One request as the server hands it to the engine core."""

    prompt: str | Sequence[int] | Sequence[Mapping[str, str]]  # text, token ids, or chat messages
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token whose log-probabilities come back; None: off
    # The prompt's text before the generated one, and with ``logprobs`` its tokens' scores (prompt
    # log-probabilities): one piece of no tokens before the first generated one; max_tokens 0: no
    # generated text at all (the engine computes one token, which is dropped).
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None  # the JSON Schema (JSON text) the output must match; None: free text
    chat: bool = False  # prompt holds chat messages, rendered with the model's chat template
    prompt_param: str = "prompt"  # the request field errors about the prompt name
    max_tokens_param: str = "max_tokens"


@dataclasses.dataclass(slots=True)
class RoundReport:
    """One round's updates to the server's metrics (``ServerMetrics.record``): seconds, counts."""

    prompt_tokens: int = 0
    time_to_first_token: list[float] = dataclasses.field(default_factory=list)
    inter_token_latency: list[float] = dataclasses.field(default_factory=list)
    finished: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # (reason, seconds since arrival)
    compilations: int = 0  # step shapes compiled this round
    counts: EngineCounts | None = None  # at the round's end
    num_started: int = 0  # live requests with a token (the gauges' fallback where the engine's counts are unknown)
    num_waiting: int = 0  # live requests without one
    emitted_at: float | None = None  # time.perf_counter() when the core sent it (one clock for every process)


@dataclasses.dataclass(eq=False, slots=True)
class _Live:
    """The core's record of one admitted request."""

    request_id: str
    stop: StopMatcher
    arrival: float
    num_tokens: int = 0
    last_token_at: float | None = None
    echo: tuple | None = None  # (prompt text, prompt ids) to send before the first token; None: no echo
    generates: bool = True  # False: max_tokens 0 with echo (the generated token is dropped)

    @property
    def plain(self) -> bool:
        """Whether a token's text goes out as it comes: no stop strings, echo pending or dropped token."""
        return self.echo is None and self.generates and not self.stop.stops


class EngineCore:
    """Runs ``engine`` round by round until a ``("stop",)`` command or an engine failure.

    Args:
      engine: an ``attn_jax.serving.Engine`` (only its public API is used, plus
        ``engine_probe`` for the metrics' counts).
      receive: ``receive(timeout) -> commands`` queued since the last call; when none is
        queued, waits up to ``timeout`` seconds for one (None: until one comes, the engine
        being idle; 0: not at all).
      emit: takes each message (above), in order.
    """

    def __init__(self, engine, receive: Callable[[bool], list[tuple]], emit: Callable[[tuple], None]) -> None:
        self.engine = engine
        self._receive, self._emit = receive, emit
        self._live: dict[str, _Live] = {}
        self._admitted: list[tuple] = []  # this round's admissions, not yet emitted
        self._compilations = getattr(engine, "num_compilations", None)  # the warm-up's are not counted
        self._token_texts: dict[int, str] = {}  # a token's text decoded alone (log-probabilities), once per id
        # Submissions being prepared (``_prepare``, on ``_encoder`` for text), in arrival order:
        # (request_id, spec, arrival, future of (ids, params, echo text or None)).
        self._preparing: collections.deque[tuple[str, GenerationSpec, float, Future]] = collections.deque()
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="attn-stack-encode")

    def run(self) -> None:
        """The loop; returns once it has emitted ``("closed", ...)``."""
        failure = None
        try:
            self._emit_round({}, RoundReport())  # the gauges' first values
            while self._round():
                pass
        except Exception as e:  # an engine step failed as a whole: its state is unknown
            failure = f"the engine failed: {type(e).__name__}: {e}"
            logger.exception("the engine loop stopped")
        self._encoder.shutdown(wait=False, cancel_futures=True)  # the loop fails submissions not admitted
        self._end_all(failure)

    def _emit_round(self, outputs: dict, report: RoundReport) -> None:
        """Emits a round's message, the gauges' counts read at its end."""
        report.counts = counts = read_counts(self.engine)
        if counts.num_running is None or counts.num_waiting is None:  # the gauges' fallback: a pass over the live
            report.num_started = sum(live.num_tokens > 0 for live in self._live.values())
            report.num_waiting = len(self._live) - report.num_started
        admitted, self._admitted = self._admitted, []
        report.emitted_at = time.perf_counter()
        self._emit(("round", admitted, list(outputs.values()), report))

    def _round(self) -> bool:
        """Runs the queued commands, steps once if there is work; False to stop."""
        commands = self._commands()
        outputs, report = {}, RoundReport()
        stopping = stepped = False
        for command in commands:  # submissions went to the encoder as they came (``_take``)
            if command[0] == "abort":
                self._abort(command[1], outputs, report)
            elif command[0] == "stop":
                stopping = True
        while self._preparing and self._preparing[0][3].done():  # in arrival order
            self._admitted.append(self._admit(*self._preparing.popleft(), report))
        if not stopping and self.engine.has_unfinished():
            runs = self.engine.step_runs()
            self._on_runs(runs, time.perf_counter(), outputs, report)
            self._count_compilations(report)
            stepped = True
        if self._admitted or outputs or stepped:
            self._emit_round(outputs, report)
        return not stopping

    def _commands(self) -> list[tuple]:
        """The commands to run this round. With a call in flight, the round waits for its
        dispatch time (``Engine.dispatch_delay``: the next call then still reaches the device
        before it runs dry) and takes everything that arrived by then, so an arrival joins the
        next call instead of the one after it."""
        if not self.engine.has_unfinished():
            if self._preparing:  # idle but for an arrival being encoded: wait for it, not for a command
                wait_for([self._preparing[0][3]])
                return self._take(self._receive(0.0))
            return self._take(self._receive(None))
        commands = self._take(self._receive(0.0))
        deadline = time.perf_counter() + self.engine.dispatch_delay()
        while not any(c[0] == "stop" for c in commands) and (left := deadline - time.perf_counter()) > 0:
            commands += self._take(self._receive(left))
        return commands

    def _take(self, commands: list[tuple]) -> list[tuple]:
        """Starts preparing each submission among ``commands``; returns them all. Text to encode
        (a prompt, chat messages) or to decode (an echoed prompt of ids) goes to the encoder
        thread at once (the tokenizers' Rust releases the GIL, so a long prompt holds no step);
        token ids are only checked, here: that pure Python gains nothing on another thread (it
        needs the GIL the loop holds), and an arrival whose check had not run by the round's
        admissions waited for the call after."""
        for command in commands:
            if command[0] == "submit":
                request_id, spec, arrival = command[1:]
                if spec.chat or spec.echo or isinstance(spec.prompt, str):
                    prepared = self._encoder.submit(self._prepare, spec)
                else:
                    prepared = Future()
                    try:
                        prepared.set_result(self._prepare(spec))
                    except Exception as e:  # RequestError and the rest, raised where the encoder's would be
                        prepared.set_exception(e)
                self._preparing.append((request_id, spec, arrival, prepared))
        return commands

    def _count_compilations(self, report: RoundReport) -> None:
        """Counts (and logs) step shapes compiled while serving: each stalled every stream."""
        total = getattr(self.engine, "num_compilations", None)
        if total is None:
            return
        report.compilations, self._compilations = total - (self._compilations or 0), total
        if report.compilations > 0:
            shapes = list(getattr(self.engine, "recent_compilations", ()))[-report.compilations :]
            logger.warning(
                "the engine compiled %d new step shape(s) while serving (every stream waited for it); "
                "start without --no-warmup, or without --warmup-max-shapes. %s",
                report.compilations,
                " | ".join(shapes),
            )

    def _admit(self, request_id: str, spec: GenerationSpec, arrival: float, prepared: Future, report) -> tuple:
        """Admits an encoded submission (``prepared``: ``_prepare``'s future); returns its
        ``(request_id, prompt_tokens, refusal)``."""
        try:
            ids, params, echo = prepared.result()
            self.engine.add_request(ids, params, request_id=request_id)
        except RequestError as e:
            return request_id, 0, (str(e), e.param, e.code)
        except (ValueError, TypeError) as e:  # the engine's own checks
            return request_id, 0, (str(e), spec.prompt_param, None)
        live = _Live(request_id, StopMatcher(spec.stop), arrival)
        if echo is not None:
            live.echo, live.generates = (echo, ids), spec.max_tokens != 0
        self._live[request_id] = live
        report.prompt_tokens += len(ids)
        return request_id, len(ids), None

    def _prepare(self, spec: GenerationSpec):
        """The prompt's token ids, the engine's ``SamplingParams`` and, with ``echo``, the
        prompt's text; RequestError naming the field for a prompt that does not fit the
        context or the cache (run on the encoder thread: it only reads the engine)."""
        from attn_jax.serving import SamplingParams

        engine, name = self.engine, spec.prompt_param
        try:
            if spec.chat:
                ids = self._chat_ids(spec.prompt)
            elif isinstance(spec.prompt, str):
                ids = engine.encode(spec.prompt)
            else:
                ids = prompt_token_ids(spec.prompt)
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
        max_tokens = limit - len(ids) if spec.max_tokens is None else max(spec.max_tokens, 1)  # 0: echo alone
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
            seed=spec.seed, ignore_eos=spec.ignore_eos, logprobs=spec.logprobs,
            prompt_logprobs=spec.logprobs if spec.echo else None,
            presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty,
            repetition_penalty=spec.repetition_penalty, json_schema=spec.json_schema,
        )  # fmt: skip
        echo = None if not spec.echo else spec.prompt if isinstance(spec.prompt, str) else self._decode(ids)
        return ids, params, echo

    def _chat_ids(self, messages) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template: use /v1/completions", "messages")
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _abort(self, request_id: str, outputs: dict, report: RoundReport) -> None:
        for entry in self._preparing:
            if entry[0] == request_id:  # still being encoded: never admitted (its client has gone)
                self._preparing.remove(entry)
                self._admitted.append((request_id, 0, ("the request was aborted", None, None)))
                return
        live = self._live.get(request_id)
        if live is None:  # already finished (its last output is on its way) or never admitted
            return
        self._engine_abort(request_id)
        self._finish(live, "abort", None, outputs, report)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except KeyError:  # the engine has already let go of it
            pass

    def _on_runs(self, runs, now: float, outputs: dict, report: RoundReport) -> None:
        """Turns the step's ``TokenRun``s into each request's pieces (stop strings applied) and
        the step's token latencies (a run's tokens after its first come 0 s after it). A run of
        a request without stop strings, echo or log-probabilities that does not end it (most of
        them) takes a short path: a step hands this loop a run of every running request; the
        others go token by token (``_on_events``)."""
        first, gaps, live_of = report.time_to_first_token, report.inter_token_latency, self._live.get
        for run in runs:
            request_id, ids, texts, finished, _, _, logprobs, _ = run
            live = live_of(request_id)
            if live is None:  # ended here already (a stop string, an abort)
                continue
            if ids and not finished and logprobs is None and live.plain:
                n = len(ids)
                live.num_tokens += n
                if live.last_token_at is None:
                    first.append(now - live.arrival)
                else:
                    gaps.append(now - live.last_token_at)
                if n > 1:
                    gaps += [0.0] * (n - 1)
                live.last_token_at = now
                pieces = [[text, 1, None] for text in texts]
                entry = outputs.get(request_id)
                if entry is None:
                    outputs[request_id] = [request_id, pieces, None, None]
                else:
                    entry[1] += pieces
            else:
                self._on_events(token_events([run]), now, outputs, report)

    def _on_events(self, events, now: float, outputs: dict, report: RoundReport) -> None:
        """Turns ``TokenEvent``s into each request's pieces (stop strings applied) and their
        token latencies."""
        first, gaps, live_of = report.time_to_first_token, report.inter_token_latency, self._live.get
        for event in events:
            request_id, token_id, text, finished, _, _, logprob, _, _ = event
            live = live_of(request_id)
            if live is None:  # ended here already (a stop string, an abort)
                continue
            if token_id >= 0:
                live.num_tokens += 1
                if live.last_token_at is None:
                    first.append(now - live.arrival)
                else:
                    gaps.append(now - live.last_token_at)
                live.last_token_at = now
            if live.echo is not None:
                self._add_echo(outputs, live, event.prompt_logprobs)
            if not live.generates:  # max_tokens 0: the prompt alone
                if finished or token_id >= 0:
                    if not finished:
                        self._engine_abort(request_id)
                    reason = "length" if token_id >= 0 else event.finish_reason
                    self._finish(live, reason, event.error, outputs, report)
                continue
            text, stopped = live.stop.feed(text)
            scores = None if logprob is None else self._token_scores(event)
            self._add(outputs, live, text, int(token_id >= 0), scores)
            if stopped:
                if not finished:
                    self._engine_abort(request_id)
                self._finish(live, "stop", None, outputs, report)
            elif finished:
                self._add(outputs, live, live.stop.flush(), 0)
                self._finish(live, event.finish_reason, event.error, outputs, report)

    def _decode(self, ids) -> str:
        tokenizer = self.engine.tokenizer
        return "".join(f"[{i}]" for i in ids) if tokenizer is None else tokenizer.decode(list(ids))

    def _add_echo(self, outputs: dict, live: _Live, prompt_logprobs) -> None:
        """Queues the echoed prompt as a piece of no tokens (its scores, with log-probabilities,
        a list of each prompt token's: the first (text, None, None)), once."""
        text, ids = live.echo
        live.echo = None
        scores = None
        if prompt_logprobs is not None:
            text_of = self._token_text
            scores = [(text_of(ids[0]), None, None)] + [
                (text_of(token), logprob, tuple((text_of(t), lp) for t, lp in top))
                for token, (logprob, top) in zip(ids[1:], prompt_logprobs[1:], strict=True)
            ]
        entry = outputs.setdefault(live.request_id, [live.request_id, [], None, None])
        entry[1].append([text, 0, scores])

    def _token_text(self, token_id: int) -> str:
        """A token's text decoded alone (its id in brackets without a tokenizer), decoded once
        per id: top-N log-probabilities name N + 1 tokens per generated token."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([int(token_id)])
        return text

    def _token_scores(self, event) -> tuple:
        """(token, logprob, ((token, logprob), ...)) of an event's log-probabilities, each token
        as its text (``_token_text``)."""
        text = self._token_text
        return text(event.token_id), event.logprob, tuple((text(t), lp) for t, lp in event.top_logprobs)

    @staticmethod
    def _add(outputs: dict, live: _Live, text: str, num_tokens: int, scores: tuple | None = None) -> None:
        """Queues a request's next piece, [text, tokens, its token's scores or None]: a
        token's text as a piece of its own (so a multi-step call's tokens stream one chunk
        each), text without a token joined to the piece before it."""
        entry = outputs.setdefault(live.request_id, [live.request_id, [], None, None])
        if num_tokens or not entry[1]:
            entry[1].append([text, num_tokens, scores])
        else:
            entry[1][-1][0] += text

    def _finish(self, live: _Live, reason: str, error: str | None, outputs: dict, report: RoundReport) -> None:
        self._add(outputs, live, "", 0)
        outputs[live.request_id][2:] = [reason, error]
        del self._live[live.request_id]
        report.finished.append((reason, time.perf_counter() - live.arrival))

    def _end_all(self, failure: str | None) -> None:
        """Ends every live request (the loop is stopping) in the ``closed`` message."""
        outputs: dict = {}
        report = RoundReport()
        for request_id, live in list(self._live.items()):
            try:
                self._engine_abort(request_id)
            except Exception:  # a failed engine may refuse even this; the request ends anyway
                pass
            self._finish(live, "abort" if failure is None else "error", failure, outputs, report)
        report.counts = EngineCounts(0, 0, None, None)
        self._emit(("closed", self._admitted, list(outputs.values()), report, failure))
