"""The sampler's device time per step beside an argmax (``serving/sampling.py``: one
program for every mix of sampling values; top-k / top-p over each row's ``CANDIDATES`` most
likely tokens, found by block maxima, and a Gumbel-max draw).

    python benchmarks/sampling_cost.py --rows 1 64 256 --vocab 49152 --top-k 40 --top-p 0.9

Beside it: ``greedy_scores`` (the argmax with the log-probabilities, a greedy program's work
until stop 74), ``sort_sampler`` (the engine's sampler until stop 70: the vocabulary sorted, every
set exact), ``bisection_sampler`` (exact top-k / top-p thresholds by bisection over the
values' ordered keys, 64 masked reductions; slower than the sort on an H200, BENCHMARKS.md:
not taken), the candidate search alone at each of ``CANDIDATE_BLOCKS`` (which sets
``CANDIDATE_BLOCK``), and the top ``MAX_LOGPROBS`` of each row by ``sampling.top_logprobs``
(block maxima) against ``lax.top_k``. Prints the median of each (CUDA-synchronised wall clock
over 50 calls after a warm-up, so a call's dispatch is in every figure: the argmax's is mostly
that) and each program's compile time, and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.serving.sampling import (
    CANDIDATES,
    MAX_LOGPROBS,
    pack_scores,
    sample_tokens,
    token_logprobs,
    top_logprobs,
)


def _ordered(x):
    """u32 keys in the order of the f32 values ``x``."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key(holds, lo, hi):
    """Per row the largest u32 key in [lo, hi] where the monotone ``holds`` is true (32 halvings)."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)
        ok = holds(mid) & (mid > lo)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, jnp.where(mid > lo, mid - 1, lo))

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def bisection_sampler(logits, temperature, top_p, top_k, seeds, counters):
    """``sample_tokens``' draw without a sort: the k-th value and the nucleus's edge found by
    bisection, the kept set every token at or above them, a categorical draw over it."""
    v = logits.shape[-1]
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    keys = _ordered(scaled)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = _largest_key(lambda t: (keys >= t[:, None]).sum(axis=-1) >= k, keys.min(axis=-1), keys.max(axis=-1))
    probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], scaled, -jnp.inf), axis=-1)

    def mass_above(t):
        return jnp.where(keys > t[:, None], probs, 0.0).sum(axis=-1) >= top_p

    edge = _largest_key(mass_above, kth - 1, keys.max(axis=-1))
    keep = keys > jnp.where(mass_above(kth - 1), edge, kth - 1)[:, None]
    rng = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(rng, jnp.where(keep, scaled, -jnp.inf))
    return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1))


def greedy_scores(logits):
    """The argmax with every row's log-probabilities (``token_logprobs``), packed for the host
    (``pack_scores``): what a greedy step program computed until stop 74, whether or not a
    request asked; since then a greedy decode call computes the argmax alone, and one in
    which a request asks runs the sampled program."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return pack_scores(tokens, *token_logprobs(logits, tokens))


def sort_sampler(logits, temperature, top_p, top_k, seeds, counters):
    """The engine's sampler until stop 70, kept to time against: every row's tempered logits
    sorted once, its exact top-k / top-p set masked in sorted order, a categorical draw."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    vocab = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    negated, order = jax.lax.sort((-scaled, vocab), dimension=1, num_keys=1)
    values = -negated
    keep = jnp.where(top_k[:, None] > 0, vocab < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (vocab == 0)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, values, -jnp.inf))
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(sampled, drawn, greedy)


CANDIDATE_BLOCKS = (16, 32, 64, 128)
"""The blocks ``top_logprobs`` is timed with for ``CANDIDATES`` candidates (``CANDIDATE_BLOCK``'s choice)."""


def compile_s(fn, *args) -> float:
    start = time.perf_counter()
    fn.lower(*args).compile()
    return time.perf_counter() - start


def median_ms(fn, *args, repeats: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--top-p", type=float, default=0.9, help="every row's (temperature 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="every row's; 0: off")
    add_output_args(parser, "sampling_cost.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    programs = {
        "argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1)),
        "greedy_scores": jax.jit(greedy_scores),
        "sample_tokens": jax.jit(sample_tokens),
        "sort_sampler": jax.jit(sort_sampler),
        "bisection_sampler": jax.jit(bisection_sampler),
        "top_logprobs": jax.jit(top_logprobs),
        "lax_top_k": jax.jit(lambda x: jax.lax.top_k(x, MAX_LOGPROBS)),
        **{
            f"candidates_block{b}": jax.jit(functools.partial(top_logprobs, block=b, count=CANDIDATES))
            for b in CANDIDATE_BLOCKS
        },
    }
    samplers = ("sample_tokens", "sort_sampler", "bisection_sampler")
    rows = []
    for n in args.rows:
        logits = jnp.asarray(rng.standard_normal((n, args.vocab), np.float32) * 3)
        t, p, k = (
            jnp.asarray(v)
            for v in (np.full(n, 0.8, np.float32), np.full(n, args.top_p, np.float32), np.full(n, args.top_k, np.int32))
        )
        seeds, counters = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)
        row = {"rows": n, "vocab": args.vocab}
        for name, fn in programs.items():
            call = (logits, t, p, k, seeds, counters) if name in samplers else (logits,)
            row[f"{name}_compile_s"] = compile_s(fn, *call)
            row[f"{name}_ms"] = median_ms(fn, *call)
        rows.append(row)
        print(f"rows {n:4d} x vocab {args.vocab}: " + ", ".join(
            f"{name} {row[f'{name}_ms']:.3f} ms (compile {row[f'{name}_compile_s']:.2f} s)" for name in programs
        ), flush=True)  # fmt: skip
    result = {
        "top_p": args.top_p, "top_k": args.top_k, "temperature": 0.8,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "rows": rows,
    }  # fmt: skip
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
