"""The MLA decode kernel's default block sizes against 64-head programs of 8 warps (issue 24).

DeepSeek-V3's decode shape (128 query heads over one latent cache of 512 + 64, page 64,
4096 tokens of context) at ``--requests`` requests: ``pallas_triton.default_block_sizes``'
choice, then 64-head programs of 8 warps with as many KV splits as the heuristic gives them
(its choice before 32-head programs), each timed ``--repeats`` times alternately (host clock
around synchronised calls, medians of 20 x 5, and the CUPTI device span, as ``mla_attention.py``). Then the user's path:
``MLAAttention.__call__`` (the layer picks PALLAS_MLA_GPU) under ``jax.jit`` with the cache
donated, its metadata built on the host (``layer.metadata_builder.build``, as the engine
does): the new latent written, ``q_nope`` absorbed, the kernel at its defaults, the output
up-projected.

    python benchmarks/mla_decode_blocks.py --out /tmp/mla_decode_blocks.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import sys

from gpu_check import gpu_device  # benchmarks/, the script's folder
from mla_attention import device_times, make_batch, time_fn  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def layer_seconds(spec, cache, table) -> tuple[float, str]:
    """Seconds per ``MLAAttention`` decode call on ``spec`` (one new token per request over
    ``cache``, whose pages ``table`` names), and the backend the layer chose."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from attn_jax.metadata import build_common_attn_metadata
    from attn_jax.mla_layer import MLAAttention

    nope, rope, dv, c = 128, spec.rope_dim, 128, spec.kv_lora_rank
    layer = MLAAttention(spec.num_heads, (nope + rope) ** -0.5, nope, rope, dv, None, c, block_size=spec.block_size,
                         dtype=jnp.bfloat16)  # fmt: skip
    reqs = spec.num_reqs
    md = build_common_attn_metadata([1] * reqs, [spec.context_len] * reqs, np.asarray(table), spec.block_size)
    meta = layer.metadata_builder.build(0, md)
    keys = jax.random.split(jax.random.key(7), 4)
    t = md.num_tokens
    q = jax.random.normal(keys[0], (t, spec.num_heads, nope + rope), jnp.bfloat16)
    kv_c = jax.random.normal(keys[1], (t, c), jnp.bfloat16)
    k_pe = jax.random.normal(keys[2], (t, rope), jnp.bfloat16)
    kv_b_proj = jax.random.normal(keys[3], (c, spec.num_heads * (nope + dv)), jnp.bfloat16) * c**-0.5
    step = jax.jit(layer.__call__, donate_argnums=(3,))
    state = {"cache": cache.copy()}

    def call():
        out, state["cache"] = step(q, kv_c, k_pe, state["cache"], meta, kv_b_proj)
        return out

    return time_fn(call), layer.attn_backend.get_name()


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
                dev = device_times(fn, q, cache, lens, table)
                rows.append({"requests": reqs, "choice": name, "repeat": rep, "block_sizes": str(bs),
                             "time_us": t * 1e6, **dev})  # fmt: skip
                print(f"{reqs:3d} requests  {name:18s} {bs}  {t * 1e6:8.1f} us; device {dev['device_us']:8.1f} us",
                      flush=True)  # fmt: skip
        t, backend = layer_seconds(spec, cache, table)
        rows.append({"requests": reqs, "choice": f"MLAAttention layer ({backend})", "time_us": t * 1e6})
        print(f"{reqs:3d} requests  MLAAttention layer ({backend}), write + absorb + kernel + up-projection  "
              f"{t * 1e6:8.1f} us", flush=True)  # fmt: skip
    result = {"benchmark": "mla_decode_blocks", "device": dev.device_kind, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
