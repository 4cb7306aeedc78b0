"""Issue 22's load test at CPU scale: hundreds of streaming clients at once against
``attn-stack serve --model tiny-random`` in a subprocess, through the official openai client.

Every request gets exactly the tokens and text the engine's own ``generate`` gives; none is
lost; afterwards every KV page is back and nothing runs or waits; and the resident memory of
the server and its engine process comes back to its baseline. The server has a batch of its
own (32 requests, a 256-token budget), larger than ``test_serve_tiny.py``'s, so that 300
clients finish well inside the client's timeout on 2 cores.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from attn_jax.serving import SamplingParams
from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine
from tests.server.conftest import Server, idle, stream_greedy

LIMITS = dict(max_model_len=64, max_num_seqs=32, max_num_batched_tokens=256)
ARGS = ["--model", TINY_RANDOM, "--no-warmup"] + [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
LOAD_CLIENTS = int(os.environ.get("ATTN_STACK_LOAD_CLIENTS", "300"))
NEW_TOKENS = 4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server():
    server = Server(*ARGS)  # loads while the test builds its reference engine
    yield server
    server.close()


@pytest.mark.slow
def test_hundreds_of_streaming_clients_lose_nothing_and_memory_returns_to_its_baseline(server):
    """``LOAD_CLIENTS`` (300; ``ATTN_STACK_LOAD_CLIENTS``) clients at once, twice: the first
    round brings the server to its steady state (shapes compiled, pools grown), so the
    resident memory after the second must be within 5 % of that after the first."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(LOAD_CLIENTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    want = [(c.text, NEW_TOKENS) for c in tiny_random_engine(**LIMITS).generate(prompts, params)]

    async def round_() -> list[tuple[str, int]]:
        async with server.wait_ready().async_client() as client:
            return await asyncio.gather(*(stream_greedy(client, TINY_RANDOM, p, NEW_TOKENS) for p in prompts))

    rss = []
    for _ in range(2):
        assert asyncio.run(round_()) == want
        server.wait_for(idle, "every KV page back, nothing running or waiting, after the clients")
        rss.append(server.rss_bytes())
    assert rss[1] <= 1.05 * rss[0], f"resident memory grew from {rss[0] >> 20} MiB to {rss[1] >> 20} MiB"
