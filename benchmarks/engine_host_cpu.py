"""The engine's own host time per call on the CPU, one step per call or several, at batch 1 or more.

Runs the tiny random model (``attn_jax.testing.models.tiny_random_engine``) with ``--batch``
requests at a time and times each ``Engine.step_runs`` (the server's and ``generate``'s call;
``step`` adds an event per token) in the main thread's CPU time
(``time.thread_time``, so other processes on a busy machine do not count), less the
time inside the jitted call (reported apart) and inside reading the tokens back: what is left is the
Python the engine core and the model runner run per step (scheduling, the packed step
inputs, the attention metadata, accounting, detokenisation). The GPU step's host cost
is the same code (``benchmarks/generate_gpu.py`` reports its ``host_ms_per_step``).

    python benchmarks/engine_host_cpu.py --runs 5 --tokens 300
    python benchmarks/engine_host_cpu.py --batch 64 --tokens 128
    python benchmarks/engine_host_cpu.py --batch 64 --tokens 128 --devices 4 --model-parallel 1
    python benchmarks/engine_host_cpu.py --batch 64 --tokens 128 --devices 2 --num-scheduler-steps 8
    python benchmarks/engine_host_cpu.py --batch 256 --tokens 64 --churn

``--churn`` keeps ``--batch`` requests running as a server's closed loop does: each ends
after its own number of tokens (spread over half to one and a half times ``--tokens``) and a
new request of a fresh prompt takes its place, so most calls admit a prompt beside the
running decodes instead of continuing the last call's batch on the device.

``--devices N`` shards the engine over N CPU devices (``--xla_force_host_platform_device_count``)
as ``Engine.from_llama`` does, ``--model-parallel`` of them over the KV heads and the rest
over requests: the host's cost per call against the device count (issue 48's "does not grow").

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import time

from gc_pauses import GcPauses  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json


def measure(
    runs: int, tokens: int, batch: int = 1, devices: int = 1, model_parallel: int | None = None,
    num_scheduler_steps: int = 1, churn: bool = False, gc_freeze: bool = False,
) -> dict:  # fmt: skip
    """Median host CPU ms per ``Engine.step_runs`` (one call of up to ``num_scheduler_steps``
    steps, or two where an admission call runs behind another: the call after it too) of each
    run of ``batch`` requests of ``tokens`` new tokens (the first and last 5 calls left out, or
    2 with several steps per call), on ``devices`` CPU devices; with ``churn``, of ``batch * 4``
    requests that join as others end (``batch`` at a time); with ``gc_freeze``, the heap frozen
    after the warm-up as the server's engine process freezes it (``gc_heap.freeze_startup_heap``).
    Also the garbage collections over the runs."""
    import os

    if devices > 1:  # before jax starts its CPU backend
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        ).strip()
    import jax

    from attn_jax.serving import SamplingParams
    from attn_jax.testing.models import tiny_random_engine

    sharding = {} if devices == 1 else {"devices": devices, "model_parallel": model_parallel}
    engine = tiny_random_engine(max_num_seqs=batch, max_num_batched_tokens=max(64, 32 * batch),
                                max_model_len=tokens + 64, num_scheduler_steps=num_scheduler_steps,
                                **sharding)  # fmt: skip
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]
    engine.generate(prompts, params)  # compiles the prefill and decode shapes
    if gc_freeze:
        from attn_jax.server.gc_heap import freeze_startup_heap

        freeze_startup_heap()
    spent = {"read": 0.0, "dispatch": 0.0}
    runner = engine.runner
    read, jit_for, continue_decode = runner.read_tokens, runner.jit_for, runner.continue_decode
    continued = {"calls": 0}

    def counting_continue(*args, **kwargs):  # the persistent batch continued: no per-request inputs built
        prepared = continue_decode(*args, **kwargs)
        continued["calls"] += prepared is not None
        return prepared

    def timed(fn, what):
        def wrapper(*args):
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[what] += time.thread_time() - start

        return wrapper

    timed_steps = {id(f): timed(f, "dispatch") for f in (runner._jit_step, runner._jit_step_wide)}
    runner.read_tokens, runner.jit_for = timed(read, "read"), lambda prepared: timed_steps[id(jit_for(prepared))]
    runner.continue_decode = counting_continue
    medians, dispatch, shares = [], [], []
    try:
        with GcPauses() as pauses:
            for run in range(runs):
                queued = [(p, params) for p in prompts]
                if churn:  # each request its own length; the queue refills the batch as requests end
                    rng = random.Random(run)
                    queued = [
                        ([rng.randrange(100, 1000) for _ in range(32)], SamplingParams(
                            max_new_tokens=rng.randrange(tokens // 2, tokens * 3 // 2), ignore_eos=True))
                        for _ in range(4 * batch)
                    ]  # fmt: skip
                for prompt, sp in queued[:batch]:
                    engine.add_request(prompt, sp)
                queued = queued[batch:]
                per_step, per_dispatch, ended = [], [], 0
                continued["calls"] = 0
                while engine.has_unfinished():
                    for prompt, sp in queued[:ended]:
                        engine.add_request(prompt, sp)
                    queued, ended = queued[ended:], 0
                    spent["read"] = spent["dispatch"] = 0.0
                    start = time.thread_time()
                    ended += sum(run.finished for run in engine.step_runs())
                    per_step.append(time.thread_time() - start - spent["read"] - spent["dispatch"])
                    per_dispatch.append(spent["dispatch"])
                edge = 5 if num_scheduler_steps == 1 else 2
                medians.append(1e3 * statistics.median(per_step[edge:-edge]))
                dispatch.append(1e3 * statistics.median(per_dispatch[edge:-edge]))
                shares.append(continued["calls"] / len(per_step))
    finally:
        runner.read_tokens = read
        del runner.jit_for, runner.continue_decode  # the class's methods again
    return {
        "host_ms_per_step_runs": medians,
        "host_ms_per_step_median": statistics.median(medians),
        # The jitted call's own CPU time in the calling thread (argument handling, enqueueing the
        # program on every device; on a CPU it may include some of the program's work).
        "dispatch_ms_per_step_median": statistics.median(dispatch),
        # Calls that continued the last one's batch on the device (``continue_decode``), per run.
        "continued_share_runs": shares,
        "tokens_per_run": tokens,
        "batch": batch,
        "num_scheduler_steps": num_scheduler_steps,
        "churn": churn,
        "gc_freeze": gc_freeze,
        "gc_pauses": pauses.summary(),  # over every run
        "devices": devices,
        "mesh": None if engine.mesh is None else dict(engine.mesh.shape),
        "jax": jax.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=300, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="requests per run, all submitted at once")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices the engine is sharded over")
    parser.add_argument("--model-parallel", type=int, default=None, help="over the KV heads (default: as serve)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per call")
    parser.add_argument("--churn", action="store_true", help="requests of spread lengths, replaced as they end")
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="freeze the heap after the warm-up, as attn-stack serve's engine process does (server/gc_heap.py)",
    )  # fmt: skip
    add_output_args(parser, "engine_host_cpu.json")
    args = parser.parse_args()
    if args.runs < 1 or args.tokens < 20 or args.batch < 1 or args.devices < 1:
        parser.error(
            f"--runs={args.runs}, --batch={args.batch} and --devices={args.devices} must be >= 1 and "
            f"--tokens={args.tokens} >= 20"
        )
    shape = dict(batch=args.batch, devices=args.devices, model_parallel=args.model_parallel)
    steps = dict(num_scheduler_steps=args.num_scheduler_steps, churn=args.churn, gc_freeze=args.gc_freeze)
    result = measure(args.runs, args.tokens, **shape, **steps) | {
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    runs = ", ".join(f"{m:.3f}" for m in result["host_ms_per_step_runs"])
    median = result["host_ms_per_step_median"]
    mesh = f", mesh {result['mesh']}" if result["mesh"] else ""
    print(
        f"engine host CPU time per call of {args.num_scheduler_steps} step(s), batch {args.batch}{mesh}: median "
        f"{median:.3f} ms (runs: {runs}); "
        f"the jitted call's {result['dispatch_ms_per_step_median']:.3f} ms; calls continuing the last one's batch: "
        + ", ".join(f"{100 * x:.0f} %" for x in result["continued_share_runs"])
        + "; garbage collections (count, ms) by generation: "
        + ", ".join(f"{g} {p['collections']}, {p['ms']:.1f}" for g, p in result["gc_pauses"].items())
    )
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
