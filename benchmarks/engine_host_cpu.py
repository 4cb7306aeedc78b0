"""The engine's own host time per step on the CPU, one step per call, at batch 1 or more.

Runs the tiny random model (``attn_jax.testing.models.tiny_random_engine``) with ``--batch``
requests at a time and times each ``Engine.step`` in the main thread's CPU time
(``time.thread_time``, so other processes on a busy machine do not count), less the
time inside the jitted call and inside reading the tokens back: what is left is the
Python the engine core and the model runner run per step (scheduling, the packed step
inputs, the attention metadata, accounting, detokenisation). The GPU step's host cost
is the same code (``benchmarks/generate_gpu.py`` reports its ``host_ms_per_step``).

    python benchmarks/engine_host_cpu.py --runs 5 --tokens 300
    python benchmarks/engine_host_cpu.py --batch 64 --tokens 128

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def measure(runs: int, tokens: int, batch: int = 1) -> dict:
    """Median per-step host CPU ms of each run of ``batch`` requests of ``tokens`` new tokens
    (the first and last 5 steps left out)."""
    import jax

    from attn_jax.serving import SamplingParams
    from attn_jax.testing.models import tiny_random_engine

    engine = tiny_random_engine(max_num_seqs=batch, max_num_batched_tokens=max(64, 32 * batch),
                                max_model_len=tokens + 64)  # fmt: skip
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]
    engine.generate(prompts, params)  # compiles the prefill and decode shapes
    spent = {"device": 0.0}
    runner = engine.runner
    read, jitted = runner.read_tokens, runner._jit_step

    def timed(fn):
        def wrapper(*args):
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent["device"] += time.thread_time() - start

        return wrapper

    runner.read_tokens, runner._jit_step = timed(read), timed(jitted)
    medians = []
    try:
        for _ in range(runs):
            for prompt in prompts:
                engine.add_request(prompt, params)
            per_step = []
            while engine.has_unfinished():
                spent["device"] = 0.0
                start = time.thread_time()
                engine.step()
                per_step.append(time.thread_time() - start - spent["device"])
            medians.append(1e3 * statistics.median(per_step[5:-5]))
    finally:
        runner.read_tokens, runner._jit_step = read, jitted
    return {
        "host_ms_per_step_runs": medians,
        "host_ms_per_step_median": statistics.median(medians),
        "tokens_per_run": tokens,
        "batch": batch,
        "jax": jax.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=300, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="requests per run, all submitted at once")
    add_output_args(parser, "engine_host_cpu.json")
    args = parser.parse_args()
    if args.runs < 1 or args.tokens < 20 or args.batch < 1:
        parser.error(f"--runs={args.runs} and --batch={args.batch} must be >= 1 and --tokens={args.tokens} >= 20")
    result = measure(args.runs, args.tokens, args.batch) | {
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    runs = ", ".join(f"{m:.3f}" for m in result["host_ms_per_step_runs"])
    median = result["host_ms_per_step_median"]
    print(f"engine host CPU time per step, batch {args.batch}: median {median:.3f} ms (runs: {runs})")
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
