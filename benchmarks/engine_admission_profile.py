"""Where a serving step that admits prompts goes: the device's time against the host's, per call.

At 256 clients the server spends about a third of its time in one-step calls that admit
prompts beside the running decodes: 7.5 ms each on the H200 with 3.9 ms of host time, while
the admission step's attention takes 0.6-1.2 ms of it (BENCHMARKS.md, stop 69). This runs the
engine (random weights of ``--model``'s shape, every program compiled first by
``Engine.warmup``) in that regime without a server: ``--slots`` requests run, each for
``--life`` new tokens (the first ones for 1 to ``--life``, the first admitted ending first; the
warm-up of 3 lives brings it to about ``--slots / --life`` ending a step), and ``--admit``
fresh prompts of ``--prompt-len`` tokens always wait, so the calls admit prompts beside the
decodes as fast as slots free (one step a call; with ``--num-scheduler-steps`` K > 1,
multi-step decode calls run between them while every slot is taken, as in the server). Over
``--steps`` engine steps (``Engine.step_runs``; a step that dispatches an admission call behind a
running call dispatches the call after it too, so a step may be two calls) it reports:

- per call kind (admitting prompts, or decoding only: a finished request's slot is free
  only once its last tokens are read back, a call later under asynchronous scheduling), from
  ``StepStats``: the wall time (``seconds``: the calls' shares add up to the engine's busy
  time), the host's time before the jitted call, the dispatch, prompt and decode tokens and
  requests (medians);
- the main thread's CPU time per call (``time.thread_time``) and its share of the wall time:
  on the CPU a wait for the device uses none, but CUDA's default wait may spin (stop 64 found
  the thread's CPU time equal to the wall time under either schedule), so on a GPU compare the
  wall time per call with the device's busy time instead;
- on a GPU, a CUPTI trace of the same number of calls (``engine_step_profile.summarise_trace``):
  the device's busy time and span per call, and its kernels by category.

    python benchmarks/engine_admission_profile.py --slots 256 --life 18 --admit 16 --steps 30 --out /tmp/a.json
    python benchmarks/engine_admission_profile.py --num-scheduler-steps 8 --out /tmp/a8.json   # as serve runs

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``; prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import tempfile
import time

import jax
import numpy as np
from engine_args import add_engine_args, parse_engine_args  # benchmarks/, the script's folder
from engine_step_profile import load_profile, summarise_trace  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


class AdmissionLoad:
    """Keeps ``engine`` admitting: ``slots`` requests running (each for ``life`` new tokens;
    the first ``slots`` for 1 to ``life``, spread) and ``admit`` more waiting, topped up
    after every call with fresh prompts of ``prompt_len`` tokens drawn from ``vocab_size``."""

    def __init__(self, engine, *, slots: int, life: int, admit: int, prompt_len: int, vocab_size: int) -> None:
        from attn_jax.serving import SamplingParams

        self.engine, self.slots, self.admit, self.prompt_len = engine, slots, admit, prompt_len
        self.rng = np.random.default_rng(0)
        self.vocab_size = vocab_size
        lives = [1 + i * life // slots for i in reversed(range(slots))]  # popped from the end: shortest first
        self.params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lives]
        self.steady = SamplingParams(max_new_tokens=life, ignore_eos=True)
        self.top_up()

    def top_up(self) -> None:
        while self.engine.num_live_requests < self.slots + self.admit:
            params = self.params.pop() if self.params else self.steady
            self.engine.add_request(self.rng.integers(3, self.vocab_size, self.prompt_len).tolist(), params)

    def calls(self, n: int) -> None:
        for _ in range(n):
            self.engine.step_runs()
            self.top_up()


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measure(engine, load: AdmissionLoad, *, steps: int, warmup_steps: int, trace: bool) -> dict:
    """``warmup_steps`` engine steps, then (with ``trace``) ``steps`` steps under a CUPTI trace,
    then ``steps`` timed steps: the per-call figures the module docstring names (the host CPU
    share and the device's figures over all calls, the rest per call kind)."""
    if 2 * steps > engine.stats.maxlen:  # a step may dispatch two calls
        raise ValueError(f"steps={steps} must be at most half the engine's stats window ({engine.stats.maxlen})")
    load.calls(warmup_steps)
    out = {}
    if trace:
        with tempfile.TemporaryDirectory() as log_dir:
            first = len(engine.stats)
            with jax.profiler.trace(log_dir):
                load.calls(steps)
                engine.synchronize()
            out["device"] = summarise_trace(load_profile(log_dir), len(engine.stats) - first)
    compiles, first = engine.num_compilations, len(engine.stats)
    cpu, wall = time.thread_time(), time.perf_counter()
    load.calls(steps)
    engine.synchronize()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    stats = engine.stats[first:]
    kinds = {"admitting": [s for s in stats if s.num_prefill_tokens > 0]}
    kinds["decode"] = [s for s in stats if s.num_prefill_tokens == 0]
    return out | {
        "step_runs": steps,
        "calls": len(stats),
        "admitting_calls": len(kinds["admitting"]),
        "compilations_during": engine.num_compilations - compiles,
        "wall_ms_per_call": 1e3 * wall / len(stats),
        "host_cpu_ms_per_call": 1e3 * cpu / len(stats),
        "host_cpu_share": cpu / wall,
        "median_by_kind": {kind: _medians(calls) for kind, calls in kinds.items() if calls},
    }


def _medians(stats) -> dict:
    """Medians over ``stats`` (``StepStats`` of calls of one kind), times in ms."""
    return {
        "calls": len(stats),
        "seconds_ms": None if (seconds := _median(s.seconds for s in stats)) is None else 1e3 * seconds,
        "host_ms": 1e3 * _median(s.host_seconds for s in stats),
        "dispatch_ms": 1e3 * _median(s.dispatch_seconds for s in stats),
        "steps": _median(s.num_steps for s in stats),
        "prefill_tokens": _median(s.num_prefill_tokens for s in stats),
        "decode_tokens": _median(s.num_decode_tokens for s in stats),
        "requests": _median(s.num_requests for s in stats),
        "token_bucket": _median(s.token_bucket for s in stats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a shape of attn_jax.testing.models.MODEL_SHAPES")
    parser.add_argument("--slots", type=int, default=256, help="running requests (max_num_seqs)")
    parser.add_argument("--life", type=int, default=18, help="new tokens a request makes (slots / life end a step)")
    parser.add_argument("--admit", type=int, default=16, help="prompts kept waiting")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30, help="engine steps timed (and as many traced on a GPU)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps before timing (default: 3 lives)")
    add_engine_args(parser, prompt_len=128, kv_cache_gib=4)
    add_output_args(parser, "engine_admission_profile.json")
    args = parse_engine_args(parser)
    if len(args.num_scheduler_steps) != 1:
        parser.error(f"--num-scheduler-steps={args.num_scheduler_steps}: give one value (a run each: run it again)")
    for name in ("slots", "life", "admit", "steps", "prompt_len", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")

    from attn_jax.models.llama import LlamaModel
    from attn_jax.serving import Engine
    from attn_jax.testing.models import MODEL_SHAPES, random_params

    if args.model not in MODEL_SHAPES:
        parser.error(f"--model={args.model!r}: valid shapes are {sorted(MODEL_SHAPES)}")
    config = MODEL_SHAPES[args.model]()
    model = LlamaModel(config, block_size=args.block_size, attn_backend=args.attn_backend, dtype=args.dtype)
    engine = Engine(
        model, random_params(config, args.dtype), max_num_seqs=args.slots,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt_len + args.life + 8,
        kv_cache_bytes=args.kv_cache_gib << 30, enable_prefix_caching=not args.no_prefix_caching,
        num_scheduler_steps=args.num_scheduler_steps[0],
    )  # fmt: skip
    warmed = engine.warmup()  # every program compiled first, on a thread per core, as attn-stack serve does
    print(warmed.summary())
    load = AdmissionLoad(engine, slots=args.slots, life=args.life, admit=args.admit, prompt_len=args.prompt_len,
                         vocab_size=config.vocab_size)  # fmt: skip
    warmup = 3 * args.life if args.warmup_steps is None else args.warmup_steps
    result = measure(engine, load, steps=args.steps, warmup_steps=warmup, trace=jax.default_backend() == "gpu")
    r = result
    print(
        f"{args.model}, {args.slots} slots, {args.admit} waiting prompts of {args.prompt_len}: "
        f"{r['admitting_calls']} of {r['calls']} calls admitted; per call {r['wall_ms_per_call']:.2f} ms wall, "
        f"host CPU {r['host_cpu_ms_per_call']:.2f} ms ({r['host_cpu_share']:.0%}); {r['compilations_during']} compiled"
    )
    for kind, m in r["median_by_kind"].items():
        seconds = math.nan if m["seconds_ms"] is None else m["seconds_ms"]
        print(
            f"  {kind} calls ({m['calls']}), medians: {seconds:.2f} ms, host {m['host_ms']:.2f} ms before the call, "
            f"dispatch {m['dispatch_ms']:.2f} ms, {m['prefill_tokens']:.0f} prompt + {m['decode_tokens']:.0f} decode "
            f"tokens, {m['requests']:.0f} requests"
        )
    if "device" in result and "busy_us_per_step" in result["device"]:
        d = result["device"]
        print(f"device per call: busy {d['busy_us_per_step']:.0f} us, span {d['span_us_per_step']:.0f} us")
    write_json(
        output_path(args),
        dict(
            benchmark="engine_admission_profile", model=args.model, dtype=str(args.dtype), slots=args.slots,
            life=args.life, admit=args.admit, prompt_len=args.prompt_len,
            max_num_batched_tokens=args.max_num_batched_tokens, backend=model.attn_backend.get_name(),
            device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
            warmup=warmed.summary(), result=result,
        ),
    )  # fmt: skip


if __name__ == "__main__":
    main()
