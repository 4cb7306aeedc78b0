"""Whether a ``lax.scan`` over stacked layers, or fewer arguments a call, would pay on a GPU
(issue 46): compile time, the jitted call's host dispatch and the step, for 30 SmolLM2-shaped
layers in four arrangements (``--mode``):

- ``unrolled``: per-layer weights and KV pools, as ``LlamaModel`` ran them until stop 65 (5
  weight and 1 pool leaves a layer, every matrix [in, out]);
- ``stacked``: the same unrolled layers, each weight kind one stacked array indexed by the
  layer's static number (5 weight leaves in all), per-layer pools;
- ``one_pool``: stacked weights and one KV pool whose rows are offset per layer, unrolled;
- ``scan``: stacked weights and one pool, one ``lax.scan`` over the layers.

``stacked`` and ``one_pool`` ask whether XLA reads a layer's slice of a stacked weight in
place or copies it first (the step time says), and what the arguments cost (the dispatch).

Each layer is the model's without attention's arithmetic: RMSNorm, the fused q/k/v matmul,
a Pallas k/v write into the pool in place (``input_output_aliases``), a gather that reads
the written rows back (attention's stand-in), the output projection, RMSNorm, the fused
gate/up matmul, SiLU and the down projection; then the tied LM head and an argmax, whose
token feeds the next call (a decode chain). For each ``--tokens`` value and for one and
eight steps per call (a ``fori_loop``): the compile time, the median host time of a call to
return (dispatch), the step time over back-to-back calls, and the step with a wait after
each call. ``--mode`` runs one arrangement per process, so XLA flags can differ per run.

    python benchmarks/scan_layers.py --mode unrolled --tokens 1 64 256 --out /tmp/unrolled.json
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python benchmarks/scan_layers.py --mode scan
    python benchmarks/scan_layers.py --mode one_pool --layers 2 --pages 8 --tokens 4   # CPU (interpreted)
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, PAGE = 576, 1536, 9, 3, 64, 49152, 16
"""SmolLM2-135M's shape (30 layers by default, ``--layers``)."""
ROW = 256
"""Pool row width the k/v write stores (the first 256 of a token's 384 k and v values: a
power of two, as the Triton lowering's blocks need)."""


def kv_write(pool, kv, slots):
    """``pool`` [N, ROW] with ``kv`` [T, ROW]'s rows stored at ``slots`` i32[T] (-1: not),
    in place: a Pallas kernel of one token per program."""
    import jax
    from jax.experimental import pallas as pl

    def kernel(slots_ref, kv_ref, _, pool_ref):
        token = pl.program_id(0)  # outside the branch: the interpreter substitutes it only there
        slot = slots_ref[token]

        @pl.when(slot >= 0)
        def _():
            pool_ref[pl.ds(slot, 1), :] = kv_ref[pl.ds(token, 1), :]

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), grid=(kv.shape[0],),
        input_output_aliases={2: 0}, interpret=jax.default_backend() == "cpu",
    )(slots, kv, pool)  # fmt: skip


def layer(h, w, pool, slots):
    """One layer: h bf16[T, HIDDEN] -> (h, pool)."""
    import jax
    import jax.numpy as jnp

    def norm(x, weight):
        x32 = x.astype(jnp.float32)
        return weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)

    group, num_tokens = HEADS // KV_HEADS, h.shape[0]
    qkv = jnp.einsum("th,hkgd->tkgd", norm(h, w["norms"][0]), w["wqkv"])  # [T, Hkv, G + 2, D]
    q = qkv[:, :, :group].reshape(num_tokens, HEADS * HEAD_DIM)
    kv = jnp.concatenate([qkv[:, :, group].reshape(num_tokens, -1), qkv[:, :, group + 1].reshape(num_tokens, -1)], -1)
    pool = kv_write(pool, kv[:, :ROW], slots)
    read = pool[jnp.maximum(slots, 0)].astype(jnp.float32)  # attention's stand-in: the rows just written
    h = h + (q * (1 + jnp.mean(read, -1, keepdims=True)).astype(h.dtype)) @ w["wo"]
    gate_up = jnp.einsum("th,hgi->tgi", norm(h, w["norms"][1]), w["w_gate_up"])
    return h + (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]) @ w["w_down"], pool


def layer_weights(layers, i: int):
    """Layer ``i``'s weights: its own dict from a list of layers, or its static slice of each
    stacked array."""
    import jax

    return layers[i] if isinstance(layers, list) else jax.tree.map(lambda a: a[i], layers)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    pool_rows = args.pages * PAGE
    scan = args.mode == "scan"
    one_pool = args.mode in ("one_pool", "scan")

    def weight(*shape):
        if len(shape) == 1:
            return jnp.asarray(1 + 0.1 * rng.standard_normal(shape), jnp.bfloat16)
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * shape[-2] ** -0.5, jnp.bfloat16)

    layers = [
        dict(
            norms=jnp.stack([weight(HIDDEN), weight(HIDDEN)]),
            wqkv=weight(HIDDEN, KV_HEADS, HEADS // KV_HEADS + 2, HEAD_DIM),
            wo=weight(HEADS * HEAD_DIM, HIDDEN),
            w_gate_up=weight(HIDDEN, 2, INTERMEDIATE),
            w_down=weight(INTERMEDIATE, HIDDEN),
        )  # fmt: skip
        for _ in range(args.layers)
    ]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers) if args.mode != "unrolled" else layers
    params = dict(embed=weight(VOCAB, HIDDEN), layers=stacked)

    def forward(params, pools, tokens, slots):
        h = params["embed"][tokens]
        if scan:

            def body(carry, w):
                h, pool, offset = carry
                h, pool = layer(h, w, pool, jnp.where(slots >= 0, slots + offset, -1))
                return (h, pool, offset + pool_rows), None

            (h, pools, _), _ = jax.lax.scan(body, (h, pools, jnp.int32(0)), params["layers"])
        elif one_pool:
            for i in range(args.layers):
                w = layer_weights(params["layers"], i)
                h, pools = layer(h, w, pools, jnp.where(slots >= 0, slots + i * pool_rows, -1))
        else:
            written = []
            for i, pool in enumerate(pools):
                h, pool = layer(h, layer_weights(params["layers"], i), pool, slots)
                written.append(pool)
            pools = written
        logits = jnp.dot(h, params["embed"].T, preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32), pools

    def steps(num_steps):
        def call(params, pools, tokens, slots):
            body = lambda _, carry: forward(params, carry[1], carry[0], slots)  # noqa: E731
            return (
                jax.lax.fori_loop(0, num_steps, body, (tokens, pools))
                if num_steps > 1
                else forward(params, pools, tokens, slots)
            )

        return jax.jit(call, donate_argnums=1)

    if one_pool:
        pools = jnp.zeros((args.layers * pool_rows, ROW), jnp.bfloat16)
    else:
        pools = [jnp.zeros((pool_rows, ROW), jnp.bfloat16) for _ in range(args.layers)]
    rows = []
    for num_tokens in args.tokens:
        tokens = jnp.asarray(rng.integers(0, VOCAB, num_tokens), jnp.int32)
        slots = jnp.asarray(rng.permutation(pool_rows)[:num_tokens], jnp.int32)
        row = dict(tokens=num_tokens)
        for num_steps in (1, 8):
            start = time.perf_counter()
            call = steps(num_steps).lower(params, pools, tokens, slots).compile()
            row[f"compile_s_{num_steps}"] = round(time.perf_counter() - start, 2)
            for _ in range(3):
                tokens, pools = call(params, pools, tokens, slots)
            jax.block_until_ready(tokens)
            dispatch, start = [], time.perf_counter()
            for _ in range(args.calls // num_steps):
                t = time.perf_counter()
                tokens, pools = call(params, pools, tokens, slots)
                dispatch.append(time.perf_counter() - t)
            jax.block_until_ready(tokens)
            row[f"step_ms_{num_steps}"] = round((time.perf_counter() - start) / len(dispatch) / num_steps * 1e3, 4)
            row[f"dispatch_ms_{num_steps}"] = round(float(np.median(dispatch)) * 1e3, 4)
            waited = []
            for _ in range(20):
                t = time.perf_counter()
                tokens, pools = call(params, pools, tokens, slots)
                jax.block_until_ready(tokens)
                waited.append(time.perf_counter() - t)
            row[f"waited_step_ms_{num_steps}"] = round(float(np.median(waited)) / num_steps * 1e3, 4)
        print(row, flush=True)
        rows.append(row)
    return dict(
        benchmark="scan_layers", mode=args.mode, layers=args.layers, xla_flags=os.environ.get("XLA_FLAGS", ""),
        device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(), rows=rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("unrolled", "stacked", "one_pool", "scan"), default="unrolled")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256], help="tokens per step")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--pages", type=int, default=2048, help="KV pages per layer")
    parser.add_argument("--calls", type=int, default=200, help="steps timed back to back per row")
    add_output_args(parser, "scan_layers_{mode}.json")
    args = parser.parse_args()
    write_json(output_path(args), run(args))


if __name__ == "__main__":
    main()
