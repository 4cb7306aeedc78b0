"""``attn-stack serve`` on the embedded SmolLM2-135M-Instruct (the default model): the
openai client's chat and streamed completions are stock transformers' greedy tokens and
text (the engine's own ``generate`` gives the same tokens: tests/serving/test_engine.py), the
chat prompt rendered with the GGUF's chat template, transformers' rendering of it token for
token.

The server loads in its subprocess while this process computes the reference with the
session's transformers SmolLM2 (no second engine of 30 layers traced and compiled here: the
server's step programs at its default decode steps per call are the server's own).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

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


@dataclasses.dataclass(frozen=True)
class Reference:
    """transformers' greedy completion of one prompt, as the engine reports its own."""

    prompt_ids: list[int]
    output_ids: list[int]  # EOS included where it ended the completion
    text: str
    finish_reason: str


@pytest.fixture(scope="module")
def expected(server, hf_smollm2):
    """transformers' greedy completions: (chat answer, plain continuation), computed while the
    server loads. The chat prompt is the GGUF's chat template around one user message with the
    generation prompt (what the server and ``Engine.encode(chat=True)`` render)."""
    from tests.serving.hf_reference import hf_greedy  # torch: the test extra's

    model, tokenizer = hf_smollm2
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    out = []
    for ids in (chat_ids, tokenizer(PROMPT)["input_ids"]):
        new = hf_greedy(model, tokenizer, list(ids), NEW_TOKENS)
        stopped = new[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(new[:-1] if stopped else new, skip_special_tokens=True)
        out.append(Reference(list(ids), new, text, "stop" if stopped else "length"))
    return tuple(out)


@pytest.fixture(scope="module")
def client(server, expected):
    return server.wait_ready().client()


def test_chat_matches_transformers_greedy(client, expected):
    chat, _ = expected
    (model,) = client.models.list().data
    assert model.id == NAME
    got = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW_TOKENS, temperature=0
    )
    assert got.choices[0].message.content == chat.text and "Paris" in chat.text
    assert got.choices[0].finish_reason == chat.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(chat.prompt_ids), len(chat.output_ids))


def test_streamed_completion_matches_transformers_greedy(client, expected):
    _, plain = expected
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == plain.text and plain.text.startswith(" Paris")
    assert len([p for p in pieces if p]) > 1


def _lm_eval_task(tmp_path):
    """The tiny multiple-choice task's YAML in ``tmp_path``, its data file's path filled in, and
    a TaskManager that finds it."""
    from lm_eval.tasks import TaskManager

    data = Path(__file__).parent / "data" / "lm_eval"
    text = (data / "tiny_mc.yaml").read_text().replace("DATA_FILE", str(data / "tiny_mc.jsonl"))
    (tmp_path / "tiny_mc.yaml").write_text(text)
    return TaskManager(include_path=str(tmp_path), include_defaults=False)


def _loglikelihoods(results) -> tuple[list[list[float]], float]:
    """Each example's choices' log-likelihoods, and the accuracy."""
    samples = sorted(results["samples"]["attn_stack_tiny_mc"], key=lambda s: s["doc_id"])
    return [[r[0][0] for r in s["resps"]] for s in samples], results["results"]["attn_stack_tiny_mc"]["acc,none"]


def test_lm_eval_local_completions_equals_transformers(client, server, hf_smollm2, tmp_path, monkeypatch):
    """lm-eval-harness end to end: its ``local-completions`` model (echo, max_tokens 0 or 1,
    logprobs 1: the prompt's log-probabilities) against this server, and its ``hf`` model on
    stock transformers (the same GGUF, float32), on a 6-question multiple-choice task from a
    local JSONL file: every choice's log-likelihood agrees to 1e-3 and the accuracies are equal."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = hf_smollm2
    tokenizer.save_pretrained(tmp_path / "tokenizer")  # local-completions counts the context's tokens with it
    manager = _lm_eval_task(tmp_path)
    common = dict(tasks=["attn_stack_tiny_mc"], task_manager=manager, log_samples=True, bootstrap_iters=0)
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(
            model=NAME, base_url=f"{server.base_url}/v1/completions", tokenizer=str(tmp_path / "tokenizer"),
            tokenizer_backend="huggingface", num_concurrent=1, max_retries=1,
        ),
        **common,
    )  # fmt: skip
    stock = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8), **common)
    got, got_acc = _loglikelihoods(served)
    want, want_acc = _loglikelihoods(stock)
    assert len(got) == 6 and all(len(x) == 4 for x in got)
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert got_acc == want_acc
