"""The sampler's device time per step beside an argmax (``serving/sampling.py``): one
program for every mix of sampling values, sort-free (bisections for the top-k / top-p
thresholds, block maxima for the top log-probabilities).

    python benchmarks/sampling_cost.py --rows 1 64 256 --vocab 49152

Beside it, what it replaced: the sampler that sorted the tempered logits of every row each
step (as vLLM's GPU sampler does), and ``lax.top_k`` for a greedy row's top
``MAX_LOGPROBS``. Prints the median of each (CUDA-synchronised wall clock over 50 calls
after a warm-up, so a call's dispatch is in every figure: the argmax's is mostly that) and
each program's compile time, and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.serving.sampling import MAX_LOGPROBS, sample_tokens, top_logprobs


def sorting_sampler(logits, temperature, top_p, top_k, seeds, counters):
    """The sampler before 2026-11-28 (for comparison): the tempered logits sorted, the
    top-k / top-p set masked in sorted order, a categorical draw over it."""
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    vocab = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    negated, order = jax.lax.sort((-scaled, vocab), dimension=1, num_keys=1)
    keep = jnp.where(top_k[:, None] > 0, vocab < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, -negated, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (vocab == 0)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, -negated, -jnp.inf))
    drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1)), order[:, :MAX_LOGPROBS]


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
    add_output_args(parser, "sampling_cost.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    programs = {
        "argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1)),
        "sample_tokens": jax.jit(sample_tokens),
        "sorting_sampler": jax.jit(sorting_sampler),
        "argmax_top_logprobs": jax.jit(
            lambda x: (jnp.argmax(x, axis=-1), top_logprobs(x, jax.nn.logsumexp(x, axis=-1, keepdims=True)))
        ),
        "argmax_lax_top_k": jax.jit(
            lambda x: (jnp.argmax(x, axis=-1), jax.lax.top_k(x, MAX_LOGPROBS), jax.nn.logsumexp(x, axis=-1))
        ),
    }
    samplers = ("sample_tokens", "sorting_sampler")
    rows = []
    for n in args.rows:
        logits = jnp.asarray(rng.standard_normal((n, args.vocab), np.float32) * 3)
        t, p, k = (jnp.asarray(v) for v in (np.full(n, 0.8, np.float32), np.full(n, 0.9, np.float32), np.full(n, 40)))
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
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "rows": rows,
    }  # fmt: skip
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
