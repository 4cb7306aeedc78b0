"""``attn-stack serve`` compiles before it listens and streams multi-step decodes token by
token: after its warm-up, traffic of varied prompt lengths and batch sizes compiles no step
shape (``attn_stack_step_compilations_total`` stays 0); with 4 decode steps per call each
token is its own server-sent event, the same text as offline generation, and max_tokens
and stop strings end a request at its exact token inside a call.

(``test_serve_tiny.py`` runs the serve default, 8 steps per call, without the warm-up:
concurrency, aborts freeing their pages, errors.)
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from attn_jax.serving import SamplingParams
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine
from tests.server.conftest import Server

LIMITS = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)
STEPS = 4
ARGS = ["--model", TINY_RANDOM, "--num-scheduler-steps", str(STEPS)]
ARGS += ["--warmup-max-shapes", "all"]  # the default, said explicitly
ARGS += [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
COMPILED = ("attn_stack_step_compilations_total", ())
FAST_GAPS = ("attn_stack_inter_token_latency_seconds_bucket", (("le", "0.0005"),))
PROMPTS = ["Hi", "The capital of France is", "Once upon a time, in a small village by the sea, there lived " * 3]


@pytest.fixture(scope="module")
def server():
    server = Server(*ARGS)
    yield server.wait_ready()
    server.close()


@pytest.fixture(scope="module")
def engine():
    return tiny_random_engine(**LIMITS)  # one step per call: the tokens multi-step decoding must reproduce


def token_texts(engine, prompt: str, n: int) -> list[str]:
    """Each generated token's text, offline."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [e.text for e in engine.stream()]


def test_the_port_opens_after_every_shape_compiled(server):
    found = re.search(r"warmed up (\d+) step shapes \((\d+) compiled", server.log())
    assert found and int(found[1]) == int(found[2]) > 0, server.log()[-2000:]
    assert server.metrics()[COMPILED] == 0


def test_varied_traffic_compiles_nothing_and_matches_offline(server, engine):
    """Prompts of 2 to 60 tokens (chunked prefills), one to three at a time, streamed."""
    jobs = [[0], [1], [2], [0, 1], [2, 1, 0]]
    want = {p: c.text for p, c in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(max_new_tokens=9)), strict=True)}

    async def ask(client, prompt: str) -> str:
        stream = await client.completions.create(
            model=TINY_RANDOM, prompt=prompt, max_tokens=9, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run(job):
        async with server.async_client() as client:
            return await asyncio.gather(*(ask(client, PROMPTS[i]) for i in job))

    for job in jobs:
        assert asyncio.run(run(job)) == [want[PROMPTS[i]] for i in job]
    assert server.metrics()[COMPILED] == 0, server.log()[-2000:]


def test_each_token_of_a_multi_step_call_is_its_own_chunk(server, engine):
    texts = token_texts(engine, PROMPTS[1], 14)
    gaps_before = server.metrics().get(FAST_GAPS, 0)
    stream = server.client().completions.create(
        model=TINY_RANDOM, prompt=PROMPTS[1], max_tokens=14, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert [c.choices[0].text for c in chunks if c.choices and c.choices[0].text] == [t for t in texts if t]
    assert chunks[-1].usage.completion_tokens == 14
    # Tokens of one call reach the server together: their gaps are ~0 (one step per call, on
    # 2 CPU cores, leaves milliseconds between tokens): 4 steps per call ran.
    assert server.metrics()[FAST_GAPS] - gaps_before >= 14 // 2


@pytest.mark.parametrize("max_tokens", [1, 6, 7])
def test_max_tokens_ends_inside_a_call(server, engine, max_tokens):
    texts = token_texts(engine, PROMPTS[1], max_tokens)
    got = server.client().completions.create(
        model=TINY_RANDOM, prompt=PROMPTS[1], max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == "".join(texts) and got.usage.completion_tokens == max_tokens
    assert got.choices[0].finish_reason == "length"


def test_a_stop_string_ends_inside_a_call(server, engine):
    text = "".join(token_texts(engine, PROMPTS[2], 20))
    stop = text[len(text) // 2 :][:3]
    expected = text[: text.index(stop)]
    kwargs = dict(model=TINY_RANDOM, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop])
    chunks = list(server.client().completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    used, deadline = ("attn_stack_kv_cache_blocks_used", ()), time.monotonic() + 30
    while server.metrics()[used] and time.monotonic() < deadline:  # the gauge is set after the last chunk goes
        time.sleep(0.05)
    assert server.metrics()[used] == 0  # the stopped request's pages are free
