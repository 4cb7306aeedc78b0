"""Workload S1 on any jax device: requests sharing a long prefix, prefix caching off / on / on + cascade.

S1 (issue 23): 64 requests x (a shared 2048-token prefix + 64 unique tokens), 128 new greedy
tokens, every request queued at once, on the SmolLM2-135M shapes with random weights (the
defaults; bfloat16 on an accelerator, float32 on the CPU). Modes:

- ``off``: prefix caching off (every prompt computed from token 0);
- ``on``: prefix caching on, cascade attention off;
- ``on+cascade``: prefix caching on, cascade attention chosen by the builder (its own
  thresholds: >= 256 shared tokens over >= 8 requests; ``--cascade-min-prefix`` /
  ``--cascade-min-requests`` lower them; PALLAS_GPU weighs float32 layers' dot work too);
- ``on+cascade-forced`` (not in the default modes): the same with the thresholds alone
  deciding (``CascadeConfig(performance_model=False)``): cascade where the builder's model
  declines it, to measure what it declined;
- ``no-sharing off`` / ``no-sharing on``: the same shapes with every prompt unique, caching
  off and on (what caching costs where nothing is shared; target: no slowdown).

Every mode pads its steps to the same few buckets (``_buckets``) and runs on one engine
(switching ``engine.enable_prefix_caching`` and ``engine.cascade_attention``), so each mode's
warm-up (the same workload on another random prefix; it compiles every bucket the measured
run needs, then ``reset_prefix_cache``) compiles only what is new. Reported per mode: prompt
tokens computed (the steps' tokens less the generated tokens fed back), prefix cache hits,
calls with cascade attention, time to first token per request (from all requests queued to
each first token read back: p50, p99, mean, max), the decode step's median time (a multi-
step call's time over its steps), generated tokens/s over the run's wall time
(``--repeats``: the fastest run's), and whether the greedy tokens equal mode ``off``'s (bf16
on a GPU may flip near-ties between kernels: the fraction of equal tokens is given too). A
JSON is written after every mode (``--out`` / ``--write``), so a run cut short keeps what it
measured.

    python benchmarks/prefix_cache.py --out /tmp/s1.json                    # S1, the default device
    JAX_PLATFORMS=cpu python benchmarks/prefix_cache.py --model tiny --requests 8 --prefix-len 256 \\
        --unique-len 16 --new-tokens 16 --max-num-batched-tokens 512
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import time

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

MODES = ("off", "on", "on+cascade", "on+cascade-forced", "no-sharing off", "no-sharing on")  # run in this order
DEFAULT_MODES = ("off", "on", "on+cascade", "no-sharing off", "no-sharing on")  # S1's


def _model(name: str, dtype):
    """(config, params): ``tiny`` (a 2-layer Llama) or a ``MODEL_SHAPES`` shape, random weights in ``dtype``."""
    from attn_jax.models.llama import LlamaConfig
    from attn_jax.testing.models import MODEL_SHAPES, random_params

    if name == "tiny":
        config = LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, max_position_embeddings=8192, name="tiny",
        )  # fmt: skip
    elif name in MODEL_SHAPES:
        config = MODEL_SHAPES[name]()
    else:
        raise SystemExit(f"--model {name!r} is not one of: tiny, {', '.join(MODEL_SHAPES)}")
    return config, random_params(config, dtype)


def _prompts(args, vocab: int, seed: int, shared: bool) -> list[list[int]]:
    """``args.requests`` prompts of ``prefix_len + unique_len`` tokens: one random prefix for
    all (``shared``) or one per prompt."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, vocab, args.prefix_len).tolist()
    out = []
    for _ in range(args.requests):
        head = prefix if shared else rng.integers(2, vocab, args.prefix_len).tolist()
        out.append(head + rng.integers(2, vocab, args.unique_len).tolist())
    return out


def _buckets(args, pages: int):
    """Few shapes, so few compilations (the same for every mode): every step padded to all
    the requests and their longest block table; tokens from the requests (a decode step) up
    by fours to the step's budget."""
    from attn_jax.metadata import MetadataBuckets

    tokens = [min(args.requests, args.max_num_batched_tokens)]
    while tokens[-1] < args.max_num_batched_tokens:
        tokens.append(min(4 * tokens[-1], args.max_num_batched_tokens))
    return MetadataBuckets(tuple(tokens), (args.requests,), (pages,))


def _measure(engine, prompts: list[list[int]], params) -> dict:
    """Runs ``prompts`` (all queued at once) to completion: the work done, per-request TTFT,
    the decode step time and the rate."""
    import numpy as np

    first_step = len(engine.stats)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    ttft: dict[str, float] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if event.token_id >= 0 and event.request_id not in ttft:
                ttft[event.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    stats = engine.stats[first_step:]
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in stats)
    fed_back = len(prompts) * (params.max_new_tokens - 1)  # every generated token but the last is an input
    outputs = [engine.completion(i).output_ids for i in ids]
    times = np.array([ttft[i] for i in ids])
    decode = [s for s in stats if not s.num_prefill_tokens and s.seconds]
    generated = sum(map(len, outputs))
    return {
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_computed": computed - fed_back,
        "prefix_cache_hit_tokens": sum(s.num_cached_tokens for s in stats),
        "prefix_cache_queried_tokens": sum(s.num_queried_tokens for s in stats),
        "cascade_calls": sum(s.cascade_prefix_len > 0 for s in stats),
        "cascade_decode_calls": sum(s.cascade_prefix_len > 0 for s in decode),
        "cascade_prefix_len_max": max((s.cascade_prefix_len for s in stats), default=0),
        "preemptions": sum(engine.get_request(i).num_preemptions for i in ids),
        "ttft_p50_ms": 1e3 * float(np.percentile(times, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(times, 99)),
        "ttft_mean_ms": 1e3 * float(times.mean()),
        "ttft_max_ms": 1e3 * float(times.max()),
        "decode_step_ms_median": 1e3 * float(np.median([s.seconds / s.num_steps for s in decode])) if decode else None,
        # the decode calls with and without cascade apart (a builder may take it for some steps only)
        **{
            f"decode_step_ms_median_{name}": 1e3 * float(np.median([s.seconds / s.num_steps for s in part]))
            if part
            else None
            for name, part in (
                ("cascade", [s for s in decode if s.cascade_prefix_len > 0]),
                ("plain", [s for s in decode if not s.cascade_prefix_len]),
            )
        },
        "decode_calls": len(decode),
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "wall_s": wall,
        "calls": len(stats),
        "calls_that_compiled": sum(s.compiled for s in stats),
        "output_ids": outputs,
    }


def _profile_decode(engine, prompts: list[list[int]], params, calls: int) -> dict:
    """A CUPTI trace (``jax.profiler``) of ``calls`` decode-only engine calls once every
    request of ``prompts`` decodes, summarised per kernel category and decode step
    (``engine_step_profile.summarise_trace``); the requests then run to the end."""
    import tempfile

    import jax
    from engine_step_profile import _sync, load_profile, summarise_trace  # benchmarks/, the script's folder

    engine.reset_prefix_cache()
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not engine.get_request(i).output_ids for i in ids) or engine.stats[-1].num_prefill_tokens:
        engine.step()
    _sync(engine)
    first = len(engine.stats)
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(calls):
                engine.step()
            _sync(engine)
        stats = engine.stats[first : first + calls]
        steps = sum(s.num_steps for s in stats)
        summary = summarise_trace(load_profile(log_dir), steps)
    while engine.has_unfinished():
        engine.step()
    summary["decode_steps"] = steps
    summary["cascade_calls"] = sum(s.cascade_prefix_len > 0 for s in stats)
    return summary


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    tokens = sum(map(len, reference))
    equal = sum(a == b for x, y in zip(outputs, reference, strict=True) for a, b in zip(x, y, strict=True))
    return {
        "greedy_tokens_identical_to_off": outputs == reference,
        "greedy_token_agreement_with_off": equal / max(tokens, 1),
        "requests_identical_to_off": sum(x == y for x, y in zip(outputs, reference, strict=True)),
    }


def _print_row(mode: str, r: dict) -> None:
    step = "n/a" if r["decode_step_ms_median"] is None else f"{r['decode_step_ms_median']:.3f}"
    agree = r.get("greedy_token_agreement_with_off")
    print(
        f"{mode:17s} {r['prompt_tokens_computed']:9d} {r['prefix_cache_hit_tokens']:9d} {r['cascade_calls']:4d} "
        f"{r['ttft_p50_ms']:10.1f} {r['ttft_p99_ms']:10.1f} {step:>9s} {r['tokens_per_s']:10.1f} "
        f"{r['wall_s']:7.2f} {r['calls_that_compiled']:3d} {'' if agree is None else f'{agree:.3f}':>6s}",
        flush=True,
    )


HEADER = (
    f"{'mode':17s} {'computed':>9s} {'hits':>9s} {'casc':>4s} {'TTFT p50':>10s} {'TTFT p99':>10s} "
    f"{'step ms':>9s} {'tokens/s':>10s} {'wall s':>7s} {'cmp':>3s} {'agree':>6s}"
)


def run(args, path) -> dict:
    import jax
    import jax.numpy as jnp

    from attn_jax.models.llama import LlamaModel
    from attn_jax.registry import AttentionBackendEnum
    from attn_jax.serving import CascadeConfig, Engine, SamplingParams

    device = jax.devices()[0]
    dtype = args.dtype if args.dtype != "auto" else ("float32" if device.platform == "cpu" else "bfloat16")
    config, params = _model(args.model, jnp.dtype(dtype))
    backend = None if args.backend is None else AttentionBackendEnum[args.backend.upper()].get_class()
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    max_len = args.prefix_len + args.unique_len + args.new_tokens
    pages = -(-max_len // args.block_size)
    # Every request at its longest, with no sharing, plus the warm-up's cached pages' worth.
    num_blocks = args.requests * pages + pages
    cascade = CascadeConfig(min_prefix_len=args.cascade_min_prefix, min_requests=args.cascade_min_requests)
    forced = dataclasses.replace(cascade, performance_model=False)
    buckets = _buckets(args, pages)
    result = {
        "workload": {
            "name": "S1" if (args.requests, args.prefix_len, args.unique_len, args.new_tokens) == (64, 2048, 64, 128)
            else "S1 (scaled)",
            "model": config.name, "dtype": dtype, "requests": args.requests, "prefix_len": args.prefix_len,
            "unique_len": args.unique_len, "new_tokens": args.new_tokens, "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens, "num_scheduler_steps": args.num_scheduler_steps,
            "num_blocks": num_blocks, "greedy": True, "weights": "random",
            "token_buckets": list(buckets.token_buckets),
            "cascade_min_prefix_len": args.cascade_min_prefix, "cascade_min_requests": args.cascade_min_requests,
            "prompt_tokens_if_prefix_computed_once": args.prefix_len + args.requests * args.unique_len,
        },
        "machine": {
            "device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "results": {},
    }  # fmt: skip
    print(
        f"{result['workload']['name']} on {device.device_kind}: {args.requests} x ({args.prefix_len} + "
        f"{args.unique_len}) prompt tokens, {args.new_tokens} new, {config.name} {dtype}",
        flush=True,
    )
    engines = []

    def engine_for(caching: bool):
        if not engines:  # one engine for every mode: what one mode compiled, the next reuses
            model = LlamaModel(config, block_size=args.block_size, attn_backend=backend, dtype=dtype)
            engines.append(
                Engine(
                    model,
                    params,
                    max_num_seqs=args.requests,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=max_len,
                    num_blocks=num_blocks,
                    num_scheduler_steps=args.num_scheduler_steps,
                    buckets=buckets,
                )  # fmt: skip
            )
            result["backend"] = model.attn_backend.get_name()
        engines[0].enable_prefix_caching = caching
        return engines[0]

    reference = {}
    modes = [m for m in MODES if m in args.modes]
    print(HEADER, flush=True)
    for seed, mode in enumerate(modes):
        shared = not mode.startswith("no-sharing")
        engine = engine_for(caching=mode.endswith("on") or mode.startswith("on+cascade"))
        engine.cascade_attention = {"on+cascade": cascade, "on+cascade-forced": forced}.get(mode, False)
        t = time.perf_counter()
        try:
            _measure(engine, _prompts(args, config.vocab_size, seed=100 + seed, shared=shared), sampling)  # warm-up
            warmup = time.perf_counter() - t
            runs = []
            for _ in range(args.repeats):  # the fastest run is reported, every run's wall time with it
                engine.reset_prefix_cache()
                prompts = _prompts(args, config.vocab_size, seed=1 if shared else 2, shared=shared)
                runs.append(_measure(engine, prompts, sampling))
        except Exception as e:  # a mode that fails is recorded; the others still run
            message = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"{mode:17s} FAILED: {message}", flush=True)
            result["results"][mode] = {"error": message}
            engines.clear()  # the engine may be in any state: the next mode makes another
            write_json(path, result)
            continue
        r = min(runs, key=lambda x: x["wall_s"])
        if args.profile_calls:
            prompts = _prompts(args, config.vocab_size, seed=1 if shared else 2, shared=shared)
            try:
                r["decode_profile"] = profile = _profile_decode(engine, prompts, sampling, args.profile_calls)
                per_step = profile.get("per_step_us", {})
                print(f"  {mode} decode step, us by kernel category: {per_step}", flush=True)
            except Exception as e:  # a profiler that fails (no CUPTI, say) leaves the timings standing
                r["decode_profile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"  {mode} decode profile FAILED: {r['decode_profile_error']}", flush=True)
                engines.clear()  # the profiled run may have stopped mid-way: the next mode makes another engine
        r["warmup_s"] = warmup
        r["wall_s_runs"] = [x["wall_s"] for x in runs]
        outputs = r.pop("output_ids")
        if mode in ("off", "no-sharing off"):
            reference[shared] = outputs
        elif shared in reference:
            r.update(_agreement(outputs, reference[shared]))
        result["results"][mode] = r
        _print_row(mode, r)
        write_json(path, result)
    _summary(result["results"])
    return result


def _summary(results: dict) -> None:
    """Ratios against mode ``off`` (and no-sharing on against no-sharing off)."""

    def ratio(a, b, key):
        if a in results and b in results and results[a].get(key) and results[b].get(key):
            return results[a][key] / results[b][key]
        return None

    lines = [
        ("prompt tokens computed on / off", ratio("on", "off", "prompt_tokens_computed")),
        ("decode step on+cascade / on", ratio("on+cascade", "on", "decode_step_ms_median")),
        ("decode step on+cascade-forced / on", ratio("on+cascade-forced", "on", "decode_step_ms_median")),
        ("wall off / on+cascade (speed-up)", ratio("off", "on+cascade", "wall_s")),
        ("no-sharing wall on / off (slowdown)", ratio("no-sharing on", "no-sharing off", "wall_s")),
    ]
    for name, value in lines:
        if value is not None:
            print(f"{name}: {value:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), llama3-8b-8l or tiny")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bf16 off CPU")
    parser.add_argument("--backend", default=None, help="force a backend (XLA, PALLAS_GPU); default: selected")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--unique-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-scheduler-steps", type=int, default=8, help="decode steps per engine call")
    parser.add_argument("--cascade-min-prefix", type=int, default=None, help="default: the builder's (256)")
    parser.add_argument("--cascade-min-requests", type=int, default=None, help="default: the builder's (8)")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per mode (the fastest is reported)")
    parser.add_argument(
        "--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES, metavar="MODE",
        help=f"of {MODES}; default {DEFAULT_MODES}",
    )  # fmt: skip
    parser.add_argument(
        "--profile-calls", type=int, default=0,
        help="also trace this many decode-only calls per mode (CUPTI: per-kernel-category time per step; GPU)",
    )  # fmt: skip
    add_output_args(parser, "prefix_cache_{platform}.json")
    args = parser.parse_args()
    import jax

    args.platform = jax.devices()[0].platform
    path = output_path(args)
    result = run(args, path)
    write_json(path, result)


if __name__ == "__main__":
    main()
