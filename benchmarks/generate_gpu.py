"""Engine throughput on a GPU (or any jax device): tokens/s at batch 1, 8 and 64, host time
per engine step, compilations after warm-up.

Needs only jax and numpy (and attn-stack's own package). The model is SmolLM2-135M's
architecture; with ``--gguf PATH`` (and the ``gguf`` package importable) its real
weights, otherwise random weights of the same shapes: throughput does not depend on the
values, since every request generates exactly ``--new-tokens`` tokens (EOS ignored) from
fixed random prompt token ids. Each batch size: one warm-up run of the workload (it
compiles every shape bucket), then one measured run.

    python benchmarks/generate_gpu.py --out benchmarks/results/generate_gpu.json
    python benchmarks/generate_gpu.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --batch 1 8 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.models.llama import LlamaModel, init_params
from attn_jax.models.smollm2 import smollm2_135m_config
from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import Engine, SamplingParams

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "generate_gpu.json"


def load(gguf: str | None, dtype):
    if gguf is None:
        config = smollm2_135m_config()
        return config, init_params(config, seed=0, dtype=np.float32), "random weights, SmolLM2-135M shapes"
    from attn_jax.models.gguf_loader import load_gguf

    config, params = load_gguf(gguf)
    return config, params, f"GGUF {pathlib.Path(gguf).name}"


def cast(params, dtype):
    return jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)


def run_batch(config, params, batch: int, args, backend) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, config.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
    model = LlamaModel(config, block_size=args.block_size, attn_backend=backend, dtype=args.dtype)
    engine = Engine(
        model, params, max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.new_tokens, kv_cache_bytes=args.kv_cache_gib << 30,
    )  # fmt: skip
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(prompts, sp)
    warmup = time.perf_counter() - t
    compiles, first = engine.num_compilations, len(engine.stats)
    t = time.perf_counter()
    results = engine.generate(prompts, sp)
    wall = time.perf_counter() - t
    stats = engine.stats[first:]
    decode = [s for s in stats if not s.num_prefill_tokens]
    tokens = sum(len(r.output_ids) for r in results)
    return {
        "batch": batch,
        "backend": model.attn_backend.get_name(),
        "generated_tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode) / sum(s.seconds for s in decode),
        "steps": len(stats),
        "host_ms_per_step_mean": 1e3 * float(np.mean([s.host_seconds for s in stats])),
        "host_ms_per_step_median": 1e3 * float(np.median([s.host_seconds for s in stats])),
        "step_ms_median": 1e3 * float(np.median([s.seconds for s in stats])),
        "decode_step_ms_median": 1e3 * float(np.median([s.seconds for s in decode])),
        "warmup_seconds": warmup,
        "compilations_in_warmup": compiles,
        "compilations_after_warmup": engine.num_compilations - compiles,
        "num_blocks": engine.num_blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF for real weights (needs the gguf package)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default=None, help="force a backend (XLA, PALLAS_GPU); default: selected")
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    args.dtype = jnp.dtype(args.dtype)

    device = jax.devices()[0]
    config, params, weights = load(args.gguf, args.dtype)
    params = cast(params, args.dtype)
    backend = None if args.backend is None else AttentionBackendEnum[args.backend].get_class()
    runs = []
    for batch in args.batch:
        r = run_batch(config, params, batch, args, backend)
        runs.append(r)
        print(
            f"batch {batch:3d} [{r['backend']}]: {r['tokens_per_s']:9.1f} tokens/s "
            f"(decode {r['decode_tokens_per_s']:9.1f}), host {r['host_ms_per_step_median']:.3f} ms/step, "
            f"step {r['step_ms_median']:.2f} ms, {r['compilations_after_warmup']} compilations after warm-up",
            flush=True,
        )
    result = {
        "workload": {
            "model": config.name,
            "weights": weights,
            "dtype": str(args.dtype),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "greedy": True,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },  # fmt: skip
        "machine": {
            "device": device.device_kind,
            "platform": device.platform,
            "num_devices": jax.device_count(),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },  # fmt: skip
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
