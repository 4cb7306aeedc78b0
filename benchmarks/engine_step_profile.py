"""Where an engine decode step's time goes: a jax.profiler (CUPTI) trace of steady decode
steps, summarised per kernel category, with launch gaps, host time and transfers.

Runs the serving engine on random weights of a model shape (``--model``), warms every
bucket up, then traces ``--steps`` decode steps and reads the trace back with
``jax.profiler.ProfileData``:

- device: kernel time per category (matmul, attention, kv write, sampling, elementwise,
  other), the busy time against the span of the device's work (the gaps between kernels
  are launch overhead or waiting for the host), host-to-device and device-to-host copies;
- host: ``StepStats`` (scheduling + metadata before the device call, and the whole step);
  with ``--overlap-work-ms``, whether the jitted call's dispatch overlaps Python work on
  another thread (``dispatch_overlap_ms``).

    python benchmarks/engine_step_profile.py --batch 1 64 --dtype bfloat16
    python benchmarks/engine_step_profile.py --model llama3-8b-8l --batch 1 --out /tmp/x.json

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``; prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import itertools
import json
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from engine_args import add_engine_args, parse_engine_args  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.models.llama import LlamaModel
from attn_jax.serving import Engine, SamplingParams
from attn_jax.sharding import local_model_kwargs
from attn_jax.testing.engine_probes import record_step_call
from attn_jax.testing.models import MODEL_SHAPES, random_params, weight_bytes

# Kernel name -> category, first match wins (XLA fusion names, cuBLAS/cuDNN, Triton).
CATEGORIES = (
    ("collective", re.compile(r"nccl|all.?reduce|all.?gather|reduce.?scatter|collective", re.I)),
    ("attention", re.compile(r"ragged|paged|attention|mosaic", re.I)),
    ("kv write", re.compile(r"scatter|dynamic.update|kv_write", re.I)),
    ("sampling", re.compile(r"sort|argmax|top_?k|categorical|cub::|radix|threefry|random|gumbel", re.I)),
    ("matmul", re.compile(r"gemm|matmul|dot|cublas|cutlass|nvjet|xmma|wgmma|sm90", re.I)),
    ("memcpy", re.compile(r"memcpy|memset", re.I)),
    # XLA's reduction fusions: norms and softmax rows, but at batch 1 also a matrix-vector
    # product it emits as a reduction (the LM head: a weight read, not elementwise work).
    ("reduction", re.compile(r"reduce", re.I)),
    ("elementwise", re.compile(r"fusion|loop|convert|copy|transpose|broadcast|concatenate|slice", re.I)),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def load_profile(log_dir: str):
    """The ``jax.profiler.ProfileData`` of the trace ``jax.profiler.trace(log_dir)`` wrote."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"no xplane.pb under {log_dir}")
    return ProfileData.from_file(files[0])


def summarise_trace(data, num_steps: int) -> dict:
    """Device-side totals of a trace (``load_profile``'s), per step and GPU (the span: per step)."""
    per_cat = collections.Counter()
    per_kernel = collections.Counter()
    count_cat = collections.Counter()
    starts, ends, memcpy = [], [], collections.Counter()
    events = []  # (start, name, duration) of every kernel, for the last step's sequence
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    num_steps *= max(len(planes), 1)  # per step and device
    for plane in planes:
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                name = ev.name
                cat = category(name)
                per_cat[cat] += ev.duration_ns
                count_cat[cat] += 1
                per_kernel[name[:90]] += ev.duration_ns
                starts.append(ev.start_ns)
                ends.append(ev.end_ns)
                events.append((ev.start_ns, name[:90], ev.duration_ns))
                if "Memcpy" in name or "memcpy" in name:
                    memcpy[name[:30]] += 1
    if not starts:
        return {"error": "no GPU stream events in the trace (not a GPU run?)"}
    busy = sum(per_cat.values())
    span = max(ends) - min(starts)
    return {
        "per_step_us": {c: per_cat[c] / 1e3 / num_steps for c in sorted(per_cat)},
        "kernels_per_step": {c: count_cat[c] / num_steps for c in sorted(count_cat)},
        "busy_us_per_step": busy / 1e3 / num_steps,
        "span_us_per_step": span / 1e3 / num_steps * max(len(planes), 1),
        "gap_us_per_step": span / 1e3 / num_steps * max(len(planes), 1) - busy / 1e3 / num_steps,
        "memcpy_events_per_step": {k: v / num_steps for k, v in memcpy.items()},
        "top_kernels_us_per_step": {k: v / 1e3 / num_steps for k, v in per_kernel.most_common(25)},
        # The last step's kernels in launch order (one GPU's), name and microseconds.
        "last_step_kernels": [(n, d / 1e3) for _, n, d in sorted(events)[-(len(events) // num_steps) :]],
    }


def summarise_host_events(data, num_calls: int, top: int = 70) -> dict:
    """The host's side of a trace (``load_profile``'s), per engine call: for each event name on the
    host planes (XLA's and PjRt's TraceMe annotations on ``/host:CPU``; the CUDA driver and
    runtime calls CUPTI records), its microseconds and count per call, the ``top`` names by
    time. Nested events each count their whole span, so a parent includes its children."""
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                key = f"{plane.name} | {ev.name[:100]}"
                total[key] += ev.duration_ns
                count[key] += 1
    top_names = total.most_common(top)
    return {k: {"us_per_call": v / 1e3 / num_calls, "per_call": count[k] / num_calls} for k, v in top_names}


def _sync(engine) -> None:
    """Waits for the engine's last dispatched step (engines that run a step ahead)."""
    if hasattr(engine, "synchronize"):
        engine.synchronize()


def _step_and_sync(engine) -> None:
    """One engine step, waited for (what ``record_step_call`` records)."""
    engine.step()
    _sync(engine)


@contextlib.contextmanager
def replaying_last_call(engine):
    """The engine's last jitted call, to run again: yields ``call()``, which runs it once with
    the caches and the rows' state of the call before fed back (both donated) and a device
    copy of the packed inputs the engine holds for the call after it (donated too: a copy a
    call, so every call decodes the same positions), and returns its tokens; the engine
    holds the last call's caches and rows' state afterwards."""
    jit_step, (params, _, _, _, *static) = record_step_call(engine, functools.partial(_step_and_sync, engine))
    chain = engine.runner._decode_chain  # (the last call, its inputs one step on); its own were donated to it
    if chain is None:
        raise RuntimeError("the engine's last call was not a decode batch: there is no decode call to replay")
    packed = chain[1]  # the engine's own, for its next call: each replay donates a copy of it
    runner = engine.runner
    # The recorded caches and rows' state were donated: the engine's current ones.
    state = {"caches": engine.kv_caches, "last": (runner._last_tokens, runner._token_counts, runner._guide_masks)}

    def call():
        out = jit_step(params, state["caches"], state["last"], jnp.copy(packed), *static)
        tokens, state["last"], state["caches"] = out[:3]
        return tokens  # (the step's other outputs are not kept)

    try:
        yield call
    finally:
        runner._last_tokens, runner._token_counts, runner._guide_masks = state["last"]
        engine.kv_caches = state["caches"]


def device_only_step_ms(engine, steps: int) -> dict[str, float]:
    """The time per step with no scheduling between steps: the engine's last jitted call
    repeated ``steps`` times back to back (the caches and the rows' state fed back, both
    donated), its tokens as the next input ("chained_tokens"), then adding one by one what
    the engine does between steps: an asynchronous copy of the tokens to the host
    ("copy_to_host_async"), and reading the previous step's tokens ("read_previous")."""
    out = {}
    with replaying_last_call(engine) as call:
        for variant in ("chained_tokens", "copy_to_host_async", "read_previous"):
            tokens = call()
            jax.block_until_ready(tokens)
            t = time.perf_counter()
            previous = tokens
            for _ in range(steps):
                tokens = call()
                if variant in ("copy_to_host_async", "read_previous"):
                    tokens.copy_to_host_async()
                if variant == "read_previous":
                    np.asarray(previous)
                previous = tokens
            jax.block_until_ready(tokens)
            out[variant] = 1e3 * (time.perf_counter() - t) / (steps * engine.num_scheduler_steps)  # per decode step
    return out


def _busy(seconds: float) -> None:
    """Python bytecode for ``seconds`` (holding the GIL, as the engine's host work does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def dispatch_overlap_ms(engine, steps: int, work_ms: float) -> dict[str, float]:
    """Whether the jitted call's dispatch can overlap the host's Python work: the engine's
    last call repeated ``steps`` times (``replaying_last_call``), each beside ``work_ms`` of
    Python busy work; per round, in ms: the call alone ("dispatch"), the call then the work
    ("sequential"), and the call on a worker thread while this thread works ("threaded"; at
    most the larger of the two where the call runs outside the GIL). The device is
    synchronised before each variant; it must not be what limits (a round under the device's
    step queues work on it: compare "dispatch" with the step)."""
    out = {}
    with replaying_last_call(engine) as call, ThreadPoolExecutor(1) as worker:
        for variant in ("dispatch", "sequential", "threaded"):
            tokens = call()
            jax.block_until_ready(tokens)
            t = time.perf_counter()
            for _ in range(steps):
                if variant == "threaded":
                    future = worker.submit(call)
                    _busy(work_ms / 1e3)
                    tokens = future.result()
                else:
                    tokens = call()
                    if variant == "sequential":
                        _busy(work_ms / 1e3)
            out[variant] = 1e3 * (time.perf_counter() - t) / steps
            jax.block_until_ready(tokens)
    return out | {"work": work_ms}


def write_step_hlo(engine, path: str) -> None:
    """The compiled HLO of the engine's next decode call (its fusions: what each kernel
    name in ``last_step_kernels`` computes)."""

    jit_step, call_args = record_step_call(engine, functools.partial(_step_and_sync, engine))
    with open(path, "w") as f:
        f.write(jit_step.lower(*call_args).compile().as_text())


def profile_batch(config, params, batch: int, args, backend, mesh=None, num_scheduler_steps: int = 1) -> dict:
    local = {} if mesh is None else local_model_kwargs(config, mesh)
    model = LlamaModel(config, block_size=args.block_size, attn_backend=backend, dtype=args.dtype, **local)
    k = num_scheduler_steps  # decode steps per engine call
    new_tokens = k * (args.warmup_steps + 3 * args.steps) + 4  # warm-up, traced, untraced, device-only
    engine = Engine(
        model, params, mesh=mesh, max_num_seqs=batch, max_num_batched_tokens=max(args.prompt_len * batch, 16),
        max_model_len=args.prompt_len + new_tokens + 8, kv_cache_bytes=args.kv_cache_gib << 30, num_scheduler_steps=k,
    )  # fmt: skip
    rng = np.random.default_rng(batch)
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(3, config.vocab_size, args.prompt_len).tolist(), sp)
    for _ in range(args.warmup_steps):
        engine.step()
    first = len(engine.stats)
    compiles = engine.num_compilations
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            _sync(engine)
            wall = time.perf_counter() - t
        data = load_profile(log_dir)
        device = summarise_trace(data, args.steps * k)  # per decode step
        host = summarise_host_events(data, args.steps) if getattr(args, "host_events", False) else None
    # Untraced timing of the same number of steps (the profiler adds its own overhead).
    first = len(engine.stats)
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _sync(engine)
    untraced = time.perf_counter() - t
    stats = engine.stats[first:]
    device_ms = device_only_step_ms(engine, args.steps)
    overlap = [dispatch_overlap_ms(engine, args.steps, w) for w in getattr(args, "overlap_work_ms", ())]
    if getattr(args, "hlo_out", None):  # engine_step_profile.py's flag (scale_out.py has none)
        write_step_hlo(engine, f"{args.hlo_out}.batch{batch}.hlo.txt")
    return {
        "batch": batch,
        "backend": model.attn_backend.get_name(),
        "num_scheduler_steps": k,
        "step_ms_traced": 1e3 * wall / (args.steps * k),  # per decode step
        "step_ms": 1e3 * untraced / (args.steps * k),
        "tokens_per_s": batch * args.steps * k / untraced,
        "host_ms_median": 1e3 * float(np.median([s.host_seconds for s in stats])),
        "dispatch_ms_median": 1e3 * float(np.median([s.dispatch_seconds for s in stats])),
        "device_only_step_ms": device_ms,
        "dispatch_overlap_ms": overlap,
        "compilations_while_profiled": engine.num_compilations - compiles,
        "device": device,
    } | ({} if host is None else {"host_events_per_call": host})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument(
        "--overlap-work-ms", type=float, nargs="*", default=[],
        help="also time the jitted call beside this much Python work, in turn and on a worker thread",
    )  # fmt: skip
    parser.add_argument(
        "--host-events", action="store_true", help="also summarise the trace's host events (TraceMe, CUDA API) per call"
    )
    parser.add_argument("--hlo-out", default=None, help="write each batch's compiled step HLO to PREFIX.batchN.hlo.txt")
    add_engine_args(parser, prompt_len=128, kv_cache_gib=4)
    add_output_args(parser, "engine_step_profile_{model}.json")
    args = parse_engine_args(parser)
    config = MODEL_SHAPES[args.model]()
    params = random_params(config, args.dtype)
    backend = args.attn_backend
    runs = []
    for batch, k in itertools.product(args.batch, args.num_scheduler_steps):
        r = profile_batch(config, params, batch, args, backend, num_scheduler_steps=k)
        runs.append(r)
        d = r["device"]
        print(
            f"batch {batch} [{r['backend']}, {k} steps/call]: step {r['step_ms']:.3f} ms "
            f"({r['tokens_per_s']:.0f} tok/s), "
            f"host {r['host_ms_median']:.3f} ms, dispatch {r['dispatch_ms_median']:.3f} ms, "
            f"back-to-back steps {r['device_only_step_ms']} ms, device busy {d.get('busy_us_per_step', 0):.0f} us, "
            f"span {d.get('span_us_per_step', 0):.0f} us, gaps {d.get('gap_us_per_step', 0):.0f} us",
            flush=True,
        )
        for o in r["dispatch_overlap_ms"]:
            times = ", ".join(f"{k} {v:.3f}" for k, v in o.items() if k != "work")
            print(f"  dispatch beside {o['work']} ms of Python: {times} ms per round")
        print(json.dumps(d, indent=1), flush=True)
        for name, v in r.get("host_events_per_call", {}).items():
            print(f"  host {v['us_per_call']:9.1f} us {v['per_call']:7.1f}x  {name}")
    result = {
        "model": args.model,
        "weight_bytes": weight_bytes(params),
        "dtype": str(args.dtype),
        "prompt_len": args.prompt_len,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
    }
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
