"""Multi-step decoding (``Engine(num_scheduler_steps=K)``): each backend's
``advance_decode`` moves a decode batch's metadata as building it anew would, and the
engine's tokens (greedy and seeded sampling, requests ending inside a call) do not depend
on K for the Pallas backends in their interpreters (the XLA backend: the limits grid of
``test_engine_requests.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.metadata import MetadataBuckets, build_common_attn_metadata
from attn_jax.mla_layer import MLAAttention
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params
from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.model_runner import ModelRunner
from attn_jax.serving.warmup import _dummy_batch

BACKENDS = ("XLA", "PALLAS_GPU", "PALLAS_TPU")
CONFIG = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
    eos_token_ids=(1,),
)  # fmt: skip
BLOCK_SIZE = 16


def _model(backend: str) -> LlamaModel:
    return LlamaModel(CONFIG, block_size=BLOCK_SIZE, attn_backend=AttentionBackendEnum[backend].get_class())


def _decode_metadata(builder, seq_lens, block_table):
    """``build_for_jit`` of a decode batch (one new token per request), bucket-padded."""
    n = len(seq_lens)
    buckets = MetadataBuckets((16,), (4,), (block_table.shape[1],))
    md = build_common_attn_metadata(
        np.ones(n, np.int32), np.asarray(seq_lens, np.int32), block_table, BLOCK_SIZE, buckets
    )
    return builder.build_for_jit(md)


@pytest.mark.parametrize("backend", BACKENDS)
def test_advance_decode_equals_building_the_later_batch(backend):
    builder = _model(backend).attn.metadata_builder
    assert builder.supports_decode_advance
    block_table = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)[::-1].copy()  # distinct pages per request
    seq_lens = np.array([5, 17, 33])
    steps, active = np.array([3, 0, 2]), np.array([True, False, True])
    moved = builder.advance_decode(
        _decode_metadata(builder, seq_lens, block_table),
        jnp.asarray(np.pad(steps, (0, 1))),
        jnp.asarray(np.pad(active, (0, 1))),
    )
    fresh = _decode_metadata(builder, seq_lens + steps, block_table)
    np.testing.assert_array_equal(moved.seq_lens, fresh.seq_lens)
    np.testing.assert_array_equal(moved.block_tables, fresh.block_tables)
    np.testing.assert_array_equal(moved.query_start_loc, fresh.query_start_loc)
    want_slots = np.where(np.arange(16) == 1, -1, np.asarray(fresh.slot_mapping))  # request 1 writes nothing
    np.testing.assert_array_equal(moved.slot_mapping, want_slots)
    if hasattr(fresh, "schedule"):  # the GPU schedule's q-blocks may come in another order

        def columns(schedule):
            return sorted(map(tuple, np.asarray(schedule).reshape(-1, np.shape(schedule)[-1]).T.tolist()))

        assert columns(moved.schedule) == columns(fresh.schedule)
        assert moved.block_sizes == fresh.block_sizes


@pytest.mark.parametrize("backend", (*BACKENDS, "XLA_MLA"))
def test_advance_by_no_steps_leaves_the_metadata_as_built(backend):
    """A multi-step call's first step runs on its metadata moved by 0 steps (the step program
    holds one scan over every step): that must be the metadata as built."""
    if backend == "XLA_MLA":  # DeepSeek's latent attention (4 heads, 32 latents, 16 RoPE dims)
        builder = MLAAttention(4, 40**-0.5, 24, 16, 20, None, 32, block_size=BLOCK_SIZE).metadata_builder
    else:
        builder = _model(backend).attn.metadata_builder
    block_table = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)[::-1].copy()
    built = _decode_metadata(builder, np.array([5, 17, 33]), block_table)
    moved = builder.advance_decode(built, jnp.zeros(4, jnp.int32), jnp.asarray([True, True, True, False]))
    arrays = {name: leaf for name, leaf in vars(built).items() if isinstance(leaf, (np.ndarray, jnp.ndarray))}
    assert {"seq_lens", "slot_mapping", "block_tables"} <= set(arrays)
    for name, leaf in arrays.items():
        np.testing.assert_array_equal(np.asarray(getattr(moved, name)), np.asarray(leaf), err_msg=name)


def test_a_multi_step_call_needs_a_batch_of_decodes():
    engine = Engine(_model("XLA"), init_params(CONFIG, seed=0), max_num_seqs=4, max_num_batched_tokens=32)
    batch = _dummy_batch((3, 1), 64, BLOCK_SIZE, SamplingParams(temperature=0.0))
    rows = {r: ModelRunner.request_row(r, q, {}) for r, q in zip(batch.requests, (3, 1), strict=True)}
    with pytest.raises(ValueError, match=r"num_steps=4 needs a batch of decodes only .* got new tokens \[\[3, 1\]\]"):
        engine.runner.prepare([batch], rows, [[1, 4]], 4)


@pytest.mark.parametrize("backend", ["PALLAS_GPU", "PALLAS_TPU"])
def test_tokens_do_not_depend_on_the_steps_per_call(backend):
    """Greedy and seeded-sampling requests, two of which end inside a multi-step call (with 3
    steps per call, tokens 2-4 and 5-7 come from the first and second decode calls: the 3- and
    5-token requests end inside them)."""
    params = init_params(CONFIG, seed=2)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 128, n).tolist() for n in (5, 19, 3)]
    sps = [
        SamplingParams(max_new_tokens=4, ignore_eos=True),
        SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, ignore_eos=True),
    ]
    runs = {}
    for steps in (1, 3):
        engine = Engine(
            _model(backend),
            params,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=48,
            num_scheduler_steps=steps,
            buckets=MetadataBuckets((32,), (4,), (3,)),  # one shape per axis: fewer interpreter compiles
        )
        runs[steps] = [c.output_ids for c in engine.generate(prompts, sps)]
        decode_calls = {s.num_steps for s in engine.stats if not s.num_prefill_tokens}
        assert decode_calls == {steps}
        assert engine.schedulers[0].allocator.num_free == engine.num_blocks
    assert runs[3] == runs[1]
    assert [len(t) for t in runs[3]] == [4, 3, 5]


def test_a_huge_steps_per_call_is_capped_at_what_the_batch_can_use():
    """``num_scheduler_steps=100000`` (a typo for 10): each call runs at most the power of two
    >= the tokens its requests have left (never below 8), with K=1's tokens."""
    params = init_params(CONFIG, seed=2)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    sps = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out = {}
    for steps in (1, 100_000):
        engine = Engine(_model("XLA"), params, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32,
                        num_scheduler_steps=steps)  # fmt: skip
        out[steps] = [c.output_ids for c in engine.generate(prompts, sps)]
    assert out[100_000] == out[1]
    assert max(s.num_steps for s in engine.stats) == 16  # 11 tokens left after the prefill's first


def test_bad_steps_per_call_are_refused():
    with pytest.raises(ValueError, match="num_scheduler_steps=0"):
        Engine(_model("XLA"), init_params(CONFIG, seed=2), num_scheduler_steps=0)


def test_more_request_slots_than_decode_rows():
    """24 request slots, 3 requests: a decode call's logits and sampling rows are its token
    bucket's 16, its metadata's requests the 24 slots; the chained one-step calls and the
    multi-step calls move both, with the 4-slot engine's tokens."""
    params = init_params(CONFIG, seed=2)
    prompts = [[5, 6, 7], [9, 10, 11, 12], list(range(20, 40))]
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 20, 14)]
    out = {}
    for seqs, steps in ((4, 1), (24, 1), (24, 4)):
        engine = Engine(_model("XLA"), params, max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=64,
                        num_scheduler_steps=steps)  # fmt: skip
        out[seqs, steps] = [c.output_ids for c in engine.generate(prompts, sps)]
        assert engine.buckets.request_buckets == (seqs,)
    assert out[24, 1] == out[4, 1] == out[24, 4]
