"""Where a step program's compile time goes: tracing, lowering and XLA, program by program.

Builds the engine ``attn-stack serve`` builds on an accelerator (256 slots, 2048-token steps,
2048-token context, 8 steps per call; a model shape of random weights), lists the programs its
warm-up would compile (``warmup.candidate_calls``) and compiles a chosen few of them one after
another on one thread, in the order given, timing each phase. The order answers whether a
program compiles faster after another of the same token bucket (XLA's autotuning results and
kernels are cached per fusion inside the process, and in JAX's compilation cache folder).

``--programs`` names programs as ``BUCKET:STEPS:SAMPLING:VARIANT`` (SAMPLING ``greedy`` or
``sampled``; the variants of one bucket numbered in the warm-up's order, listed at the start). ``--xla-caches`` sets
``jax_persistent_cache_enable_xla_caches`` (``all`` adds XLA's kernel cache file to the
per-fusion autotuning cache JAX enables by default). Each run starts from an empty cache
folder::

    python benchmarks/compile_breakdown.py --programs 16:1:greedy:0 16:1:sampled:0 --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time

import jax
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.models.llama import LlamaModel
from attn_jax.serving import Engine
from attn_jax.serving.warmup import candidate_calls
from attn_jax.testing.models import MODEL_SHAPES, random_params


def _names(calls: dict) -> dict[str, object]:
    """``{name: PreparedCall}`` in the warm-up's order: ``BUCKET:STEPS:SAMPLING:VARIANT``, the
    variants of one (bucket, steps, sampling) numbered in that order (decode batches first, then
    prefills, cascade after each; ``PreparedCall.describe`` says which is which)."""
    out: dict[str, object] = {}
    for _, prepared in sorted(calls.values(), key=lambda x: x[0]):
        sampling = "sampled" if prepared.sampled else "greedy"
        stem = f"{prepared.token_bucket}:{prepared.num_steps}:{sampling}"
        variant = sum(name.startswith(stem + ":") for name in out)
        out[f"{stem}:{variant}"] = prepared
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--limits", default="256x2048", help="SEQSxTOKENS")
    parser.add_argument("--programs", nargs="+", required=True, help="BUCKET:STEPS:SAMPLING:VARIANT, compiled in order")
    parser.add_argument("--xla-caches", default=None, help="jax_persistent_cache_enable_xla_caches (default: JAX's)")
    add_output_args(parser, "compile_breakdown_{model}.json")
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="jax-cache-")
    jax.config.update("jax_compilation_cache_dir", cache)
    if args.xla_caches is not None:
        jax.config.update("jax_persistent_cache_enable_xla_caches", args.xla_caches)
    seqs, tokens = (int(x) for x in args.limits.lower().split("x"))
    config = MODEL_SHAPES[args.model]()
    dtype = jax.numpy.bfloat16
    engine = Engine(
        LlamaModel(config, block_size=16, dtype=dtype), random_params(config, dtype), max_num_seqs=seqs,
        max_num_batched_tokens=tokens, max_model_len=2048, num_scheduler_steps=8,
    )  # fmt: skip
    start = time.perf_counter()
    calls, _ = candidate_calls(engine)
    by_name = _names(calls)
    print(f"{len(calls)} programs listed in {time.perf_counter() - start:.1f} s", flush=True)
    for name, prepared in by_name.items():
        print(f"  {name}: {prepared.describe()[:160]}", flush=True)
    unknown = [p for p in args.programs if p not in by_name]
    if unknown:
        raise SystemExit(f"--programs {unknown} are not among this engine's programs: {sorted(by_name)}")
    runner = engine.runner
    rows = []
    result = {
        "model": args.model, "limits": args.limits, "xla_caches": jax.config.jax_persistent_cache_enable_xla_caches,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "programs": rows,
    }  # fmt: skip
    for name in args.programs:
        step_args = runner._step_args(by_name[name])
        t0 = time.perf_counter()
        traced = runner.jit_for(by_name[name]).trace(*step_args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        row = {"program": name, "trace_s": t1 - t0, "lower_s": t2 - t1, "xla_s": t3 - t2}
        rows.append(row)
        print(row, flush=True)
        write_json(output_path(args), result)  # after each program: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
