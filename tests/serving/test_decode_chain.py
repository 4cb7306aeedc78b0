"""Decode calls that continue the last call (``ModelRunner.continue_decode``), of one step
or several: the inputs the last call computed on the device equal what the host would
build, and the engine's tokens do not change when the chain is taken, through page
crossings, a late arrival, an abort and seeded sampling."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.model_runner import ModelRunner

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=6)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 29)), [40, 41, 42]]  # 5, 19 and 3 tokens: pages of 8 fill at different steps
SAMPLING = [
    SamplingParams(max_new_tokens=14, ignore_eos=True),
    SamplingParams(max_new_tokens=11, temperature=0.9, top_k=20, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=1.0, seed=8, ignore_eos=True),
]


LONGER = [dataclasses.replace(sp, max_new_tokens=25) for sp in SAMPLING[:2]]
"""Two requests decoding long enough for several multi-step calls of the same batch."""


def _engine(backend: str, num_scheduler_steps: int = 1) -> Engine:
    model = LlamaModel(CONFIG, block_size=8, attn_backend=AttentionBackendEnum[backend].get_class())
    return Engine(
        model, PARAMS, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
        num_scheduler_steps=num_scheduler_steps,
    )  # fmt: skip


def _run(engine: Engine) -> list[list[int]]:
    """Two requests, a third added after four steps, the first aborted after twelve: each
    request's streamed tokens."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], SAMPLING[:2], strict=True)]
    out: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or step < 5:
        if step == 4:
            ids.append(engine.add_request(PROMPTS[2], SAMPLING[2]))
        if step == 12:
            engine.abort_request(ids[0])
        for event in engine.step():
            if event.token_id >= 0:
                out.setdefault(event.request_id, []).append(event.token_id)
        step += 1
    return [out.get(request_id, []) for request_id in ids]


@pytest.fixture(scope="module")
def tokens_without_the_chain() -> list[list[int]]:
    """The XLA backend's tokens with every call built on the host."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "continue_decode", lambda self, *args, **kwargs: None)
        return _run(_engine("XLA"))


def _spy(monkeypatch) -> list:
    """Each ``continue_decode`` result of the test (None: built on the host)."""
    results = []
    original = ModelRunner.continue_decode

    def spy(self, *args, **kwargs):
        results.append(original(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(ModelRunner, "continue_decode", spy)
    return results


@pytest.mark.parametrize("backend", ["XLA", "PALLAS_GPU"])
def test_tokens_are_the_same_with_and_without_the_chain(backend, tokens_without_the_chain, monkeypatch):
    """(The PALLAS_GPU interpreter gives the XLA backend's tokens: test_engine_backends.py.)"""
    results = _spy(monkeypatch)
    engine = _engine(backend)
    with_chain = _run(engine)
    continued = [r is not None for r in results]
    assert sum(continued) >= 10 and not all(continued)  # taken often, and broken by the arrival and the abort
    assert any(r is not None and r.page_delta is not None for r in results)  # continued across a page crossing
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks
    assert with_chain == tokens_without_the_chain
    # The first is aborted before its last (14th) token: after 12 steps, 13 calls (the third's admission
    # call, behind a decode still running, had the next call dispatched right behind it).
    assert [len(t) for t in with_chain] == [12, 11, 16]


def test_multi_step_calls_continue_with_the_same_tokens(monkeypatch):
    """Calls of four decode steps continue the last one too (each request four tokens on),
    across page crossings, with the tokens of calls built on the host."""

    def run():
        return [c.output_ids for c in _engine("XLA", num_scheduler_steps=4).generate(PROMPTS[:2], LONGER)]

    with monkeypatch.context() as mp:
        mp.setattr(ModelRunner, "continue_decode", lambda self, *args, **kwargs: None)
        want = run()
    results = _spy(monkeypatch)
    got = run()
    multi = [r for r in results if r is not None and r.num_steps == 4]
    assert len(multi) >= 3 and any(r.page_delta is not None for r in multi)
    assert got == want


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_the_device_built_inputs_equal_the_host_built_ones(num_scheduler_steps, monkeypatch):
    """Each time the chain is taken, the buffer the last call computed, with the gained pages
    written in, equals the host's own build of the same call, padding included (the XLA
    backend's metadata has no order to differ in)."""
    original = ModelRunner.continue_decode
    compared = []

    def checked(self, batches, steps, num_steps, num_common_blocks=None):
        continued = original(self, batches, steps, num_steps, num_common_blocks)
        if continued is not None:
            reqs = batches[0].requests
            rows = {r: ModelRunner.request_row(r, 1, {r: i for i, r in enumerate(reqs)}) for r in reqs}
            host = self.prepare(batches, rows, steps, num_steps, num_common_blocks)
            assert host.key == continued.key
            buffer = np.asarray(continued.packed[0][0]).copy()
            if continued.page_delta is not None:
                index, page = continued.page_delta[0]  # the only data shard's
                buffer[index[index < buffer.size]] = page[index < buffer.size]
            np.testing.assert_array_equal(buffer, host.packed[0][0])
            compared.append(continued.page_delta is not None)
        return continued

    monkeypatch.setattr(ModelRunner, "continue_decode", checked)
    engine = _engine("XLA", num_scheduler_steps)
    _run(engine) if num_scheduler_steps == 1 else engine.generate(PROMPTS[:2], LONGER)
    assert len(compared) >= (10 if num_scheduler_steps == 1 else 3) and any(compared)


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_continued_calls_take_the_last_calls_inputs_in_place(num_scheduler_steps, monkeypatch):
    """A continued call donates the packed inputs the last call computed (page crossings
    included), and jit finds an output to give their buffer to (no "donated buffers were not
    usable" warning): the next call's inputs stay at that address, so XLA's recorded CUDA graph
    of the step needs no update for them (``model_runner.DONATED_STEP_ARGS``)."""
    original = ModelRunner.dispatch
    taken = []

    def recorded(self, prepared):
        buffer = prepared.packed[0][0]
        call = original(self, prepared)
        if isinstance(buffer, jax.Array):  # the last call's inputs moved on, not the host's
            taken.append((buffer.is_deleted(), prepared.page_delta is not None))
        return call

    monkeypatch.setattr(ModelRunner, "dispatch", recorded)
    engine = _engine("XLA", num_scheduler_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.generate(PROMPTS[:2], LONGER)
    assert not [w for w in caught if "donated" in str(w.message)], [str(w.message) for w in caught]
    assert len(taken) >= (10 if num_scheduler_steps == 1 else 2) and any(delta for _, delta in taken)
    assert all(deleted for deleted, _ in taken)
