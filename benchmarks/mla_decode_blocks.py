"""The MLA decode kernel's default block sizes against 64-head programs of 8 warps (issue 24).

DeepSeek-V3's decode shape (128 query heads over one latent cache of 512 + 64, page 64,
4096 tokens of context) at ``--requests`` requests: ``pallas_triton.default_block_sizes``'
choice, then 64-head programs of 8 warps with as many KV splits as the heuristic gives them
(its choice before 32-head programs), each timed ``--repeats`` times alternately (host clock
around synchronised calls, medians of 20 x 5, as ``mla_attention.py``).

    python benchmarks/mla_decode_blocks.py --out /tmp/mla_decode_blocks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import sys

from gpu_check import gpu_device  # benchmarks/, the script's folder
from mla_attention import make_batch, time_fn  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,16,4,1", help="comma-separated request counts")
    parser.add_argument("--repeats", type=int, default=2)
    add_output_args(parser, "mla_decode_blocks.json")
    args = parser.parse_args(argv)

    import jax

    from attn_jax.ops.mla import pallas_triton
    from attn_jax.ops.mla.pallas_triton import NUM_SMS_DEFAULT, MLADecodeBlockSizes
    from attn_jax.testing.mla import MLA_WORKLOADS

    dev = gpu_device()
    if dev is None:
        return 2
    rows = []
    for reqs in (int(x) for x in args.requests.split(",")):
        spec = dataclasses.replace(MLA_WORKLOADS["MLA-D1"], num_reqs=reqs)
        q, cache, lens, table = make_batch(spec)
        pages = -(-spec.context_len // spec.block_size)
        default = pallas_triton.default_block_sizes(
            num_reqs=reqs, num_heads=spec.num_heads, pages_per_req=pages, page_size=spec.block_size
        )
        splits = max(1, min(pages, 2 * NUM_SMS_DEFAULT // (reqs * 2), 16))
        wide = MLADecodeBlockSizes(block_h=64, pages_per_tile=1, num_kv_splits=splits, num_warps=8)
        for rep in range(args.repeats):
            for name, bs in (("default", default), ("64 heads, 8 warps", wide)):
                fn = jax.jit(
                    functools.partial(
                        pallas_triton.mla_decode, sm_scale=192**-0.5, kv_lora_rank=spec.kv_lora_rank, block_sizes=bs
                    )
                )
                t = time_fn(fn, q, cache, lens, table)
                rows.append(
                    {"requests": reqs, "choice": name, "repeat": rep, "block_sizes": str(bs), "time_us": t * 1e6}
                )
                print(f"{reqs:3d} requests  {name:18s} {bs}  {t * 1e6:8.1f} us", flush=True)
    result = {"benchmark": "mla_decode_blocks", "device": dev.device_kind, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
