"""One workload's attention call, repeated a few times, for a kernel profiler to pick out.

Nsight Compute (``ncu``) profiles one launch of a kernel it selects by name; this script makes
the calls it picks from and nothing else heavy (no ceilings, no sweeps, no CUPTI), so that the
profiled launch is the same call ``benchmarks/attention.py`` times:

- ``pallas_gpu``: the PALLAS_GPU backend's op on the workload (``attention.pallas_gpu_fn``,
  the device's tuned block sizes; P1 runs on the Mosaic GPU prefill kernel
  ``ragged_paged_prefill_mgpu``);
- ``fa3_dense``: FlashAttention-3's ``flash_mha`` on the same batch's keys and values made
  dense (P1: four requests of one length), the call ``attention.fa3_configs`` builds;
- ``fp8_layer`` / ``bf16_layer``: one step of ``Attention`` with FP8 attention
  (``kv_cache_dtype="fp8", query_quant=True``) or bf16, as ``attention_fp8.py`` builds it;
- ``mla_decode``: the Mosaic GPU MLA decode on MLA-D1 (``mla_decode_mgpu``), as
  ``mla_attention.py`` builds it.

``benchmarks/profile_kernels.sh`` runs each under ``ncu --launch-skip 1 --launch-count 1`` (the
second call's launch: compiled and warm). Every call is checked for finite output.

    python benchmarks/ncu_one_call.py --impl pallas_gpu --workload P1 --calls 2
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

IMPLS = ("pallas_gpu", "fa3_dense", "fp8_layer", "bf16_layer", "mla_decode")


def attention_call(impl: str, workload: str):
    """(fn, args) for ``pallas_gpu`` / ``fa3_dense`` on ``attention.py``'s device batch."""
    import attention
    import fa3_peer

    from attn_jax.testing.workloads import WORKLOADS

    b = attention.make_device_batch(WORKLOADS[workload])
    if impl == "pallas_gpu":
        fn = attention.pallas_gpu_fn(b, None)
        return fn, (b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.slot_mapping)
    fa3, _ = fa3_peer.import_fa3()
    configs, _ = attention.fa3_configs(fa3, b, pages=[], splits=[1])  # the dense calls attention.py times
    dense = [c for c in configs if c.impl == "fa3_dense"]
    if not dense:
        raise SystemExit(f"fa3_dense needs a prefill of equal lengths, not {workload}")
    return dense[0].fn, dense[0].args


def layer_call(impl: str):
    """(fn, args) for one P1 step of the FP8 or bf16 ``Attention`` layer, as ``attention_fp8.py``
    builds and calls it (metadata from ``layer.prepare``, the cache donated)."""
    import attention_fp8

    from attn_jax import Attention
    from attn_jax.registry import AttentionBackendEnum

    H, Hkv, D = 32, 8, 128
    q, k, v, md, num_blocks = attention_fp8.make_inputs([4096] * 4, num_q_heads=H, num_kv_heads=Hkv, head_size=D,
                                                        block_size=16)  # fmt: skip
    layer = Attention(H, D, D**-0.5, Hkv, block_size=16, dtype=jnp.bfloat16,
                      attn_backend=AttentionBackendEnum.PALLAS_GPU,
                      **attention_fp8.LAYERS["fp8_attention" if impl == "fp8_layer" else "bf16"])  # fmt: skip
    if layer.kv_cache_dtype != "auto":
        layer.calc_kv_scales(q, k, v)
    attn_md = layer.prepare(md)
    step = jax.jit(layer.__call__, donate_argnums=3)
    state = {"cache": layer.init_kv_cache(num_blocks)}
    T = q.shape[0]

    def fn(q, k, v):
        out, state["cache"] = step(q, k, v, state["cache"], attn_md)
        return out

    return fn, (q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))


def mla_call():
    """(fn, args) for the Mosaic GPU MLA decode on MLA-D1, as ``mla_attention.py`` calls it."""
    import functools

    import mla_attention

    from attn_jax.ops.mla import decode_pallas_mosaic_gpu
    from attn_jax.testing.mla import MLA_WORKLOADS

    spec = MLA_WORKLOADS["MLA-D1"]
    fn = functools.partial(decode_pallas_mosaic_gpu.mla_decode, sm_scale=192**-0.5, kv_lora_rank=spec.kv_lora_rank)
    return jax.jit(fn), mla_attention.make_batch(spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--workload", default="P1", help="attention.py's workload for pallas_gpu / fa3_dense")
    p.add_argument("--calls", type=int, default=2, help="calls made, each waited for (default 2)")
    args = p.parse_args(argv)
    if args.impl in ("pallas_gpu", "fa3_dense"):
        fn, fn_args = attention_call(args.impl, args.workload)
    elif args.impl == "mla_decode":
        fn, fn_args = mla_call()
    else:
        fn, fn_args = layer_call(args.impl)
    for i in range(args.calls):
        out = jax.block_until_ready(fn(*fn_args))
        finite = bool(jnp.isfinite(jnp.asarray(out, jnp.float32)).all())
        print(f"{args.impl} call {i}: out {tuple(out.shape)} {out.dtype}, finite {finite}", flush=True)
        if not finite:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
