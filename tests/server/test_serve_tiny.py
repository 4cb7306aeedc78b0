"""``attn-stack serve --model tiny-random`` in a subprocess, driven by the official openai
client and raw HTTP: its text is the engine's own ``generate`` output for the same prompt
(greedy and seeded sampling, completions and chat, streaming or not, alone or
concurrently), stop strings end it, a client that disconnects has its request aborted
and its KV pages freed, and each bad request gets a 400 naming its field while a
stream in flight carries on untouched.

One server and one in-process reference engine of the same model and limits serve the
module; the limits keep the step's shapes few (16-token steps, 1 / 2 requests, 4 / 8
pages), so each compiles once.
"""

from __future__ import annotations

import asyncio
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from attn_jax.cli import main
from attn_jax.serving import SamplingParams
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine
from tests.server.conftest import USED, Server, idle, sse_data, stream_greedy

LIMITS = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)
ARGS = ["--model", TINY_RANDOM, "--no-warmup"] + [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "1, 2, 3, 4,",
    "Dear Sir or Madam, I am writing",
]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    server = Server(*ARGS)  # loads while the reference engine below is built
    yield server
    server.close()


@pytest.fixture(scope="module")
def engine():
    return tiny_random_engine(**LIMITS)


@pytest.fixture(scope="module")
def client(server, engine):
    return server.wait_ready().client()


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kwargs)


def test_health_and_models(client, server):
    assert server.http.get("/health").status_code == 200
    (model,) = client.models.list().data
    assert model.id == TINY_RANDOM and model.model_extra["max_model_len"] == LIMITS["max_model_len"]


def test_completion_matches_engine_generate(client, engine):
    (want,) = engine.generate([PROMPTS[0]], greedy(12))
    got = client.completions.create(model=TINY_RANDOM, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.output_ids))
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=TINY_RANDOM, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert len([c for c in chunks if c.choices]) > 2  # streamed piece by piece, not in one chunk
    assert chunks[-1].usage.completion_tokens == len(want.output_ids) and not chunks[-1].choices


def test_token_id_prompt(client, engine):
    ids = engine.encode(PROMPTS[1])
    (want,) = engine.generate([ids], greedy(6))
    got = client.completions.create(model=TINY_RANDOM, prompt=ids, max_tokens=6, temperature=0)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == len(ids)


def test_chat_matches_engine_generate_with_the_chat_template(client, engine):
    (want,) = engine.generate([QUESTION], greedy(10), chat=True)
    messages = [{"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(model=TINY_RANDOM, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_ids) == len(engine.encode(QUESTION, chat=True))
    assert got.usage.completion_tokens == len(want.output_ids)

    stream = client.chat.completions.create(
        model=TINY_RANDOM, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


SCHEMA = {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False,
}  # fmt: skip


def test_response_format_json_schema_and_json_object_streamed_and_not(client, engine):
    """Structured outputs through the openai client: chat's json_schema (n = 2, each choice
    guided) and completions' json_object give the engine's guided text, streamed or not."""
    messages = [{"role": "user", "content": QUESTION}]
    (want,) = engine.generate([QUESTION], greedy(20, json_schema=json.dumps(SCHEMA)), chat=True)
    assert set(json.loads(want.text)) == {"ok"} and want.finish_reason == "stop"
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model=TINY_RANDOM, messages=messages, max_tokens=20, temperature=0, response_format=schema_format)
    got = client.chat.completions.create(**kwargs, n=2)
    assert [c.message.content for c in got.choices] == [want.text] * 2
    assert [c.finish_reason for c in got.choices] == ["stop"] * 2
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    assert streamed == want.text

    (any_object,) = engine.generate([PROMPTS[0]], greedy(12, json_schema='{"type": "object"}'))
    assert any_object.text.startswith("{")  # random weights: an object's keys may outlast 12 tokens
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    body = {"response_format": {"type": "json_object"}}
    assert client.completions.create(**kwargs, extra_body=body).choices[0].text == any_object.text
    chunks = client.completions.create(**kwargs, stream=True, extra_body=body)
    assert "".join(c.choices[0].text for c in chunks) == any_object.text


def test_logprobs_match_the_engine_streamed_and_not(client, engine):
    """Completions' ``logprobs`` N and chat's ``logprobs`` / ``top_logprobs`` N, whole and
    streamed, carry the engine's own log-probabilities (``SamplingParams.logprobs``)."""
    (want,) = engine.generate([PROMPTS[0]], greedy(5, logprobs=3, ignore_eos=True))
    want_logprobs = [lp for lp, _ in want.logprobs]
    want_top = [[lp for _, lp in top] for _, top in want.logprobs]
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    got = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert [sorted(t.values(), reverse=True) for t in got.logprobs.top_logprobs] == [
        pytest.approx(t, abs=1e-5) for t in want_top
    ]
    assert len(got.logprobs.tokens) == 5 and got.logprobs.text_offset[0] == 0
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [lp for x in streamed for lp in x.token_logprobs] == pytest.approx(want_logprobs, abs=1e-5)
    assert [x.text_offset[0] for x in streamed] == got.logprobs.text_offset

    (want,) = engine.generate([QUESTION], greedy(4, logprobs=2), chat=True)
    body = dict(
        model=TINY_RANDOM, messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = client.chat.completions.create(**body).choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in want.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(**{k: v for k, v in body.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None


def test_echo_returns_the_prompt_and_its_logprobs_streamed_and_not(client, engine):
    """Completions' ``echo``: the prompt's text before the completion's, and with ``logprobs``
    N the prompt tokens' log-probabilities (the first null, as OpenAI's and vLLM's) then the
    generated ones', each the engine's own (``SamplingParams.prompt_logprobs``); ``max_tokens``
    0 returns the prompt alone (lm-eval's log-likelihood requests), streamed alike."""
    prompt = PROMPTS[2]
    (want,) = engine.generate([prompt], greedy(3, logprobs=2, prompt_logprobs=2, ignore_eos=True))
    n = len(want.prompt_ids)
    want_logprobs = [None] + [e[0] for e in want.prompt_logprobs[1:]] + [lp for lp, _ in want.logprobs]
    kwargs = dict(model=TINY_RANDOM, prompt=prompt, temperature=0, echo=True, logprobs=2)
    got = client.completions.create(max_tokens=3, extra_body={"ignore_eos": True}, **kwargs).choices[0]
    assert got.text == prompt + want.text
    assert got.logprobs.token_logprobs[0] is None and got.logprobs.top_logprobs[0] is None
    assert got.logprobs.token_logprobs[1:] == pytest.approx(want_logprobs[1:], abs=1e-5)
    assert all(len(t) <= 2 for t in got.logprobs.top_logprobs[1:])
    assert "".join(got.logprobs.tokens[:n]) == prompt and got.logprobs.text_offset[n] == len(prompt)
    alone = client.completions.create(max_tokens=0, **kwargs)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == got.logprobs.token_logprobs[:n]
    assert alone.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(max_tokens=0, stream=True, **kwargs))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == prompt
    assert [lp for c in streamed if c.logprobs for lp in c.logprobs.token_logprobs] == (
        alone.choices[0].logprobs.token_logprobs
    )
    plain = client.completions.create(model=TINY_RANDOM, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_n_choices_each_draw_their_own_seed_whole_and_streamed(client, engine):
    """``n`` choices of one prompt: choice i is the engine's request with seed + i, the
    prompt counted once in the usage, the choices' tokens summed."""
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=5 + i, ignore_eos=True) for i in range(3)]
    want = engine.generate([PROMPTS[3]] * 3, params)
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[3], max_tokens=6, temperature=0.9, seed=5, n=3)
    got = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert len({c.text for c in got.choices}) > 1  # their own seeds
    assert got.usage.prompt_tokens == len(want[0].prompt_ids) and got.usage.completion_tokens == 18
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [w.text for w in want]
    body = dict(model=TINY_RANDOM, messages=[{"role": "user", "content": QUESTION}], max_tokens=3, n=2)
    chat = client.chat.completions.create(**body, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message


def test_concurrent_requests_each_get_their_own_tokens(client, engine):
    """Six requests at once (the engine steps two at a time, the others wait), half of them streamed."""
    want = engine.generate(PROMPTS, greedy(8))

    def ask(i: int) -> str:
        kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[i], max_tokens=8, temperature=0)
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
        return client.completions.create(**kwargs).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == [w.text for w in want]


def test_many_streaming_clients_at_once_lose_nothing(server, engine):
    """24 streaming clients at once, twelve times the engine's batch: every one gets all
    its tokens, the same as offline generation, and every KV page comes back."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(24)]
    want = engine.generate(prompts, greedy(8, ignore_eos=True))

    async def main_():
        async with server.async_client() as client:
            return await asyncio.gather(*(stream_greedy(client, TINY_RANDOM, p, 8) for p in prompts))

    assert asyncio.run(main_()) == [(w.text, 8) for w in want]
    server.wait_for(lambda m: m[USED] == 0, "every KV page back after the clients")


def test_seeded_sampling_matches_the_engine(client, engine):
    params = dict(temperature=0.9, top_p=0.95, seed=11)
    (want,) = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=10, top_k=40, **params))
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[2], max_tokens=10, extra_body={"top_k": 40}, **params)
    texts = [client.completions.create(**kwargs).choices[0].text for _ in range(2)]
    assert texts == [want.text, want.text]


def test_penalties_match_the_engine(client, engine):
    """OpenAI's presence / frequency penalties and vLLM's repetition penalty (extra body) give
    the engine's tokens, which they change."""
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.5)
    (plain,) = engine.generate([PROMPTS[4]], greedy(12, ignore_eos=True))
    (want,) = engine.generate([PROMPTS[4]], greedy(12, ignore_eos=True, repetition_penalty=1.4, **penalties))
    assert want.output_ids != plain.output_ids
    got = client.completions.create(
        model=TINY_RANDOM, prompt=PROMPTS[4], max_tokens=12, temperature=0, **penalties,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].text == want.text


def test_stop_strings_end_the_text_before_them(client, engine):
    (want,) = engine.generate([PROMPTS[3]], greedy(16, ignore_eos=True))
    stop = want.text[len(want.text) // 2 :][:3]
    expected = want.text[: want.text.index(stop)]
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=["@@never@@", stop])
    got = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < len(want.output_ids)
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


ABORTED = ("attn_stack_request_success_total", (("finished_reason", "abort"),))
LENGTH = ("attn_stack_request_success_total", (("finished_reason", "length"),))


def _aborted_when_the_client_leaves(server: Server, leave) -> None:
    """Runs ``leave()``, a client that starts a 110-token request and goes away mid-way,
    until the server has aborted one (on a busy machine the request may finish before the
    client leaves: then it is tried again, up to 3 times); every KV page must come back."""
    for _ in range(3):
        before = server.wait_for(idle, "the engine idle before the client")
        leave()
        after = server.wait_for(idle, "the engine idle, every KV page free, after the client left")
        if after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1:
            return
        assert after[LENGTH] == before.get(LENGTH, 0) + 1  # it finished before the client left
    pytest.fail("the request finished before its client left, three times")


def test_a_disconnected_stream_is_aborted_and_frees_its_blocks(server):
    body = dict(model=TINY_RANDOM, prompt=PROMPTS[4], max_tokens=110, temperature=0, stream=True, ignore_eos=True)

    def leave():
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                assert next(d for d in sse_data(response.iter_lines()) if json.loads(d)["choices"][0]["text"])

    _aborted_when_the_client_leaves(server, leave)


def test_a_client_that_leaves_before_its_answer_has_its_request_aborted(server):
    """Non-streaming: the server notices the closed connection while the engine works."""
    body = json.dumps(dict(prompt=PROMPTS[4], max_tokens=110, temperature=0, ignore_eos=True)).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    prompt_tokens = ("attn_stack_prompt_tokens_total", ())

    def leave():
        admitted = server.metrics()[prompt_tokens]
        with socket.create_connection(("127.0.0.1", server.port)) as conn:
            conn.sendall(head.encode() + b"\r\n\r\n" + body)
            server.wait_for(lambda m: m[prompt_tokens] > admitted, "the request admitted")

    _aborted_when_the_client_leaves(server, leave)


BAD_REQUESTS = [  # (route, JSON body or raw text, the param named, words of the message)
    ("completions", {"model": "nope", "prompt": "hi"}, "model", "'nope' is not served here"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0 must be >= 1"),
    ("completions", {"prompt": "word " * 200}, "prompt", "max_model_len=128"),
    ("completions", {"prompt": [5, 49152]}, "prompt", "token id 49152, outside the vocabulary"),
    ("completions", '{"prompt": "hi", "temperature": NaN}', "temperature", "temperature=nan"),
    ("completions", '{"prompt": "hi", "max_tokens": ', None, "not valid JSON"),
    ("completions", {"prompt": "hi", "n": 65}, "n", "n=65 must be in [1, 64]"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        "response_format",
        "response_format.type='xml' must be one of ['text', 'json_object', 'json_schema']",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        },
        "response_format",
        "response_format.json_schema.schema: json_schema does not compile: Invalid type: foo",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "must be an object whose schema is a JSON Schema object",
    ),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs=21 must be in [0, 20]"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 is allowed only with echo=true"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream", 'stream="yes" is invalid'),
    ("completions", {"prompt": "hi", "seed": True}, "seed", "seed=true is invalid"),
    ("completions", {"prompt": "hi", "temperature": "0"}, "temperature", 'temperature="0" is invalid'),
    ("completions", "", None, "the request has no JSON body"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
        "needs logprobs=true",
    ),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p=0.0 must be in (0, 1]"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed", "seed=-1 is outside [0, 2**32)"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k", "top_k=-5 must be in [0, 2**31)"),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "=2.5 must be in [-2, 2]"),
    (
        "completions",
        {"prompt": "hi", "frequency_penalty": "1"},
        "frequency_penalty",
        'frequency_penalty="1" is invalid',
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -2.5},
        "frequency_penalty",
        "frequency_penalty=-2.5 must be in [-2, 2] (0 = off)",
    ),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "must be a finite number > 0"),
    ("completions", {"max_tokens": 3}, "prompt", "prompt is required"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}, "max_tokens", "500"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ("chat/completions", {"messages": []}, "messages", "messages is empty"),
    ("chat/completions", {"messages": "word " * 200}, "messages", "valid list"),
]


def test_bad_requests_get_400s_naming_the_field_and_leave_a_stream_in_flight_alone(client, engine, server):
    (want,) = engine.generate([PROMPTS[5]], greedy(100, ignore_eos=True))
    body = dict(model=TINY_RANDOM, prompt=PROMPTS[5], max_tokens=100, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            data = sse_data(response.iter_lines())
            texts = [json.loads(next(data))["choices"][0]["text"]]
            for route, bad, param, words in BAD_REQUESTS:
                if isinstance(bad, str):
                    r = http.post(f"/v1/{route}", content=bad, headers={"Content-Type": "application/json"})
                else:
                    r = http.post(f"/v1/{route}", json=bad)
                assert r.status_code == 400, (bad, r.text)
                error = r.json()["error"]
                assert error["param"] == param and words in error["message"], (bad, error)
                assert error["type"] == "invalid_request_error"
            huge = http.post("/v1/completions", json={"prompt": "word " * 20_000, "max_tokens": 1})  # 100 kB
            assert huge.status_code == 413 and "--max-request-bytes" in huge.json()["error"]["message"]
            missing = http.get("/v1/nope").json()["error"]
            assert missing["type"] == "not_found_error" and "GET /v1/nope" in missing["message"]
            data = list(data)
    assert data[-1] == "[DONE]"
    texts += [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
    assert len(texts) > 2 and "".join(texts) == want.text  # untouched by the bad requests sent meanwhile
    with pytest.raises(openai.BadRequestError, match="is not served here"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_metrics_parse_and_count_a_request(client, server):
    before = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_blocks_total"):
        assert (f"attn_stack_{name}", ()) in before, name
    got = client.completions.create(model=TINY_RANDOM, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get((name, ()), 0) - before.get((name, ()), 0)

    assert delta("attn_stack_generation_tokens_total") == got.usage.completion_tokens
    assert delta("attn_stack_prompt_tokens_total") == got.usage.prompt_tokens
    assert delta("attn_stack_time_to_first_token_seconds_count") == 1
    assert delta("attn_stack_inter_token_latency_seconds_count") == got.usage.completion_tokens - 1
    assert delta("attn_stack_e2e_request_latency_seconds_count") == 1
    assert after["attn_stack_kv_cache_blocks_total", ()] > 0
    rounds = delta("attn_stack_engine_round_delay_seconds_count")  # every round message the request took
    assert rounds >= 1 and 0 <= delta("attn_stack_engine_round_delay_seconds_sum") < rounds * 10.0


def test_serve_refuses_a_directory_it_cannot_load(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err, err


def test_load_every_stream_completes_and_is_counted_while_one_client_leaves(server, engine):
    """Load at CPU scale: 8 streaming clients at once (four times the engine's batch) while a
    ninth, long request disconnects mid-stream: each of the 8 gets exactly its 8 tokens, the
    text offline generation gives, /metrics counts 8 finished by length and 1 aborted, and
    every KV page comes back. The leaver disconnects once the others are streaming; if a
    busy machine let it finish first, the round is run again (up to 3 times)."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (load {i})" for i in range(8)]
    want = engine.generate(prompts, greedy(8, ignore_eos=True))
    leaver_ids = engine.encode(PROMPTS[4])
    leaver = dict(prompt=leaver_ids, max_tokens=LIMITS["max_model_len"] - len(leaver_ids), temperature=0, stream=True)

    async def ask(client, prompt: str, streaming: asyncio.Event) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=TINY_RANDOM, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            streaming.set()
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens, reasons[-1]

    async def round_() -> tuple[list, int]:
        streaming = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http, server.async_client() as client:
            async with http.stream("POST", "/v1/completions", json={**leaver, "ignore_eos": True}) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                seen = 0
                while not seen:  # the leaver streams before the others start
                    line = await anext(lines)
                    seen = line.startswith("data: ") and bool(json.loads(line[6:])["choices"][0]["text"])
                tasks = [asyncio.create_task(ask(client, p, streaming)) for p in prompts]
                await streaming.wait()
            # the leaver's connection is closed here, while the 8 stream
            return await asyncio.gather(*tasks), len(leaver_ids)

    for _ in range(3):
        before = server.wait_for(idle, "the engine idle before the load")
        got, leaver_prompt = asyncio.run(round_())
        assert got == [(w.text, 8, "length") for w in want]
        after = server.wait_for(idle, "the engine idle, every KV page free, after the load")

        def delta(key, after=after, before=before) -> float:
            return after.get(key, 0) - before.get(key, 0)

        prompt_tokens = sum(len(w.prompt_ids) for w in want) + leaver_prompt
        assert delta(("attn_stack_prompt_tokens_total", ())) == prompt_tokens
        assert delta(("attn_stack_time_to_first_token_seconds_count", ())) == 9  # the leaver had its first token
        assert delta(("attn_stack_e2e_request_latency_seconds_count", ())) == 9
        generated = delta(("attn_stack_generation_tokens_total", ()))
        if delta(ABORTED) == 1:
            assert delta(LENGTH) == 8
            assert 8 * 8 + 1 <= generated < 8 * 8 + leaver["max_tokens"]
            return
        assert delta(LENGTH) == 9 and generated == 8 * 8 + leaver["max_tokens"]  # the leaver finished first
    pytest.fail("the leaving client's request finished before it left, three times")


def test_the_readme_server_example_runs_against_a_live_server(client, server, engine, capsys):
    """The README's openai example, as written but for the server's address and model name
    (this module's tiny-random server instead of the embedded SmolLM2), prints the engine's text."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "from openai import" in b]
    assert 'base_url="http://127.0.0.1:8000/v1"' in block and 'model="SmolLM2-135M-Instruct"' in block
    code = block.replace("http://127.0.0.1:8000/v1", f"{server.base_url}/v1").replace(
        "SmolLM2-135M-Instruct", TINY_RANDOM
    )
    capsys.readouterr()
    exec(compile(code, "README.md", "exec"), {})
    (want,) = engine.generate(["What is the capital of France?"], greedy(32), chat=True)
    assert capsys.readouterr().out == want.text
