"""Bridge overhead: per-crossing cost of to_jax / to_torch, and attn_torch's decode step vs the JAX layer's.

1. Crossing: microseconds per ``bridge.dlpack.to_jax(tensor)`` and ``to_torch(array)``
   (median of timeit repeats), next to plain ``jax.dlpack.from_dlpack`` / ``torch.from_dlpack``.
   Zero-copy, so the cost does not depend on the size; a [64, 4096] bf16 tensor is used.
2. Decode step, one layer, same backend (the selector's choice): ``attn_torch.Attention``
   (torch KV write + zero-copy crossings + the jitted backend step) against
   ``jax.jit(attn_jax.Attention.__call__, donate_argnums=3)`` on the same batch.
   Target: torch <= 1.1 * jax + 50 us. Both include a device sync per step.
3. Bytes moved per decode step and layer: the new k/v written into the cache, the output,
   and what the compiled step allocates (XLA memory analysis), against the cache size
   (a functional update without donation would copy all of it).

Decode workload: CPU 8 requests x 1 new token on 127 cached, Hq=8, Hkv=2, D=64, f32, block 16;
CUDA: 64 x 1 on 4095 cached, Hq=32, Hkv=8, D=128, bf16 (DESIGN.md's D1).

Run: .venv/bin/python benchmarks/bridge_overhead.py [--device cpu|cuda] [--write | --out PATH]
Prints the results; ``--write`` writes benchmarks/results/bridge_overhead_<device>.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import timeit

# isort: off
import bridge  # noqa: F401  (first: sets JAX's GPU memory policy before JAX initialises)

# isort: on
import jax
import jax.numpy as jnp
import numpy as np
import torch
from results_io import add_output_args, output_path  # benchmarks/, the script's folder
from torch_run_record import run_environment, write_result

import attn_jax
import attn_torch
from attn_torch import bind_kv_cache, build_common_attn_metadata, set_forward_context
from bridge.dlpack import jax_device_for, to_jax, to_torch

WORKLOADS = {
    "cpu": dict(num_reqs=8, context=127, num_q_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32),
    "cuda": dict(num_reqs=64, context=4095, num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16),
}
BLOCK_SIZE = 16
NUMBER, REPEATS = 20, 21  # decode steps per timed repeat, repeats (median)


def median_us(fn, number: int, repeat: int) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def crossing(device: torch.device) -> dict:
    t = torch.randn(64, 4096, device=device).to(torch.bfloat16)
    a = to_jax(t)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, number: int = 2000) -> float:
        """Median us per call; the device is synchronised once per repeat, not per call."""

        def run():
            for _ in range(number):
                fn()
            sync()

        return median_us(run, number=1, repeat=15) / number

    # Where to_jax's time goes, without the bridge's checks: the producer's capsule and
    # jaxlib's import. On CUDA, torch's own __dlpack__(stream=...) (the route of
    # jax.dlpack.from_dlpack) against the bridge's: a cached stream wrapper and a reused
    # event, then torch's legacy capsule, which does no stream sync of its own.
    from jax._src.lib import _jax
    from torch.utils import dlpack as torch_dlpack

    from bridge.dlpack import _jax_stream_after_torch

    jdev = jax_device_for(device)
    breakdown = {"us_legacy_capsule_only": timed(lambda: torch_dlpack.to_dlpack(t))}
    if device.type == "cuda":
        stream = jdev.get_stream_for_external_ready_events()
        breakdown |= {
            "us_torch_dunder_dlpack_with_stream_sync": timed(lambda: t.__dlpack__(stream=stream)),
            "us_bridge_stream_sync_only": timed(lambda: _jax_stream_after_torch(device, jdev)),
            "us_jaxlib_import_of_legacy_capsule": timed(
                lambda: _jax.dlpack_managed_tensor_to_buffer(torch_dlpack.to_dlpack(t), jdev, stream, False, 2)
            ),
            "us_stream_sync_and_jaxlib_import": timed(
                lambda: _jax.dlpack_managed_tensor_to_buffer(
                    torch_dlpack.to_dlpack(t), jdev, _jax_stream_after_torch(device, jdev), False, 2
                )
            ),
        }
    else:
        breakdown["us_jaxlib_import_of_legacy_capsule"] = timed(
            lambda: _jax.dlpack_managed_tensor_to_buffer(torch_dlpack.to_dlpack(t), jdev, None, False, 1)
        )
    return {
        "tensor": "bf16[64, 4096]",
        "us_to_jax": timed(lambda: to_jax(t)),
        "us_to_torch": timed(lambda: to_torch(a)),
        "us_jax_dlpack_from_dlpack": timed(lambda: jax.dlpack.from_dlpack(t)),
        "us_torch_from_dlpack": timed(lambda: torch.from_dlpack(a)),
        "breakdown": breakdown,
        "zero_copy": to_jax(t).unsafe_buffer_pointer() == t.data_ptr()
        and to_torch(a).data_ptr() == a.unsafe_buffer_pointer(),
    }


def decode_step(device: torch.device) -> dict:
    w = WORKLOADS[device.type]
    hq, hkv, d, dtype, n = w["num_q_heads"], w["num_kv_heads"], w["head_size"], w["dtype"], w["num_reqs"]
    pages = -(-(w["context"] + 1) // BLOCK_SIZE)
    num_blocks = n * pages + 1
    block_table = np.arange(n * pages, dtype=np.int32).reshape(n, pages)
    md = build_common_attn_metadata([1] * n, [w["context"] + 1] * n, block_table, BLOCK_SIZE)
    T = md.num_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(T, hq * d, device=device, generator=gen).to(dtype)
    k = torch.randn(T, hkv * d, device=device, generator=gen).to(dtype)
    v = torch.randn(T, hkv * d, device=device, generator=gen).to(dtype)

    layer = attn_torch.Attention(hq, d, d**-0.5, hkv, prefix="bench.torch", block_size=BLOCK_SIZE, dtype=dtype)
    cache = layer.init_kv_cache(num_blocks, device=device).normal_()
    bind_kv_cache({layer.layer_name: cache})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def torch_step():
        layer(q, k, v)
        sync()

    jax_layer = attn_jax.Attention(
        hq, d, d**-0.5, hkv, block_size=BLOCK_SIZE, dtype=jnp.dtype(to_jax(torch.zeros(1, dtype=dtype)).dtype)
    )
    assert jax_layer.attn_backend is layer.attn_backend
    jdev = jax_device_for(device)
    jcache = jax.device_put(jnp.asarray(np.asarray(to_jax(cache.cpu()))), jdev)
    jq, jk, jv = (jax.device_put(to_jax(x.cpu()), jdev) for x in (q, k, v))
    jmd = jax.device_put(md, jdev)
    jstep = jax.jit(jax_layer.__call__, donate_argnums=3)
    state = {"cache": jcache}

    def jax_step():
        out, state["cache"] = jstep(jq, jk, jv, state["cache"], jmd)
        out.block_until_ready()

    with torch.inference_mode(), set_forward_context(md) as ctx:

        def torch_step_with_context():
            with set_forward_context(md):
                torch_step()

        # Interleaved repeats, so load drift on a shared machine hits both sides alike.
        times = {"torch": [], "jax": [], "torch_fresh_context": []}
        fns = {"torch": torch_step, "jax": jax_step, "torch_fresh_context": torch_step_with_context}
        for fn in fns.values():
            fn()
        for _ in range(REPEATS):
            for name, fn in fns.items():
                times[name].append(timeit.timeit(fn, number=NUMBER) / NUMBER * 1e6)
        us_torch, us_jax, us_torch_fresh_context = (statistics.median(times[n]) for n in fns)
        prepared = ctx.prepare(layer.layer_name, layer._jax.metadata_builder, device)
        compiled = layer._step.lower(
            to_jax(q.view(T, hq, d)), to_jax(cache), prepared.backend_metadata, layer._jax.k_scale, layer._jax.v_scale
        ).compile()
        stats = compiled.memory_analysis()

    itemsize = torch.tensor([], dtype=dtype).element_size()
    cache_itemsize = cache.element_size()
    new_kv = 2 * n * hkv * d * cache_itemsize
    output = T * hq * d * itemsize
    return {
        "workload": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in w.items()}
        | {"block_size": BLOCK_SIZE, "padded_tokens": T, "backend": layer.attn_backend.get_name()},
        "us_attn_torch_step": us_torch,
        "us_attn_torch_step_with_fresh_forward_context": us_torch_fresh_context,
        "us_jax_layer_step": us_jax,
        "target_us": 1.1 * us_jax + 50,
        "within_target": us_torch <= 1.1 * us_jax + 50,
        "bytes_per_step_per_layer": {
            "new_kv_written": new_kv,
            "output": output,
            "budget_new_kv_plus_output": new_kv + output,
            "compiled_step_output": stats.output_size_in_bytes,
            "compiled_step_temp": stats.temp_size_in_bytes,
            "kv_cache": cache.numel() * cache_itemsize,
            "note": "attn_torch writes new k/v in place (torch index_copy_) and the step reads the cache through a "
            "zero-copy view; its only output buffer is the attention output. temp is the backend's own working "
            "memory (the XLA reference gathers pages per chunk of rows).",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    add_output_args(parser, "bridge_overhead_{device}.json")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    result = {
        "benchmark": "bridge_overhead",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "crossing": crossing(device),
        "decode_step": decode_step(device),
        **run_environment(),
    }
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
