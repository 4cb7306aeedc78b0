"""The OpenAI-compatible HTTP app (FastAPI): routes, errors, streaming.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` answers with server-sent events, ``data: {chunk}`` ... ``data: [DONE]``),
``GET /health`` (200, or 503 once the engine loop has stopped), ``GET /metrics``
(Prometheus). Every error is OpenAI's body, ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (``param`` names the field), 404 / 405 for an unknown
route or method, 500 for a request the engine failed, 503 when the engine is not running.
A bad request is refused before it reaches the engine, and never touches the others.

A streaming client that disconnects, or a waiting non-streaming one, has its request
aborted at once (its KV pages are freed before the engine's next step).

Example::

    app = build_app(Engine.from_gguf(), "SmolLM2-135M-Instruct")  # the engine in a thread
    app = build_app(EngineProcess(Engine.from_gguf), "SmolLM2-135M-Instruct")  # in a process of its own
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attn_jax.server.engine_loop import EngineLoop, EngineUnavailableError, GenerationSpec, RequestError, RequestHandle
from attn_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from attn_jax.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from attn_jax.types import SEED_LIMIT


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "not_found_error" if status == 404 else "invalid_request_error"
    info = ErrorInfo(message=message, type=kind, param=param, code=code)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _param(loc: tuple) -> str | None:
    """OpenAI's ``param`` for a pydantic error location: ``("body", "messages", 0, "content")``
    -> ``"messages[0].content"`` (union member tags such as ``"list[int]"`` dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS:
            break
        else:
            out += f".{part}" if out else part
    return out or None


def _validation_message(error: dict, param: str | None) -> str:
    kind, msg = error.get("type", ""), error.get("msg", "invalid value")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", msg)
        position = error["loc"][-1] if len(error.get("loc", ())) > 1 else "?"
        return f"the request body is not valid JSON: {detail} (at character {position})"
    if kind == "missing":
        if param is None:
            return "the request has no JSON body: send a JSON object with the fields of this endpoint"
        return f"{param} is required"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if param is None:
        return f"the request body must be a JSON object with the fields of this endpoint: {msg}"
    shown = json.dumps(error.get("input"), default=repr)
    return f"{param}={shown[:80]} is invalid: {msg}"


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed (so its request is aborted) as soon as
    the client disconnects, whichever way that is noticed: a failed send, or
    ``http.disconnect`` while no token is due (Starlette's own response notices only the
    first under ASGI 2.4)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client has gone
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


def _sse(payload) -> str:
    """One server-sent event carrying a response model as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


_TEXT_MARK = "@attn-stack-text@"


def _token_events(build):
    """``delta -> str``, the server-sent event of one streamed delta, where ``build(text,
    finish_reason, scores)`` makes the chunk's response model. A delta that only carries
    text (every one but a request's last, without log-probabilities) fills a template
    serialised once per stream with the JSON of its text, the same bytes as
    ``_sse(build(text, None, None))`` in a tenth of the time (it runs once per token, on the
    event loop)."""
    head, tail = _sse(build(_TEXT_MARK, None, None)).split(json.dumps(_TEXT_MARK))

    def event(d) -> str:
        if d.finish_reason is None and d.text and d.scores is None:
            return head + json.dumps(d.text, ensure_ascii=False) + tail
        return _sse(build(d.text, d.finish_reason, d.scores))

    return event


def default_max_request_bytes(max_model_len: int) -> int:
    """The largest request body taken by default: 32 bytes per token of the context and
    64 KiB for the rest (a whole context of text, JSON-escaped, fits many times over)."""
    return 32 * max_model_len + (64 << 10)


class _BodyLimit:
    """ASGI middleware: a request whose body exceeds ``limit`` bytes (by its Content-Length,
    or counted as it arrives) is answered 413 in OpenAI's error shape before the app parses
    or tokenizes any of it, so one oversized prompt never holds the engine's loop."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, send, size: str) -> None:
        body = ErrorResponse(
            error=ErrorInfo(
                message=f"the request body is {size} bytes; this server takes at most {self.limit} "
                "(--max-request-bytes; by default 32 bytes per token of --max-model-len and 64 KiB)",
                code="request_too_large",
            )
        ).model_dump_json()
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send, length.decode())
        seen, refused = 0, False

        async def counted():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a body without a length (chunked): stop reading it
                    refused = True
                    await self._refuse(send, f"more than {self.limit}")
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counted, send)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    engine, served_model_name: str, *, metrics: ServerMetrics | None = None, max_request_bytes: int | None = None
) -> FastAPI:
    """The app serving ``engine`` (an ``Engine``, run in a thread of this process, or an
    ``EngineProcess``) as ``served_model_name``; the engine core starts and stops with the
    app (its lifespan). ``app.state.engine_loop`` is the ``EngineLoop``. A body over
    ``max_request_bytes`` (default ``default_max_request_bytes`` of the engine's context) is
    a 413."""
    metrics = ServerMetrics(served_model_name) if metrics is None else metrics
    engine_loop = EngineLoop(engine, metrics)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine_loop.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="attn-stack", summary="OpenAI-compatible API over the attn-stack engine", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_request_bytes)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        param = None if error.get("type") == "json_invalid" else _param(tuple(error.get("loc", ())))
        return error_response(400, _validation_message(error, param), param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request: Request, exc: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise RequestError(
                f"model={model!r} is not served here; this server serves {served_model_name!r}",
                "model", "model_not_found",
            )  # fmt: skip

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if engine_loop.running:
            return Response(status_code=200)
        return error_response(503, engine_loop.failure or "the engine loop is not running")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine_loop.max_model_len)])

    def sampling(body, **prompt) -> list[GenerationSpec]:
        """The request's ``n`` engine requests: choice i draws with ``seed + i`` when a seed is given."""
        specs = []
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % SEED_LIMIT
            specs.append(
                GenerationSpec(
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    seed=seed,
                    stop=tuple(body.stop or ()),
                    ignore_eos=body.ignore_eos,
                    logprobs=body.num_logprobs,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    json_schema=body.json_schema,
                    **prompt,
                )  # fmt: skip
            )
        return specs

    async def submit(specs: list[GenerationSpec], request_id: str) -> list[RequestHandle]:
        """The choices' handles, admitted one after another (the later ones take the first's
        prompt blocks from the prefix cache); a refusal aborts those already admitted."""
        if len(specs) == 1:
            return [await engine_loop.submit(specs[0], request_id)]
        handles = []
        try:
            for i, spec in enumerate(specs):
                handles.append(await engine_loop.submit(spec, f"{request_id}-{i}"))
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        return handles

    async def whole(request: Request, handles: list[RequestHandle]) -> list[tuple] | Response:
        """Each choice's finished (text, tokens, reason, scores: its tokens' log-probabilities
        when asked); a Response if one failed or the client left."""
        done = asyncio.ensure_future(asyncio.gather(*(h.collect() for h in handles)))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()
            for handle in handles:
                handle.close()
        if not done.done() or done.cancelled():
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        results = done.result()
        for _, _, reason, error, _ in results:
            if reason == "error":
                return error_response(500, f"the engine failed this request: {error}")
        return [(text, tokens, reason, scores) for text, tokens, reason, _, scores in results]

    def usage(handles: list[RequestHandle], tokens: int) -> Usage:
        prompt = handles[0].prompt_tokens  # one prompt, whatever n
        return Usage(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        handles = await submit(
            sampling(body, prompt=body.prompt, max_tokens=body.max_tokens, echo=body.echo), request_id
        )
        if body.stream:
            return EventStreamResponse(_completion_stream(handles, request_id, served_model_name, body.include_usage))
        results = await whole(request, handles)
        if isinstance(results, Response):
            return results
        choices = [
            CompletionChoice(
                index=i,
                text=text,
                finish_reason=reason,
                logprobs=None if body.logprobs is None else CompletionLogprobs.of(scores),
            )  # fmt: skip
            for i, (text, _, reason, scores) in enumerate(results)
        ]
        tokens = sum(r[1] for r in results)
        return CompletionResponse(id=request_id, model=served_model_name, choices=choices, usage=usage(handles, tokens))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        specs = sampling(
            body, prompt=[m.as_template_message() for m in body.messages], chat=True, prompt_param="messages",
            max_tokens=body.max_new_tokens, max_tokens_param=body.max_tokens_field,
        )  # fmt: skip
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        handles = await submit(specs, request_id)
        if body.stream:
            return EventStreamResponse(_chat_stream(handles, request_id, served_model_name, body.include_usage))
        results = await whole(request, handles)
        if isinstance(results, Response):
            return results
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=text),
                finish_reason=reason,
                logprobs=ChatLogprobs.of(scores) if body.logprobs else None,
            )  # fmt: skip
            for i, (text, _, reason, scores) in enumerate(results)
        ]
        tokens = sum(r[1] for r in results)
        return ChatCompletionResponse(
            id=request_id, model=served_model_name, choices=choices, usage=usage(handles, tokens)
        )

    return app


def _engine_error(d) -> str:
    return _sse(ErrorResponse(error=ErrorInfo(message=f"the engine failed: {d.error}", type="server_error")))


async def _delta_batches(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list]]:
    """(choice, delta batch) as they arrive, from one handle or several (merged)."""
    if len(handles) == 1:
        async for batch in handles[0].delta_batches():
            yield 0, batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for batch in handle.delta_batches():
                queue.put_nowait((i, batch))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        live = len(handles)
        while live:
            i, batch = await queue.get()
            if batch is None:
                live -= 1
            else:
                yield i, batch
    finally:
        for task in tasks:
            task.cancel()


async def _stream(
    handles: list[RequestHandle], chunk, usage_chunk, include_usage: bool, first=None
) -> AsyncIterator[str]:
    """One server-sent event per token (``chunk(choice, text, finish_reason, scores)``, a
    response model), the tokens that arrived together (a multi-step call's) in one write;
    then the usage (``usage_chunk``) if asked, and ``[DONE]``. ``first(choice)``: a response
    model sent for each choice before any token."""
    events = [_token_events(functools.partial(chunk, i)) for i in range(len(handles))]
    tokens = 0
    try:
        if first is not None:
            yield "".join(_sse(first(i)) for i in range(len(handles)))
        async for i, batch in _delta_batches(handles):
            out = []
            for d in batch:
                tokens += d.num_tokens
                if d.finish_reason == "error":
                    out.append(_engine_error(d))
                elif d.text or d.finish_reason is not None or d.scores is not None:
                    out.append(events[i](d))
            if out:
                yield "".join(out)
            if batch[-1].finish_reason == "error":  # a finishing delta is always its batch's last
                break
        if include_usage:
            prompt = handles[0].prompt_tokens
            u = Usage(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens)
            yield _sse(usage_chunk(u))
        yield "data: [DONE]\n\n"
    finally:
        for handle in handles:
            handle.close()


def _completion_stream(handles: list[RequestHandle], request_id: str, model: str, include_usage: bool):
    created = int(time.time())  # one timestamp for every chunk of a response, as OpenAI's
    offsets = [0] * len(handles)  # where each choice's next token's text starts (logprobs' text_offset)

    def chunk(i, text, finish_reason, scores):
        logprobs = None
        if scores is not None:
            tokens = scores if isinstance(scores, list) else [scores]  # an echoed prompt's: each of its tokens'
            logprobs = CompletionLogprobs.of(tokens, offsets[i])
            offsets[i] += sum(len(t[0]) for t in tokens)
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return CompletionResponse(id=request_id, created=created, model=model, choices=[choice])

    def usage_chunk(u):
        return CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=u)

    return _stream(handles, chunk, usage_chunk, include_usage)


def _chat_stream(handles: list[RequestHandle], request_id: str, model: str, include_usage: bool):
    created = int(time.time())

    def chunk(i, text, finish_reason, scores):
        logprobs = None if scores is None else ChatLogprobs.of([scores])
        delta = DeltaMessage(content=text or None)
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

    def usage_chunk(u):
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=u)

    def first(i):
        choice = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

    return _stream(handles, chunk, usage_chunk, include_usage, first=first)
