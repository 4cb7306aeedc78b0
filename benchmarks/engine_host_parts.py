"""Where a one-step engine call's host time goes: the main thread's CPU seconds in each part.

For each batch size: an engine (random weights of ``--model``'s shape, one step a call unless
``--num-scheduler-steps`` says otherwise) generates ``--new-tokens`` tokens for each of
``batch`` prompts once to compile, then ``--repeats`` measured times (its startup heap frozen, as
``attn-stack serve``'s engine process runs). Each ``Engine.step_runs`` call of a steady decode
(one the runner continued on the device, ``ModelRunner.continue_decode``) is split into the
thread CPU seconds (``time.thread_time``: a wait for the device uses none) of the scheduler's
``schedule``, the engine's ``_decode_steps``, ``continue_decode``, the jitted call's dispatch
(``ModelRunner.dispatch``), ``_account``, ``_resolve`` (with the tokens' read-back) and the read
alone, with the medians of each over the run, and the dispatch with and without a page delta
(a continued call whose requests gained a page uploads one). The parts are patched into the
classes in this process; nothing else changes.

    python benchmarks/engine_host_parts.py --batch 1 64 256 --repeats 3 --out /tmp/parts.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time

import jax
import numpy as np
from engine_args import add_engine_args, parse_engine_args  # benchmarks/, the script's folder
from generate_gpu import prompts_for  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.models.llama import LlamaModel
from attn_jax.server.gc_heap import freeze_startup_heap
from attn_jax.serving import Engine, SamplingParams, model_runner, scheduler
from attn_jax.serving import engine as engine_module
from attn_jax.testing.models import MODEL_SHAPES, random_params

PARTS = ("schedule", "_decode_steps", "continue_decode", "dispatch", "_account", "_resolve", "read_tokens")
"""The parts timed, each a method of ``Scheduler``, ``Engine`` or ``ModelRunner`` of that name."""


def patch_parts(call: dict, set_attr=setattr) -> None:
    """Wraps each of ``PARTS`` so that it adds its thread CPU seconds to ``call[name]``, and the
    dispatch also records its wall seconds and whether the call uploaded a page delta
    (``set_attr``: how the wrappers are set on the classes, e.g. pytest's ``monkeypatch.setattr``)."""
    owners = {"schedule": scheduler.Scheduler, "_decode_steps": engine_module.Engine,
              "continue_decode": model_runner.ModelRunner, "_account": engine_module.Engine,
              "_resolve": engine_module.Engine}  # fmt: skip

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                call[name] = call.get(name, 0.0) + time.thread_time() - start

        return wrapper

    for name, owner in owners.items():
        set_attr(owner, name, timed(name, getattr(owner, name)))
    dispatch = model_runner.ModelRunner.dispatch

    def timed_dispatch(self, prepared):
        start, wall = time.thread_time(), time.perf_counter()
        out = dispatch(self, prepared)
        call["dispatch"] = time.thread_time() - start
        call["dispatch_wall"] = time.perf_counter() - wall
        call["page_delta"] = prepared.page_delta is not None
        return out

    set_attr(model_runner.ModelRunner, "dispatch", timed_dispatch)
    set_attr(
        model_runner.ModelRunner,
        "read_tokens",
        staticmethod(timed("read_tokens", model_runner.ModelRunner.read_tokens)),
    )


def median_ms(values) -> float | None:
    return 1e3 * float(np.median(values)) if len(values) else None


def run_batch(config, params, batch: int, num_steps: int, args, call: dict) -> dict:
    """One engine's measured runs at ``batch`` (``call``: the dict ``patch_parts`` fills)."""
    model = LlamaModel(config, block_size=args.block_size, attn_backend=args.attn_backend, dtype=args.dtype)
    engine = Engine(
        model, params, max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=args.prompt_len + args.new_tokens,
        kv_cache_bytes=args.kv_cache_gib << 30, num_scheduler_steps=num_steps,
        enable_prefix_caching=not args.no_prefix_caching,
    )  # fmt: skip
    prompts = prompts_for(config, batch, args.prompt_len)  # generate_gpu.py's
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, sp)
    warmup = time.perf_counter() - start
    freeze_startup_heap()
    calls, step_runs = [], engine.step_runs

    def timed_step_runs():
        call.clear()
        start, wall = time.thread_time(), time.perf_counter()
        runs = step_runs()
        call["total"], call["wall"] = time.thread_time() - start, time.perf_counter() - wall
        calls.append(dict(call))
        return runs

    engine.step_runs = timed_step_runs
    runs = []
    for _ in range(args.repeats):
        engine.reset_prefix_cache()  # each run computes its prompts again
        calls.clear()
        first = len(engine.stats)
        engine.generate(prompts, sp)
        decode = [s for s in engine.stats[first:] if not s.num_prefill_tokens]
        steady = [c for c in calls if "continue_decode" in c and "dispatch" in c]  # continued: no prepare
        delta = [c for c in steady if c["page_delta"]]
        runs.append({
            "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode) / sum(s.seconds for s in decode),
            "decode_step_ms": median_ms([s.seconds / s.num_steps for s in decode]),
            "steady_calls": len(steady),
            "calls_with_page_delta": len(delta),
            "total_cpu_ms": median_ms([c["total"] for c in steady]),
            "total_wall_ms": median_ms([c["wall"] for c in steady]),
            **{f"{p}_cpu_ms": median_ms([c.get(p, 0.0) for c in steady]) for p in PARTS},
            "dispatch_wall_ms": median_ms([c["dispatch_wall"] for c in steady]),
            "dispatch_cpu_ms_with_page_delta": median_ms([c["dispatch"] for c in delta]),
            "dispatch_cpu_ms_without": median_ms([c["dispatch"] for c in steady if not c["page_delta"]]),
        })  # fmt: skip
    del engine.step_runs
    gc.unfreeze()
    return {"batch": batch, "num_scheduler_steps": num_steps, "warmup_seconds": warmup, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per batch, on one engine")
    add_engine_args(parser, prompt_len=128, kv_cache_gib=4)
    add_output_args(parser, "engine_host_parts.json")
    args = parse_engine_args(parser)
    config = MODEL_SHAPES[args.model]()
    params = random_params(config, args.dtype)
    call: dict = {}
    patch_parts(call)
    rows = []
    for batch in args.batch:
        for steps in args.num_scheduler_steps:
            row = run_batch(config, params, batch, steps, args, call)
            rows.append(row)
            for i, r in enumerate(row["runs"]):
                parts = ", ".join(f"{p} {r[f'{p}_cpu_ms']:.3f}" for p in PARTS)
                print(f"batch {batch:3d}, {steps} step(s)/call, run {i}: step {r['decode_step_ms']:.3f} ms, host CPU "
                      f"{r['total_cpu_ms']:.3f} ms a call ({parts})", flush=True)  # fmt: skip
    device = jax.devices()[0]
    result = {"benchmark": "engine_host_parts", "model": args.model, "device": device.device_kind,
              "date": datetime.date.today().isoformat(), "jax": jax.__version__, "results": rows}  # fmt: skip
    write_json(output_path(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
