"""Host time of ``build_common_attn_metadata`` for a 256-request mixed batch.

4 prefills of 200-400 new tokens and 252 decodes, contexts up to 4096, block size 16.
Prints microseconds per build (median over many timeit repeats) for the NumPy build
and, to decide whether device fields should be jax arrays, the build followed by one
``jax.device_put`` of the device fields, and build + a trivial jitted step taking the
metadata with NumPy fields (jit transfers them) or device_put fields. Prints the
results; ``--write`` writes benchmarks/results/metadata_build.json (``--out PATH``: elsewhere).

Run: .venv/bin/python benchmarks/metadata_build.py [--write]
"""

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import timeit

import jax
import numpy as np
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.metadata import build_common_attn_metadata

NUM_REQS = 256
NUM_PREFILLS = 4
BLOCK_SIZE = 16
MAX_CONTEXT = 4096
NUMBER = 200  # builds per timeit repeat
REPEATS = 50


def mixed_batch(seed: int = 0):
    """query_lens i32[256], seq_lens i32[256], block_table i32[256, 256]."""
    rng = np.random.default_rng(seed)
    query_lens = np.ones(NUM_REQS, np.int32)
    query_lens[NUM_REQS - NUM_PREFILLS :] = rng.integers(200, 401, NUM_PREFILLS)
    seq_lens = (query_lens + rng.integers(0, MAX_CONTEXT - 400, NUM_REQS)).astype(np.int32)
    pages = MAX_CONTEXT // BLOCK_SIZE
    block_table = rng.permutation(NUM_REQS * pages).astype(np.int32).reshape(NUM_REQS, pages)
    return query_lens, seq_lens, block_table


def median_us(fn) -> float:
    times = timeit.repeat(fn, number=NUMBER, repeat=REPEATS)
    return statistics.median(times) / NUMBER * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, "metadata_build.json")
    args = parser.parse_args()
    query_lens, seq_lens, block_table = mixed_batch()

    def build():
        return build_common_attn_metadata(query_lens, seq_lens, block_table, BLOCK_SIZE)

    def build_and_device_put():
        md = build()
        q, s, bt, slots = jax.device_put((md.query_start_loc, md.seq_lens, md.block_table_tensor, md.slot_mapping))
        return dataclasses.replace(md, query_start_loc=q, seq_lens=s, block_table_tensor=bt, slot_mapping=slots)

    @jax.jit
    def step(md):
        return md.slot_mapping.sum() + md.block_table_tensor.sum() + md.seq_lens.sum()

    def build_and_step_numpy():
        return step(build()).block_until_ready()

    def build_device_put_and_step():
        return step(build_and_device_put()).block_until_ready()

    build_and_step_numpy()
    build_device_put_and_step()
    md = build()
    result = {
        "benchmark": "build_common_attn_metadata",
        "workload": {
            "num_reqs": NUM_REQS,
            "num_prefills": NUM_PREFILLS,
            "num_actual_tokens": md.num_actual_tokens,
            "padded_shapes": {
                "tokens": md.num_tokens,
                "reqs": md.num_reqs,
                "blocks_per_request": md.block_table_tensor.shape[1],
            },
            "block_size": BLOCK_SIZE,
            "max_context": MAX_CONTEXT,
        },
        "us_per_build_numpy": median_us(build),
        "us_per_build_with_device_put": median_us(build_and_device_put),
        "us_per_build_and_jit_step_numpy_fields": median_us(build_and_step_numpy),
        "us_per_build_and_jit_step_device_put_fields": median_us(build_device_put_and_step),
        "timeit": {"number": NUMBER, "repeat": REPEATS, "statistic": "median"},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(),
            "nproc": os.cpu_count(),
        },
    }
    for key in [k for k in result if k.startswith("us_")]:
        print(f"{key}: {result[key]:.1f} us")
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
