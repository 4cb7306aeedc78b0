"""The engine on a tiny random model: the same greedy tokens under every limit (odd and
even ``max_num_seqs``, tiny token budgets, tiny caches that preempt), with and without
asynchronous scheduling; requests that are refused before anything is queued, that fail
alone, or that are aborted, while the others keep being served."""

from __future__ import annotations

import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.engine import UnknownRequestError

CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
    eos_token_ids=(1,),
)  # fmt: skip
PARAMS = init_params(CONFIG, seed=5)
PROMPTS = [np.random.default_rng(i).integers(2, 128, n).tolist() for i, n in enumerate((3, 17, 6, 30, 9))]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _engine(**kwargs) -> Engine:
    kwargs.setdefault("max_model_len", 48)
    return Engine(LlamaModel(CONFIG, block_size=4), PARAMS, **kwargs)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy tokens with roomy limits, one step at a time (no asynchronous scheduling)."""
    engine = _engine(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=False)
    return [c.output_ids for c in engine.generate(PROMPTS, GREEDY)]


# The preempting limits pad every step to one shape per axis (the reference pads to the default buckets): the
# point there is preemption, and one bucket compiles 2 step shapes instead of 8.
PREEMPTING = dict(max_num_seqs=3, max_num_batched_tokens=24, num_blocks=10, buckets=MetadataBuckets((24,), (3,), (12,)))


@pytest.mark.parametrize(
    "limits",
    [
        dict(max_num_seqs=8, max_num_batched_tokens=64),  # asynchronous scheduling, the default
        dict(max_num_seqs=5, max_num_batched_tokens=7),
        PREEMPTING,
        dict(max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=4),  # multi-step decoding
        dict(PREEMPTING, num_scheduler_steps=4),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if k != "buckets"),
)
def test_greedy_tokens_do_not_depend_on_the_limits(reference, limits):
    engine = _engine(**limits)
    assert [c.output_ids for c in engine.generate(PROMPTS, GREEDY)] == reference
    assert all(s.allocator.num_free == engine.num_blocks for s in engine.schedulers)


def test_asynchronous_steps_stop_at_eos_exactly():
    """A request that samples EOS stops there, though the next step was dispatched before
    the token was read (or a multi-step decode ran on past it): the extra tokens are
    dropped and its pages freed."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=64, buckets=MetadataBuckets((64,), (4,), (12,)))  # one shape
    engine = _engine(**limits, async_scheduling=False)
    free_running = engine.generate(PROMPTS[:3], GREEDY)
    eos = free_running[1].output_ids[2]  # make the second request's third token its EOS
    for async_scheduling, steps in ((False, 1), (True, 1), (True, 4)):
        engine = _engine(**limits, async_scheduling=async_scheduling, num_scheduler_steps=steps)
        engine.eos_token_ids = {eos}
        got = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6))
        want = free_running[1].output_ids[: free_running[1].output_ids.index(eos) + 1]
        assert got[1].output_ids == want and got[1].finish_reason == "stop"
        assert engine.schedulers[0].allocator.num_free == engine.num_blocks


def test_a_failing_request_fails_alone(reference):
    engine = _engine(max_num_seqs=8, max_num_batched_tokens=64)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.get_request(ids[1]).seed = 2**32  # a corrupted request: its seed does not fit the step
    events = list(engine.stream())
    failed = [e for e in events if e.request_id == ids[1]]
    assert len(failed) == 1 and failed[0].finish_reason == "error"
    assert "OverflowError" in failed[0].error
    done = [engine.completion(i) for i in ids]
    assert done[1].finish_reason == "error" and done[1].error == failed[0].error
    assert [c.output_ids for i, c in enumerate(done) if i != 1] == [r for i, r in enumerate(reference) if i != 1]
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks


@pytest.mark.parametrize("steps", [1, 3])
def test_abort_frees_the_pages_and_the_others_go_on(reference, steps):
    """Aborted while its step is in flight (with 3 steps per call: inside a multi-step decode)."""
    engine = _engine(max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=steps)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    engine.step()
    assert engine.stats[-1].num_steps == steps
    engine.abort_request(ids[3])
    engine.abort_request(ids[3])  # a finished request: nothing to do
    list(engine.stream())
    assert engine.completion(ids[3]).finish_reason == "abort"
    assert [engine.completion(i).output_ids for i in ids[:3]] == reference[:3]
    assert engine.schedulers[0].allocator.num_free == engine.num_blocks


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda e: e.add_request([1.7, 2.9]),
            TypeError,
            r"token 0 is 1.7 \(float\): token ids must be integers",
        ),
        (lambda e: e.add_request(["12", "13"]), TypeError, r"prompt token 0 is '12' \(str\)"),
        (lambda e: e.add_request(b"hello"), TypeError, "is bytes: give text"),
        (lambda e: e.add_request([True, 3]), TypeError, r"prompt token 0 is True \(bool\)"),
        (lambda e: e.add_request([3], {"max_new_tokens": 3}), TypeError, "is a dict, not a SamplingParams"),
        (lambda e: e.generate([[3], [4]], [GREEDY]), ValueError, "1 params for 2 prompts"),
        (lambda e: e.generate([[3], [400]]), ValueError, r"prompt token id 400 is outside the vocabulary \[0, 128\)"),
        (lambda e: e.get_request("nope"), UnknownRequestError, "unknown request_id='nope'; this engine has 0"),
        (lambda e: e.completion("nope"), KeyError, "unknown request_id='nope'"),
        (lambda e: e.abort_request("nope"), KeyError, "unknown request_id='nope'"),
    ],
)
def test_bad_calls_queue_nothing(call, error, match):
    engine = _engine(max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(error, match=match):
        call(engine)
    assert not engine.has_unfinished()
    assert str(UnknownRequestError("unknown request_id='x'")) == "unknown request_id='x'"  # no KeyError quotes


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_engine_seed_range(seed):
    with pytest.raises(ValueError, match=r"must be an integer in \[0, 2\*\*32\)"):
        _engine(seed=seed)
