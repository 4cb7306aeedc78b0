"""One-step decode calls: the host's split of a call, and how often XLA updates the step's CUDA graph.

Runs the serving engine on random weights of a model shape at ``--batch`` requests, one
decode step per call, and times ``--repeats`` runs of ``--new-tokens`` tokens after a warm-up
run, from the engine's ``StepStats`` of its decode calls: the host's scheduling before the
jitted call (``host_ms``), the jitted call's dispatch (``dispatch_ms``) and the decode step.
``--sync`` turns asynchronous scheduling off (each call's tokens are read back before the
next call is dispatched).

``--count-graph-updates`` runs the same measurement in a child process with XLA's
``command_buffer_thunk`` logging on (``TF_CPP_VMODULE``, which must be set before jax
starts) and counts, between the warm-up and the end, the step's executions, the updates XLA
made to its recorded CUDA graph before a launch, their time and how many buffer allocations
had moved. XLA updates the graph whenever an argument or output of the step program sits at
another address than at the last launch. The logging itself slows the host: compare
timings without it.

    python benchmarks/graph_updates.py --batch 1 256 --count-graph-updates --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

MARK = "graph_updates.py: measured phase"
UPDATE = re.compile(r"Updated command buffer in (\d+) .s; num_commands=(\d+)")
ALLOCS = re.compile(r"updated_allocs=(\d+)")
EXECUTE = "Execute command buffer"


def measure(batch: int, args) -> dict:
    """The engine's one-step decode calls at ``batch``, ``args.repeats`` runs."""
    import jax.numpy as jnp
    from generate_gpu import prompts_for  # generate_gpu.py's prompts, for the same workload

    from attn_jax.models.llama import LlamaModel
    from attn_jax.serving import Engine, SamplingParams
    from attn_jax.testing.models import MODEL_SHAPES, random_params

    config = MODEL_SHAPES[args.model]()
    model = LlamaModel(config, block_size=16, dtype=jnp.bfloat16)
    engine = Engine(
        model, random_params(config, jnp.bfloat16), max_num_seqs=batch, max_num_batched_tokens=2048,
        max_model_len=args.prompt_len + args.new_tokens, kv_cache_bytes=4 << 30, num_scheduler_steps=1,
    )  # fmt: skip
    engine.async_scheduling = not args.sync
    prompts = prompts_for(config, batch, args.prompt_len)
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts, sp)
    print(MARK, "begins", file=sys.stderr, flush=True)
    runs = []
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        first, t = len(engine.stats), time.perf_counter()
        done = engine.generate(prompts, sp)
        wall = time.perf_counter() - t
        decode = [s for s in engine.stats[first:] if not s.num_prefill_tokens]
        runs.append({
            "tokens_per_s": sum(len(c.output_ids) for c in done) / wall,
            "decode_step_ms": 1e3 * statistics.median(s.seconds for s in decode),
            "host_ms": 1e3 * statistics.median(s.host_seconds for s in decode),
            "dispatch_ms": 1e3 * statistics.median(s.dispatch_seconds for s in decode),
            "calls": len(decode),
            "compiled": sum(s.compiled for s in decode),
        })  # fmt: skip
    print(MARK, "ends", file=sys.stderr, flush=True)
    return {"batch": batch, "sync": args.sync, "runs": runs}


def count_graph_updates(batch: int) -> dict:
    """``measure`` in a child with XLA's command-buffer logging on, and what the log says."""
    env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "command_buffer_thunk=3"}
    command = [sys.executable, __file__, *sys.argv[1:], "--batch", str(batch), "--child"]  # the last --batch wins
    child = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {**json.loads(child.stdout.strip().splitlines()[-1]), **summarize_log(child.stderr)}


def summarize_log(stderr: str) -> dict:
    """What XLA's ``command_buffer_thunk`` log says of the measured phase (between the marks):
    executions of the step's graph, updates before a launch, their median time in us, the
    graphs' command counts and how many allocations had moved per update."""
    log = stderr.split(f"{MARK} begins", 1)[-1].split(f"{MARK} ends", 1)[0]
    updates = UPDATE.findall(log)
    times = [int(us) for us, _ in updates]
    return {
        "graph_executions": log.count(EXECUTE),
        "graph_updates": len(updates),
        "graph_update_us_median": statistics.median(times) if times else None,
        "graph_commands": sorted({int(n) for _, n in updates}),
        "moved_allocations_per_update": dict(sorted(Counter(int(n) for n in ALLOCS.findall(log)).items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sync", action="store_true", help="asynchronous scheduling off")
    parser.add_argument("--count-graph-updates", action="store_true", help="a child process with XLA's logging on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_output_args(parser, "graph_updates.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.batch[0], args)))
        return
    import jax

    rows = [count_graph_updates(b) if args.count_graph_updates else measure(b, args) for b in args.batch]
    for row in rows:
        steps = ", ".join(f"{r['decode_step_ms']:.3f}" for r in row["runs"])
        dispatch = ", ".join(f"{r['dispatch_ms']:.3f}" for r in row["runs"])
        updates = ""
        if "graph_updates" in row:
            updates = f"; graph updates {row['graph_updates']} of {row['graph_executions']} executions"
        print(f"batch {row['batch']}: decode step {steps} ms, dispatch {dispatch} ms{updates}")
    device = jax.devices()[0]
    write_json(output_path(args), {
        "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "device": device.device_kind, "jax": jax.__version__, "rows": rows,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
