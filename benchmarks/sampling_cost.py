"""The sampler's device time per step beside an argmax (``serving/sampling.py``): one
program for every mix of sampling values sorts the tempered logits of every row each step.

    python benchmarks/sampling_cost.py --rows 1 64 256 --vocab 49152

Beside it, the pieces of a sort-free sampler: an argmax with the top ``MAX_LOGPROBS`` by
``lax.top_k`` and the log-sum-exp (a greedy row's log-probabilities), and a categorical draw
over the whole vocabulary. Prints the median of each (CUDA-synchronised wall clock over 50 calls after a warm-up) and
writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.serving.sampling import MAX_LOGPROBS, sample_tokens


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
    sample, argmax = jax.jit(sample_tokens), jax.jit(lambda x: jnp.argmax(x, axis=-1))
    # The pieces a sort-free sampler would use: a greedy row's top log-probabilities by
    # ``lax.top_k``, and an exact draw over the whole vocabulary (Gumbel-max, no filter).
    greedy_top = jax.jit(
        lambda x: (jnp.argmax(x, axis=-1), jax.lax.top_k(x, MAX_LOGPROBS), jax.nn.logsumexp(x, axis=-1))
    )
    draw = jax.jit(lambda x, seeds: jax.vmap(lambda s, r: jax.random.categorical(jax.random.PRNGKey(s), r))(seeds, x))
    rows = []
    for n in args.rows:
        logits = jnp.asarray(rng.standard_normal((n, args.vocab), np.float32) * 3)
        t, p, k = (jnp.asarray(v) for v in (np.full(n, 0.8, np.float32), np.full(n, 0.9, np.float32), np.full(n, 40)))
        seeds, counters = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)
        row = {
            "rows": n, "vocab": args.vocab, "argmax_ms": median_ms(argmax, logits),
            "sample_tokens_ms": median_ms(sample, logits, t, p, k, seeds, counters),
            "argmax_top_k_logprobs_ms": median_ms(greedy_top, logits),
            "categorical_ms": median_ms(draw, logits, seeds),
        }  # fmt: skip
        rows.append(row)
        print(f"rows {n:4d} x vocab {args.vocab}: argmax {row['argmax_ms']:.3f} ms, sample_tokens "
              f"{row['sample_tokens_ms']:.3f} ms, argmax + top-{MAX_LOGPROBS} log-probabilities "
              f"{row['argmax_top_k_logprobs_ms']:.3f} ms, categorical {row['categorical_ms']:.3f} ms",
              flush=True)  # fmt: skip
    result = {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "rows": rows,
    }  # fmt: skip
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
