"""Request and response bodies of the OpenAI API subset that ``attn-stack serve`` speaks.

Requests are checked here, each value against its own range, so a bad one is a 400 that
names its field (``app.py`` turns a ``pydantic.ValidationError`` into OpenAI's error
body). Log-probabilities are served (completions' ``logprobs`` N, chat's ``logprobs`` and
``top_logprobs`` N, N <= 20; the model's distribution before temperature and filters,
vLLM's default, after the penalties where a request has any), and so is ``n`` > 1 (each
choice a request of the engine's sharing the prompt's blocks through the prefix cache;
with a ``seed``, choice i draws with seed + i, as vLLM's). ``presence_penalty`` and
``frequency_penalty`` ([-2, 2]) and vLLM's ``repetition_penalty`` (> 0) are served
(``SamplingParams`` says how they apply). Completions' ``echo`` returns the prompt before
the completion and, with ``logprobs``, its tokens' log-probabilities first (vLLM's prompt
logprobs: the first token's null, the others computed in the prefill), streamed or not;
``max_tokens`` 0 is allowed with ``echo`` (the prompt's log-probabilities alone: what
lm-eval's log-likelihood requests ask). ``response_format`` (structured outputs, chat and,
as vLLM's, completions) is ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object)
or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; the schema is
compiled here by llguidance (``serving/structured_output.py``), so one it cannot compile is a
400 naming ``response_format`` with llguidance's error. Fields OpenAI defines that this server
cannot honour (``logit_bias``, ``suffix``, ``best_of`` > 1) are refused by name rather than
ignored; ``top_k``, ``ignore_eos`` and
``repetition_penalty`` are vLLM's extensions (pass them in the openai client's
``extra_body``).
"""

from __future__ import annotations

import json
import math
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from attn_jax.serving.sampling import MAX_LOGPROBS
from attn_jax.serving.structured_output import JSON_OBJECT_SCHEMA, compile_json_schema
from attn_jax.types import SEED_LIMIT


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


MAX_N = 64
"""The most choices one request may ask for (``n``): each is a request of the engine's."""

_STRICT = ConfigDict(strict=True)
"""Types as OpenAI checks them: ``"stream": "yes"``, ``"seed": true`` or ``"temperature": "0"``
are 400s naming the field, never coerced (an int is still a float)."""


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
"""``response_format`` types served: free text, any JSON object, a JSON Schema."""


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


def _unsupported(name: str, value, default) -> None:
    if value is not None and value != default:
        raise ValueError(f"{name}={value!r} is not supported by this server (leave it out or set it to {default!r})")


class _GenerationRequest(BaseModel):
    """The fields completions and chat completions share (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension: 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    user: str | None = None
    presence_penalty: float | None = 0.0  # null: 0, off
    frequency_penalty: float | None = 0.0  # null: 0, off
    repetition_penalty: float | None = 1.0  # vLLM's extension; null: 1, off
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None  # structured outputs: text, json_object or json_schema

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature={v!r} must be a finite number >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not (math.isfinite(v) and 0 < v <= 1):
            raise ValueError(f"top_p={v!r} must be in (0, 1] (1 = off)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if not -1 <= v < 2**31:
            raise ValueError(f"top_k={v!r} must be in [0, 2**31), or -1 / 0 for off")
        return max(v, 0)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < SEED_LIMIT:
            raise ValueError(f"seed={v!r} is outside [0, 2**32): give an integer from 0 to {SEED_LIMIT - 1}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if any(not s for s in stops):
            raise ValueError(f"stop={v!r} holds an empty string: every stop sequence needs at least one character")
        return stops

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n={v!r} must be in [1, {MAX_N}] (choices per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalties(cls, v: float | None, info) -> float:
        if v is None:
            return 0.0
        if not -2 <= v <= 2:  # NaN fails too
            raise ValueError(f"{info.field_name}={v!r} must be in [-2, 2] (0 = off)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float | None) -> float:
        if v is None:
            return 1.0
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"repetition_penalty={v!r} must be a finite number > 0 (1 = off)")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is None:
            return v
        kind = v.get("type")
        if kind not in _RESPONSE_FORMATS:
            raise ValueError(f"response_format.type={kind!r} must be one of {list(_RESPONSE_FORMATS)}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                shown = json.dumps(spec)[:80]
                raise ValueError(
                    f"response_format.json_schema={shown} must be an object whose schema is a JSON Schema object: "
                    '{"name": ..., "schema": {...}, "strict": ...}'
                )
            try:
                compile_json_schema(json.dumps(spec["schema"]))
            except ValueError as e:
                raise ValueError(f"response_format.json_schema.schema: {e}") from None
        return v

    @property
    def json_schema(self) -> str | None:
        """The JSON Schema (JSON text) ``response_format`` asks the output to match; None: free text."""
        kind = None if self.response_format is None else self.response_format["type"]
        if kind == "json_object":
            return JSON_OBJECT_SCHEMA
        return json.dumps(self.response_format["json_schema"]["schema"]) if kind == "json_schema" else None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            _unsupported("logit_bias", v, None)
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _check_top(name: str, v: int | None) -> int | None:
    if v is not None and not 0 <= v <= MAX_LOGPROBS:
        raise ValueError(f"{name}={v!r} must be in [0, {MAX_LOGPROBS}] (alternatives per token)")
    return v


def _check_max_tokens(name: str, v: int | None) -> int | None:
    if v is not None and v < 1:
        raise ValueError(f"{name}={v!r} must be >= 1")
    return v


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt (text, or token ids), continued as is."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False  # the prompt before the completion (and its log-probabilities, with logprobs)
    max_tokens: int | None = 16  # OpenAI's default for completions; None: the rest of the context; 0: echo only
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None  # the sampled token's log-probability and this many alternatives'

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        return _check_top("logprobs", v)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"prompt holds {len(v)} prompts: this server takes one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty: give some text or token ids to continue")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v, info):
        if v == 0 and info.data.get("echo"):
            return v  # the prompt's text and log-probabilities alone (OpenAI's and vLLM's echo)
        if v == 0:
            raise ValueError("max_tokens=0 must be >= 1 (0 is allowed only with echo=true: the prompt alone)")
        return _check_max_tokens("max_tokens", v)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        _unsupported("suffix", v, None)
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        _unsupported("best_of", v, 1)
        return v


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict a chat template renders (text parts joined)."""
        content = self.content if isinstance(self.content, str) or self.content is None else ""
        if isinstance(self.content, list):
            content = "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token (with logprobs)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info):
        _check_top("top_logprobs", v)
        if v is not None and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs={v!r} needs logprobs=true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages is empty: give at least one message")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v, info):
        return _check_max_tokens(info.field_name, v)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field that set the limit, for errors."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions' log-probabilities: per token its text, its log-probability
    and its alternatives' (text -> log-probability), and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def of(cls, scores, offset: int = 0) -> CompletionLogprobs:
        """From ``Delta.scores`` tuples (an echoed prompt's first one (text, None, None));
        ``offset``: where the first token's text starts."""
        offsets = []
        for token, _, _ in scores:
            offsets.append(offset)
            offset += len(token)
        return cls(
            tokens=[t for t, _, _ in scores], token_logprobs=[lp for _, lp, _ in scores],
            top_logprobs=[None if top is None else dict(top) for _, _, top in scores], text_offset=offsets,
        )  # fmt: skip


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat's log-probabilities: one entry per generated token."""

    content: list[TokenLogprob]

    @classmethod
    def of(cls, scores) -> ChatLogprobs:
        def top(token: str, logprob: float) -> TopLogprob:
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return cls(
            content=[
                TokenLogprob(**top(t, lp).model_dump(), top_logprobs=[top(a, b) for a, b in alts])
                for t, lp, alts in scores
            ]
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A completion, whole (``object="text_completion"``) or one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "attn-stack"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
