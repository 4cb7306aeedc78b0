"""Workload S1 at CPU scale: many requests sharing a long prefix, prefix caching off / on.

S1 (issue 23) is 64 requests x (a shared 2048-token prefix + 64 unique tokens), 128 new
greedy tokens; on the CPU it is scaled down (default: 8 requests x (256 + 16 unique
tokens), 16 new tokens) on a small random Llama (``--model tiny``, or the SmolLM2-135M
shapes with random weights: ``--model smollm2-135m``). Every request arrives at once.

For each mode the engine first runs the same workload with another random prefix (the
warm-up: every bucket the measured run needs compiles there; then ``reset_prefix_cache``),
then the measured run. Reported per mode: prompt tokens computed (all tokens the steps
computed, less the generated tokens fed back), prefix cache hits, time to first token
per request (from the moment all requests are queued to their first token's arrival on
the host: min, mean, p50, p99, max), wall time, and whether the greedy tokens equal those with caching
off. Prints the results; ``--write`` writes ``benchmarks/results/prefix_cache_cpu.json``.

    .venv/bin/python benchmarks/prefix_cache_cpu.py            # print only
    .venv/bin/python benchmarks/prefix_cache_cpu.py --write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder


def _model(name: str):
    import jax.numpy as jnp

    from attn_jax.models.llama import LlamaConfig, init_params
    from attn_jax.testing.models import MODEL_SHAPES, random_params

    if name == "tiny":
        config = LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, max_position_embeddings=4096, name="tiny",
        )  # fmt: skip
        return config, init_params(config, seed=0)
    if name not in MODEL_SHAPES:
        raise SystemExit(f"--model {name!r} is not one of: tiny, {', '.join(MODEL_SHAPES)}")
    config = MODEL_SHAPES[name]()
    return config, random_params(config, jnp.float32)


def _prompts(args, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, vocab, args.prefix_len).tolist()
    return [prefix + rng.integers(2, vocab, args.unique_len).tolist() for _ in range(args.requests)]


def _measure(engine, prompts: list[list[int]], params) -> dict:
    """Runs ``prompts`` (all queued at once) to completion; per-request TTFT and the work done."""
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
    requests = [engine.get_request(i) for i in ids]
    times = np.array([ttft[i] for i in ids])
    return {
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_computed": computed - fed_back,
        "prefix_cache_hit_tokens": sum(s.num_cached_tokens for s in stats),
        "prefix_cache_queried_tokens": sum(s.num_queried_tokens for s in stats),
        "preemptions": sum(r.num_preemptions for r in requests),
        "ttft_min_ms": 1e3 * float(times.min()),
        "ttft_mean_ms": 1e3 * float(times.mean()),
        "ttft_p50_ms": 1e3 * float(np.percentile(times, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(times, 99)),
        "ttft_max_ms": 1e3 * float(times.max()),
        "wall_s": wall,
        "steps": len(stats),
        "steps_that_compiled": sum(s.compiled for s in stats),
        "output_ids": [engine.completion(i).output_ids for i in ids],
    }


def run(args) -> dict:
    from attn_jax.models.llama import LlamaModel
    from attn_jax.serving import Engine, SamplingParams

    config, params = _model(args.model)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    max_len = args.prefix_len + args.unique_len + args.new_tokens
    results = {}
    for mode, caching in (("off", False), ("on", True)):
        engine = Engine(
            LlamaModel(config, block_size=args.block_size), params, enable_prefix_caching=caching,
            max_num_seqs=args.requests, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
        )  # fmt: skip
        _measure(engine, _prompts(args, config.vocab_size, seed=1), sampling)  # warm-up: compiles
        engine.reset_prefix_cache()
        results[mode] = _measure(engine, _prompts(args, config.vocab_size, seed=2), sampling)
    same = results["off"].pop("output_ids") == results["on"].pop("output_ids")
    shared_once = args.prefix_len + args.requests * args.unique_len
    for r in results.values():
        print(
            f"  prompt tokens computed {r['prompt_tokens_computed']:6d} of {r['prompt_tokens']} "
            f"(hits {r['prefix_cache_hit_tokens']}), TTFT min {r['ttft_min_ms']:.1f} mean {r['ttft_mean_ms']:.1f} "
            f"p50 {r['ttft_p50_ms']:.1f} p99 {r['ttft_p99_ms']:.1f} ms, "
            f"wall {r['wall_s']:.2f} s, {r['steps']} steps ({r['steps_that_compiled']} compiled)"
        )
    print(f"greedy tokens identical off/on: {same}; the prefix computed once would be {shared_once} prompt tokens")
    return {
        "workload": {
            "name": "S1 (CPU scale)",
            "model": config.name,
            "requests": args.requests,
            "prefix_len": args.prefix_len,
            "unique_len": args.unique_len,
            "new_tokens": args.new_tokens,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "results": results,
        "greedy_tokens_identical": same,
        "prompt_tokens_if_prefix_computed_once": shared_once,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (default) or a MODEL_SHAPES name, random weights")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--unique-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    add_output_args(parser, "prefix_cache_cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    write_json(output_path(args), run(args))


if __name__ == "__main__":
    main()
