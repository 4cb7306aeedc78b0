"""Serving over several devices: tokens/s of one device, tensor parallel (model axis) and
data parallel (data axis), with the communication time from a profile.

The 8-layer Llama-3-8B shape (``--model``) on random weights, ``--prompt-len`` prompts and
``--new-tokens`` greedy tokens (EOS ignored), through the public serving API
(``make_mesh`` + ``Engine(mesh=...)``). For each mesh that fits the devices present:

- tokens/s and the decode step at each batch and each ``--num-scheduler-steps`` value
  (``generate_gpu.run_engine``);
- a CUPTI trace of decode steps at the first batch with the last steps value
  (``engine_step_profile``): kernel time per category per device, collectives included,
  and the launch gaps;
- with ``--check-tokens``, the greedy tokens of each mesh against one device's in float32
  (the last steps value).

    python benchmarks/scale_out.py --num-scheduler-steps 1 8 --check-tokens --write   # 2 GPUs: 1 GPU, TP=2, DP=2
    python benchmarks/scale_out.py --model llama3-70b-8l --meshes 1x1 1x4 4x1 2x2 --batch 1 16 64 256
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/scale_out.py \\
        --model smollm2-135m --batch 1 --new-tokens 4 --prompt-len 8 --dtype float32

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform

import jax
import jax.numpy as jnp
import numpy as np
from engine_args import add_engine_args, parse_engine_args  # benchmarks/, the script's folder
from engine_step_profile import profile_batch  # benchmarks/, the script's folder
from generate_gpu import run_engine
from results_io import add_output_args, output_path, write_json

from attn_jax.serving import Engine, SamplingParams
from attn_jax.sharding import local_model_kwargs, make_mesh
from attn_jax.testing.models import MODEL_SHAPES, random_params


def mesh_name(data: int, model: int) -> str:
    parts = [f"DP={data}"] * (data > 1) + [f"TP={model}"] * (model > 1)
    return " x ".join(parts) or "1 device"


def default_meshes(num_devices: int) -> list[tuple[int, int]]:
    """(data, model) pairs: one device, then all devices as TP, as DP and, when they split
    further, as DP=2 x TP=n/2."""
    meshes = [(1, 1)]
    if num_devices > 1:
        meshes += [(1, num_devices), (num_devices, 1)]
    if num_devices >= 4 and num_devices % 2 == 0:
        meshes.append((2, num_devices // 2))
    return meshes


def _mesh_arg(text: str) -> tuple[int, int]:
    data, model = text.lower().split("x")
    return int(data), int(model)


def greedy_tokens(config, params, mesh, args) -> list[list[int]]:
    """Greedy tokens of a few prompts in float32 on ``mesh`` (None: one device), with the
    last ``--num-scheduler-steps``."""
    from attn_jax.models.llama import LlamaModel

    local = {} if mesh is None else local_model_kwargs(config, mesh)
    model = LlamaModel(config, block_size=args.block_size, dtype=jnp.float32, **local)
    engine = Engine(
        model, params, mesh=mesh, max_num_seqs=4, max_model_len=args.prompt_len + 32,
        num_scheduler_steps=args.num_scheduler_steps[-1],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, args.prompt_len).tolist() for _ in range(4)]
    return [c.output_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b-8l", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="decode steps traced per mesh (0: no profile)")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--check-tokens", action="store_true", help="float32 greedy tokens of each mesh vs one device")
    parser.add_argument(
        "--meshes", type=_mesh_arg, nargs="+", default=None, metavar="DATAxMODEL",
        help="meshes to run (default: one device, TP=n, DP=n and DP=2 x TP=n/2 over the devices present)",
    )  # fmt: skip
    add_engine_args(parser, prompt_len=256, kv_cache_gib=8)
    add_output_args(parser, "scale_out.json")
    args = parse_engine_args(parser)

    config = MODEL_SHAPES[args.model]()
    params = random_params(config, args.dtype)
    backend = args.attn_backend
    results, single_tokens = [], None
    for data, model_axis in args.meshes or default_meshes(jax.device_count()):
        name = mesh_name(data, model_axis)
        if data * model_axis > jax.device_count():
            print(f"{name}: skipped ({jax.device_count()} device(s))")
            continue
        mesh = None if data * model_axis == 1 else make_mesh(data * model_axis, model_parallel=model_axis)
        entry = {"mesh": name, "data": data, "model": model_axis, "runs": []}
        for batch, k in itertools.product(args.batch, args.num_scheduler_steps):
            r = run_engine(config, params, batch, args, backend, mesh=mesh, num_scheduler_steps=k)
            entry["runs"].append(r)
            print(
                f"{name} batch {batch:3d}, {k} steps/call: {r['tokens_per_s']:9.1f} tokens/s, decode step "
                f"{r['decode_step_ms_median']:.3f} ms, host {r['host_ms_per_step_median']:.3f} ms",
                flush=True,
            )
        if args.steps:
            k = args.num_scheduler_steps[-1]
            profile = profile_batch(config, params, args.batch[0], args, backend, mesh=mesh, num_scheduler_steps=k)
            entry["profile"] = profile
            per_step = profile["device"].get("per_step_us", {})
            print(f"{name} batch {args.batch[0]} profile (us per step and device): {per_step}", flush=True)
        if args.check_tokens:
            f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
            tokens = greedy_tokens(config, f32, mesh, args)
            single_tokens = tokens if mesh is None else single_tokens
            if single_tokens is not None:
                pairs = zip(np.concatenate(tokens), np.concatenate(single_tokens), strict=True)
                same = np.mean([a == b for a, b in pairs])
                entry["float32_token_agreement_with_one_device"] = float(same)
                print(f"{name}: float32 greedy tokens equal one device's: {100 * same:.1f} %", flush=True)
        results.append(entry)
        write_json(  # after each mesh, so a run cut short keeps the meshes it finished
            output_path(args),
            {
                "workload": {
                    "model": args.model, "weights": "random", "dtype": str(args.dtype),
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                },
                "machine": {
                    "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
                    "jax": jax.__version__, "python": platform.python_version(),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                },
                "meshes": results,
            },
        )  # fmt: skip


if __name__ == "__main__":
    main()
