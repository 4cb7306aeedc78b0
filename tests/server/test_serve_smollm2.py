"""``attn-stack serve`` on the embedded SmolLM2-135M-Instruct (the default model): the
openai client's chat and streamed completions are the engine's own ``generate`` output,
the chat prompt rendered with the GGUF's chat template.

The server loads in its subprocess while this process builds the reference engine
(same limits and decode steps per call; one request at a time): the server then finds its step
programs in the session's compilation cache.
"""

from __future__ import annotations

import pytest

from attn_jax.cli import SERVE_NUM_SCHEDULER_STEPS
from attn_jax.serving import Engine, SamplingParams
from tests.server.conftest import Server

LIMITS = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)
ARGS = ["--no-warmup"] + [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
NAME = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    server = Server(*ARGS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def expected(server, smollm2_gguf):
    """The reference engine's greedy completions: (chat answer, plain continuation). Built as
    the server builds its engine (its decode steps per call too), so its step programs are
    the server's: the server, whose first request comes after, loads them from the session's
    compilation cache instead of compiling them again."""
    engine = Engine.from_gguf(smollm2_gguf, **LIMITS, num_scheduler_steps=SERVE_NUM_SCHEDULER_STEPS)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    (chat,) = engine.generate([QUESTION], greedy, chat=True)
    (plain,) = engine.generate([PROMPT], greedy)
    return chat, plain


@pytest.fixture(scope="module")
def client(server, expected):
    return server.wait_ready().client()


def test_chat_matches_engine_generate(client, expected):
    chat, _ = expected
    (model,) = client.models.list().data
    assert model.id == NAME
    got = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW_TOKENS, temperature=0
    )
    assert got.choices[0].message.content == chat.text and "Paris" in chat.text
    assert got.choices[0].finish_reason == chat.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(chat.prompt_ids), len(chat.output_ids))


def test_streamed_completion_matches_engine_generate(client, expected):
    _, plain = expected
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == plain.text and plain.text.startswith(" Paris")
    assert len([p for p in pieces if p]) > 1
