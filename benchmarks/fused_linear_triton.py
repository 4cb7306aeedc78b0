"""A decode step's linear layers as fused Pallas Triton GEMVs against XLA's GEMMs: device time.

Stop 68 found a batch-1 decode step at 12 kernels a layer, its GEMMs about 5x their weight-read
time, and named kernels of our own as the lever: GEMVs that take the RMS norm as their prologue
and RoPE, SiLU x up and the residual add as their epilogues would leave 4 kernels a layer for the
linear part, where XLA runs 9 (11 a layer here with the k/v scatter and a cache copy). This probe
measures that before building it into the model.

30 SmolLM2-135M-shaped layers (H 576, 9 q / 3 KV heads of 64, I 1536, bf16 weights; a layer's
matrices that end in H one [N, H] buffer, as ``serving/layer_buffers.py`` packs them), at 16 and
64 tokens (the engine's token buckets at batch 1 and 64). Attention is stood in for by q itself;
k and v go into a per-layer cache by a scatter in both arms. Arms:

- ``xla``: the model's ops as ``LlamaModel.step`` writes them (norm, einsum GEMMs, RoPE, SiLU);
- ``fused_<cfg>``: per layer, norm + QKV + RoPE (q and k/v as two outputs), o + residual,
  norm + gate/up + SiLU x up, down + residual: four ``pallas_call`` GEMVs, each program owning
  ``bn`` output columns and running K in a ``fori_loop`` of ``bk`` columns (Triton pipelines it
  ``num_stages`` deep); ``CONFIGS`` are the tilings tried.

Each arm's layer is checked against the XLA layer first (max error relative to its largest
value); then CUPTI device spans of 30 calls (``cupti_timing.trace_calls``) and, for the call
of the median span, its kernels by name. Probe artefacts, in both arms or the fused one: each
cache is copied before its scatter (not donated), and the norm weights' slices ``norms[0]`` and
``norms[1]`` are copied before the fused arm's kernels take them. On the CPU the kernels run in
the interpreter (``--check`` only).

    python benchmarks/fused_linear_triton.py --out /tmp/fused_linear.json
    python benchmarks/fused_linear_triton.py --check --tokens 16        # CPU: correctness only
"""

from __future__ import annotations

import argparse
import datetime
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.models.llama import apply_rope, rms_norm

H, HQ, HKV, D, INTER, L = 576, 9, 3, 64, 1536, 30
G = HQ // HKV
EPS = 1e-5
QKV_ROWS = HKV * (G + 2) * D  # 960: [Hkv, G + 2, D] rows, as fuse_params' wqkv

CONFIGS = {
    "a": dict(qkv=dict(), o=dict(bn=16), gu=dict(bn=32), down=dict(bn=16)),
    "d": dict(qkv=dict(num_stages=4), o=dict(bn=16, num_stages=4), gu=dict(bn=16, num_stages=4),
              down=dict(bn=16, num_stages=4)),
    "f": dict(qkv=dict(num_stages=4), o=dict(bn=32, num_stages=4), gu=dict(bn=64, num_stages=4),
              down=dict(bn=32, num_stages=4)),
    "g": dict(qkv=dict(bk=32, num_stages=5, num_warps=2), o=dict(bn=16, bk=32, num_stages=5, num_warps=2),
              gu=dict(bn=16, bk=32, num_stages=5, num_warps=2), down=dict(bn=16, bk=32, num_stages=5, num_warps=2)),
}  # fmt: skip
"""Per GEMV: ``bn`` output columns a program (default 64, one head for QKV), ``bk`` K columns an
iteration (default 64), ``num_warps`` (4) and ``num_stages`` (3)."""


def xla_layer(h, rows, w_down, norms, cos, sin, cache, slots):
    """One layer as ``LlamaModel.step`` runs it, attention stood in for by q: h bf16[T, H]."""
    t = h.shape[0]
    x = rms_norm(h, norms[0], EPS)
    qkv = jnp.einsum("th,kgdh->tkgd", x, rows[:QKV_ROWS].reshape(HKV, G + 2, D, H))
    q = qkv[:, :, :G].reshape(t, HQ, D)
    k, v = qkv[:, :, G], qkv[:, :, G + 1]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = cache.at[:, slots].set(jnp.stack([k, v]))
    h = h + jnp.einsum("tq,hq->th", q.reshape(t, H), rows[QKV_ROWS + 2 * INTER :])
    x = rms_norm(h, norms[1], EPS)
    gu = jnp.einsum("th,gih->tgi", x, rows[QKV_ROWS : QKV_ROWS + 2 * INTER].reshape(2, INTER, H))
    return h + jnp.einsum("ti,hi->th", jax.nn.silu(gu[:, 0]) * gu[:, 1], w_down), cache


def _gemv_kernel(*refs, bk, bn, row0, n_pair, norm, rope, residual, silu_pair):
    """out[:, j*bn:(j+1)*bn] of x[T, K] @ w[row0 + ..., K]^T for program j, with the fusions on."""
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    g_ref = next(it) if norm else None
    cos_ref, sin_ref = (next(it), next(it)) if rope else (None, None)
    r_ref = next(it) if residual else None
    outs = list(it)
    j = pl.program_id(0)
    t, k = x_ref.shape
    chunks = k // bk
    if norm:

        def squares(c, ss):
            xc = x_ref[:, pl.ds(pl.multiple_of(c * bk, bk), bk)].astype(jnp.float32)
            return ss + jnp.sum(xc * xc, axis=1)

        rstd = jax.lax.rsqrt(jax.lax.fori_loop(0, chunks, squares, jnp.zeros((t,), jnp.float32)) / k + EPS)
    if rope:  # a head's two halves, rotated into each other after the sum
        starts, width = [row0 + j * bn, row0 + j * bn + bn // 2], bn // 2
    elif silu_pair:  # the gate's and the up projection's rows
        starts, width = [row0 + j * bn, row0 + n_pair + j * bn], bn
    else:
        starts, width = [row0 + j * bn], bn

    def body(c, accs):
        c0 = pl.multiple_of(c * bk, bk)
        xc = x_ref[:, pl.ds(c0, bk)]
        if norm:
            scaled = xc.astype(jnp.float32) * rstd[:, None] * g_ref[pl.ds(c0, bk)].astype(jnp.float32)[None, :]
            xc = scaled.astype(x_ref.dtype)
        dims = (((1,), (1,)), ((), ()))  # x [T, bk] . w [width, bk] over bk

        def dot(s):
            w = w_ref[pl.ds(s, width), pl.ds(c0, bk)]
            return jax.lax.dot_general(xc, w, dims, preferred_element_type=jnp.float32)

        return tuple(acc + dot(s) for acc, s in zip(accs, starts, strict=True))

    accs = jax.lax.fori_loop(0, chunks, body, tuple(jnp.zeros((t, width), jnp.float32) for _ in starts))
    if rope:
        lo, hi = accs
        cos, sin = cos_ref[:, pl.ds(0, width)], sin_ref[:, pl.ds(0, width)]
        slot, kv_head = j % (G + 2), j // (G + 2)
        is_v = slot == G + 1
        halves = (jnp.where(is_v, lo, lo * cos - hi * sin), jnp.where(is_v, hi, hi * cos + lo * sin))
        q_ref, kv_ref = outs

        def store(ref, col):
            for i, half in enumerate(halves):
                ref[:, pl.ds(col + i * width, width)] = half.astype(ref.dtype)

        pl.when(slot < G)(lambda: store(q_ref, (kv_head * G + slot) * D))
        pl.when(slot >= G)(lambda: store(kv_ref, ((slot - G) * HKV + kv_head) * D))
        return
    (o_ref,) = outs
    out = accs[0] * jax.nn.sigmoid(accs[0]) * accs[1] if silu_pair else accs[0]
    if residual:
        out = out + r_ref[:, pl.ds(j * bn, bn)].astype(jnp.float32)
    o_ref[:, pl.ds(j * bn, bn)] = out.astype(o_ref.dtype)


def gemv(x, w, *, n_out, row0=0, norm_w=None, rope=None, residual=None, silu_pair=False, bn=64, bk=64,
         num_warps=4, num_stages=3, interpret=False):  # fmt: skip
    """x bf16[T, K] @ rows [row0, row0 + n_out) of w [R, K], transposed: bf16[T, n_out]; with
    ``silu_pair``, SiLU of those rows' product times that of the next ``n_out`` rows' (gate, up);
    with ``rope`` (cos, sin bf16[T, D]; ``bn`` = D), QKV's q bf16[T, Hq*D] and k/v
    bf16[T, 2*Hkv*D] instead."""
    t, k = x.shape
    if k % bk or n_out % bn or (rope is not None and bn != D):
        raise ValueError(f"K={k} must be a multiple of bk={bk}, n_out={n_out} of bn={bn}; with rope bn={bn} == D={D}")
    args = [x, w, *([norm_w] if norm_w is not None else []), *(rope or ())]
    args += [residual] if residual is not None else []
    if rope is not None:
        out_shape = (jax.ShapeDtypeStruct((t, HQ * D), x.dtype), jax.ShapeDtypeStruct((t, 2 * HKV * D), x.dtype))
        grid = (QKV_ROWS // bn,)
    else:
        out_shape, grid = jax.ShapeDtypeStruct((t, n_out), x.dtype), (n_out // bn,)
    kernel = functools.partial(
        _gemv_kernel, bk=bk, bn=bn, row0=row0, n_pair=n_out, norm=norm_w is not None, rope=rope is not None,
        residual=residual is not None, silu_pair=silu_pair,
    )  # fmt: skip
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, compiler_params=params)(*args)


def fused_layer(h, rows, w_down, norms, cos, sin, cache, slots, *, config, interpret=False):
    """``xla_layer`` as four fused GEMVs (``config``: a ``CONFIGS`` entry)."""
    t = h.shape[0]
    q, kv = gemv(h, rows, n_out=QKV_ROWS, norm_w=norms[0], rope=(cos, sin), bn=D, interpret=interpret, **config["qkv"])
    cache = cache.at[:, slots].set(kv.reshape(t, 2, HKV, D).transpose(1, 0, 2, 3))
    h = gemv(q, rows, n_out=H, row0=QKV_ROWS + 2 * INTER, residual=h, interpret=interpret, **config["o"])
    a = gemv(h, rows, n_out=INTER, row0=QKV_ROWS, norm_w=norms[1], silu_pair=True, interpret=interpret, **config["gu"])
    return gemv(a, w_down, n_out=H, residual=h, interpret=interpret, **config["down"]), cache


def model(layer_fn, h, params, cos, sin, caches, slots):
    """``layer_fn`` over every layer: (h, the new caches)."""
    new = []
    for (rows, w_down, norms), cache in zip(params, caches, strict=True):
        h, cache = layer_fn(h, rows, w_down, norms, cos, sin, cache, slots)
        new.append(cache)
    return h, new


def make_inputs(tokens: int, seed: int = 0):
    """Random bf16 weights for ``L`` layers, hidden states, RoPE tables, caches and slots."""
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16
    params = [
        (jnp.asarray(rng.standard_normal((QKV_ROWS + 2 * INTER + H, H)) * 0.04, dtype),
         jnp.asarray(rng.standard_normal((H, INTER)) * 0.03, dtype),
         jnp.asarray(1 + 0.1 * rng.standard_normal((2, H)), dtype))
        for _ in range(L)
    ]  # fmt: skip
    h = jnp.asarray(rng.standard_normal((tokens, H)), dtype)
    freqs = (np.arange(tokens) + 100.0)[:, None] / 10000 ** (np.arange(0, D, 2) / D)[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    caches = [jnp.zeros((2, 4096, HKV, D), dtype) for _ in range(L)]
    slots = jnp.arange(tokens, dtype=jnp.int32) * 3 + 7
    return h, params, jnp.asarray(np.cos(emb), dtype), jnp.asarray(np.sin(emb), dtype), caches, slots


def rel_err(got, want) -> float:
    got, want = (jnp.asarray(a, jnp.float32) for a in (got, want))
    return float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-6))


def run(args) -> dict:
    interpret = jax.default_backend() == "cpu"
    rows = []
    for tokens in args.tokens:
        inputs = make_inputs(tokens)
        h, params, cos, sin, caches, slots = inputs
        want = jax.jit(xla_layer)(h, *params[0], cos, sin, caches[0], slots)
        for name in args.configs:
            layer = functools.partial(fused_layer, config=CONFIGS[name], interpret=interpret)
            got = jax.jit(layer)(h, *params[0], cos, sin, caches[0], slots)
            errs = rel_err(got[0], want[0]), rel_err(got[1], want[1])
            print(f"{tokens} tokens, config {name}: relative error h {errs[0]:.2e}, cache {errs[1]:.2e}", flush=True)
            rows.append(dict(tokens=tokens, arm=f"fused_{name}", rel_err_h=errs[0], rel_err_cache=errs[1]))
        if args.check:
            continue
        from cupti_timing import summarize, trace_calls  # benchmarks/, the script's folder

        arms = {"xla": xla_layer} | {
            f"fused_{n}": functools.partial(fused_layer, config=CONFIGS[n]) for n in args.configs
        }
        calls = {arm: functools.partial(jax.jit(functools.partial(model, fn)), *inputs) for arm, fn in arms.items()}
        for arm, groups in trace_calls(calls, n=30).items():
            summary = summarize(groups)
            spans = [max(e.start_ns + e.duration_ns for e in g) - min(e.start_ns for e in g) for g in groups]
            median_call = groups[sorted(range(len(groups)), key=spans.__getitem__)[len(groups) // 2]]
            per_name = {}
            for event in median_call:
                per_name.setdefault(event.name[:40], []).append(event.duration_ns / 1e3)
            top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:8]
            row = dict(tokens=tokens, arm=arm, span_us=summary["median_us"], kernels=summary["events_per_call"],
                       kernel_sum_us=summary["median_kernel_sum_us"],
                       by_kernel={n: [len(v), round(sum(v) / len(v), 2)] for n, v in top})  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return dict(
        benchmark="fused_linear_triton", device=jax.devices()[0].device_kind, jax=jax.__version__,
        date=datetime.date.today().isoformat(), layers=L, rows=rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64], help="tokens per step")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--check", action="store_true", help="the layers' errors only (no timing)")
    add_output_args(parser, "fused_linear_triton.json")
    args = parser.parse_args()
    write_json(output_path(args), run(args))


if __name__ == "__main__":
    main()
