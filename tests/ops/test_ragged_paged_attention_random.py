"""The jnp reference of ragged paged attention on random ragged batches (hypothesis).

Request counts and lengths, head layouts, block sizes, padding and every option are
drawn at random; ``ragged_checks.check`` compares the output with the float64 oracle
and checks the returned cache. Named cases live in test_ragged_paged_attention.py.
"""

from __future__ import annotations

import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_jax.testing.workloads import make_ragged_batch
from tests.ops.ragged_checks import check, make_options


@st.composite
def batch_specs(draw, dtypes=("float32",), cache_dtypes=("auto",)):
    """(seed, make_ragged_batch kwargs, make_options kwargs) for a small random batch."""
    num_reqs = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(0, 6), min_size=num_reqs, max_size=num_reqs))
    context_lens = draw(st.lists(st.integers(0, 12), min_size=num_reqs, max_size=num_reqs))
    num_q_heads, num_kv_heads = draw(st.sampled_from([(2, 2), (4, 2), (4, 1), (6, 3), (3, 1)]))
    batch_kwargs = dict(
        query_lens=query_lens,
        context_lens=context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([8, 16])),
        block_size=draw(st.sampled_from([2, 3, 4, 8])),
        dtype=jnp.dtype(draw(st.sampled_from(dtypes))),
        cache_dtype_str=draw(st.sampled_from(cache_dtypes)),
        num_tokens=sum(query_lens) + draw(st.integers(0, 3)),
        extra_blocks=draw(st.integers(0, 2)),
        num_padding_requests=draw(st.integers(0, 1)),
        shuffle_blocks=draw(st.booleans()),
    )
    option_kwargs = dict(
        sm_scale=draw(st.sampled_from([None, 0.3, 1.0])),
        causal=draw(st.booleans()),
        sliding_window=draw(st.none() | st.integers(1, 8)),
        logits_soft_cap=draw(st.sampled_from([None, 1.0, 5.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    return draw(st.integers(0, 2**16)), batch_kwargs, option_kwargs


def _check_spec(spec, use_jit: bool) -> None:
    seed, batch_kwargs, option_kwargs = spec
    batch = make_ragged_batch(seed, **batch_kwargs)
    check(batch, make_options(batch, **option_kwargs), use_jit)


# Each example compiles the op afresh (new shapes and options): about a second each.
@settings(max_examples=20, deadline=None)
@given(spec=batch_specs())
def test_random_batches_match_oracle_jit(spec):
    _check_spec(spec, use_jit=True)


@settings(max_examples=5, deadline=None)
@given(spec=batch_specs())
def test_random_batches_match_oracle_eager(spec):
    _check_spec(spec, use_jit=False)


@settings(max_examples=20, deadline=None)
@given(
    spec=batch_specs(
        dtypes=("float32", "bfloat16", "float16"),
        cache_dtypes=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )
)
def test_random_low_precision_and_fp8_match_oracle(spec):
    _check_spec(spec, use_jit=True)
