"""Engine throughput on a GPU (or any jax device) beside transformers on the same shapes.

For each model shape (``--model``: SmolLM2-135M, an 8-layer Llama-3-8B; random weights,
since every request generates exactly ``--new-tokens`` tokens with EOS ignored) and batch
size: attn-stack's engine (one warm-up run of the workload, which compiles every bucket,
then one measured run), tokens/s, the decode step's median time, host time per step, and
the decode step's floor: the weights' bytes over the measured device copy bandwidth.
With ``--peers`` (and torch + transformers importable) the same run also times
transformers' ``generate`` on the same architecture, shapes and dtype: eager, and with
its static cache and ``torch.compile`` (the same-run peer). With ``--logprobs N`` every
request also asks for its tokens' top-N log-probabilities (their cost in a greedy batch).
``--temperature`` > 0 samples (with ``--top-p`` / ``--top-k``, seeded per request): the
engine's sampled programs; default greedy.

    python benchmarks/generate_gpu.py --dtype bfloat16 --peers --write
    python benchmarks/generate_gpu.py --model llama3-8b-8l --batch 1 16

Writes JSON only with ``--write`` (the committed file) or ``--out PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import itertools
import os
import platform
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from engine_args import add_engine_args, parse_engine_args  # benchmarks/, the script's folder
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder
from serve_load import thread_cpu_seconds  # benchmarks/, the script's folder

from attn_jax.models.llama import LlamaModel
from attn_jax.platforms import host_cpus
from attn_jax.server.gc_heap import freeze_startup_heap
from attn_jax.serving import Engine, SamplingParams
from attn_jax.sharding import local_model_kwargs
from attn_jax.testing.models import MODEL_SHAPES, random_params, weight_bytes


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second)."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # a kernel that reads and writes every byte (a * 1.0 folds to a memcpy)
    copy(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * num_bytes / float(np.median(times))


def text_tokenizer(config, folder: str | None = None):
    """The tokenizer ``--detokenize`` gives the engine: the embedded SmolLM2's, or with ``folder``
    one ``GGUFTokenizer.save`` wrote (``tokenizer.json`` and ``attn_stack_tokenizer.json``: a GPU
    machine without the embedded model's package). ValueError for a shape of another vocabulary:
    its random token ids would not be that tokenizer's."""
    from attn_jax.models.gguf_loader import load_tokenizer
    from attn_jax.models.gguf_tokenizer import GGUFTokenizer
    from attn_jax.models.smollm2 import gguf_path

    tokenizer = load_tokenizer(gguf_path()) if folder is None else GGUFTokenizer.load(folder)
    if tokenizer.vocab_size != config.vocab_size:
        what = "the embedded SmolLM2's vocabulary" if folder is None else f"{folder}'s vocabulary"
        raise ValueError(
            f"--detokenize needs a model of {what} ({tokenizer.vocab_size} tokens); "
            f"{config.name} has {config.vocab_size}"
        )
    return tokenizer


def prompts_for(config, batch: int, prompt_len: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return [rng.integers(3, config.vocab_size, prompt_len).tolist() for _ in range(batch)]


def run_engine(
    config,
    params,
    batch: int,
    args,
    backend,
    mesh=None,
    num_scheduler_steps: int = 1,
    logprobs: int | None = None,
    repeats: int = 1,
    tokenizer=None,
) -> dict:
    """The engine's tokens/s on ``prompts_for(config, batch)`` (``mesh``: sharded), with
    ``num_scheduler_steps`` decode steps per call, measured ``repeats`` times on one engine
    (``tokenizer``: the engine's, which then decodes each token's text)."""
    local = {} if mesh is None else local_model_kwargs(config, mesh)
    model = LlamaModel(config, block_size=args.block_size, attn_backend=backend, dtype=args.dtype, **local)
    engine = Engine(
        model, params, mesh=mesh, max_num_seqs=batch, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.new_tokens, kv_cache_bytes=args.kv_cache_gib << 30,
        num_scheduler_steps=num_scheduler_steps, enable_prefix_caching=not args.no_prefix_caching,
        tokenizer=tokenizer,
    )  # fmt: skip
    prompts = prompts_for(config, batch, args.prompt_len)
    sp = SamplingParams(
        max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=logprobs, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k,
    )  # fmt: skip
    sp = [dataclasses.replace(sp, seed=i) for i in range(batch)] if args.temperature > 0 else sp
    t = time.perf_counter()
    engine.generate(prompts, sp)
    warmup = time.perf_counter() - t
    if args.gc_freeze:  # as attn-stack serve's engine process runs: its startup heap frozen
        freeze_startup_heap()
    measured, step_cpu = [], []
    step_runs = engine.step_runs

    def timed_step_runs():  # the main thread's CPU seconds in each engine call (a wait for the device uses none)
        start = time.thread_time()
        runs = step_runs()
        step_cpu.append(time.thread_time() - start)
        return runs

    engine.step_runs = timed_step_runs  # what ``generate`` calls
    for _ in range(repeats):
        engine.reset_prefix_cache()  # each measured run computes its prompts again, not from earlier runs' blocks
        compiles, first = engine.num_compilations, len(engine.stats)
        step_cpu.clear()
        threads_before = threads_cpu()
        began, t = time.time(), time.perf_counter()
        results = engine.generate(prompts, sp)
        wall = time.perf_counter() - t
        threads_after = threads_cpu()
        stats = engine.stats[first:]
        decode = [s for s in stats if not s.num_prefill_tokens]
        step_ms = [1e3 * s.seconds / s.num_steps for s in decode]  # per decode step: a multi-step call's over its steps
        tokens = sum(len(r.output_ids) for r in results)
        measured.append({
            "generated_tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode) / sum(s.seconds for s in decode),
            "steps": len(stats),
            "host_ms_per_step_median": 1e3 * float(np.median([s.host_seconds for s in stats])),
            # All of a call's host work (scheduling, dispatch, reading back, tokens) in CPU time: against
            # host_ms_per_step_median's wall clock, it says whether a slow host waited or computed.
            "host_cpu_ms_per_call_median": 1e3 * float(np.median(step_cpu)),
            "decode_step_ms_median": float(np.median(step_ms)),
            "decode_step_ms_p10_p90": [float(x) for x in np.percentile(step_ms, [10, 90])],
            "compilations_after_warmup": engine.num_compilations - compiles,
            "began_unix_s": began,
            "busy_threads": busy_threads(threads_before, threads_after, wall),
        })  # fmt: skip
    del engine.step_runs  # the class's method again
    if args.gc_freeze:  # the next engine's run starts from a heap this one's objects can leave
        gc.unfreeze()
    # The run of median tokens/s gives the headline fields; every run is kept under "repeats".
    median = sorted(measured, key=lambda m: m["tokens_per_s"])[(len(measured) - 1) // 2]
    return {
        "batch": batch,
        "logprobs": logprobs,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "backend": model.attn_backend.get_name(),
        "num_scheduler_steps": num_scheduler_steps,
        "gc_freeze": args.gc_freeze,
        "warmup_seconds": warmup,
        "num_blocks": engine.num_blocks,
        **{k: v for k, v in median.items() if k != "began_unix_s"},
        "compilations_after_warmup": sum(m["compilations_after_warmup"] for m in measured),
        "repeats": measured if len(measured) > 1 else [],
    }


def threads_cpu() -> dict[int, tuple[str, float, int]]:
    """This process's threads (Linux's ``/proc``; {} elsewhere): thread id -> (name, CPU
    seconds so far, the CPU it last ran on)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        seconds = thread_cpu_seconds(int(tid))
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"
        except (OSError, IndexError, ValueError):
            continue
        if seconds is not None:
            out[int(tid)] = (name, seconds, cpu)
    return out


def busy_threads(before: dict, after: dict, wall: float, min_busy: float = 0.02) -> list[dict]:
    """The threads busy for at least ``min_busy`` of ``wall`` seconds between two
    ``threads_cpu`` readings, busiest first: name, the share of one core, the CPU each last ran
    on, and which is the main thread (the engine's). A thread that spins while it waits for the
    device shows as busy as the host's work; two on one core's hardware threads slow each other."""
    main = threading.main_thread().native_id
    rows = []
    for tid, (name, seconds, cpu) in after.items():
        busy = (seconds - before[tid][1]) / wall if tid in before and wall > 0 else 0.0
        if busy >= min_busy:
            rows.append({"name": name, "busy": busy, "cpu": cpu, "main": tid == main})
    return sorted(rows, key=lambda r: -r["busy"])


def run_transformers(config, batch: int, args, compiled: bool) -> dict:
    """transformers' greedy ``generate`` on the same architecture (random weights, the
    benchmark's dtype), left as it ships: eager, or static cache + ``torch.compile``."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
    )  # fmt: skip
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[str(args.dtype)]
    model = transformers.LlamaForCausalLM(hf_config).to(device="cuda", dtype=dtype).eval()
    ids = torch.tensor(prompts_for(config, batch, args.prompt_len), device="cuda")
    kwargs = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
        attention_mask=torch.ones_like(ids), pad_token_id=0,
    )  # fmt: skip
    if compiled:
        # mode="reduce-overhead" (CUDA graphs) fails inside generate with torch 2.11 ("accessing
        # tensor output of CUDAGraphs that has been overwritten"): the default mode.
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        warmup = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    tokens = int((out.shape[1] - ids.shape[1]) * batch)
    del model
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "peer": "transformers static cache + torch.compile" if compiled else "transformers eager",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokens_per_s": tokens / wall,
        "seconds": wall,
        "warmup_seconds": warmup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m"], choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--peers", action="store_true", help="also time transformers (needs torch + transformers)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N", help="every request asks for top-N logprobs")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (with --temperature > 0)")
    parser.add_argument("--top-k", type=int, default=0, help="every request's (with --temperature > 0); 0: off")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="measured runs per row, back to back on one engine (the median run's figures head the row; each is kept)",
    )  # fmt: skip
    parser.add_argument("--peer-batch", type=int, nargs="+", default=None, help="batches for peers (default: --batch)")
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="freeze the heap after each engine's warm-up, as attn-stack serve's engine process does "
        "(attn_jax/server/gc_heap.py); default: Python's collector as a library user has it",
    )  # fmt: skip
    parser.add_argument(
        "--detokenize", nargs="?", const="", default=None, metavar="FOLDER",
        help="give the engine a tokenizer, so each token's text is decoded as a user's engine decodes it: the "
        "embedded SmolLM2's (needs gguf and tokenizers), or FOLDER's, as GGUFTokenizer.save wrote it (needs "
        "tokenizers); the model's vocabulary must be the tokenizer's; default: token ids only",
    )  # fmt: skip
    add_engine_args(parser, prompt_len=128, kv_cache_gib=4)
    add_output_args(parser, "generate_gpu.json")
    args = parse_engine_args(parser)
    try:
        tokenizers = {
            name: None if args.detokenize is None else text_tokenizer(MODEL_SHAPES[name](), args.detokenize or None)
            for name in args.model
        }
    except (ValueError, OSError) as e:
        parser.error(str(e))

    device = jax.devices()[0]
    bandwidth = copy_bandwidth()
    print(f"{device.device_kind}: measured copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    backend = args.attn_backend
    models = []
    for name in args.model:
        config = MODEL_SHAPES[name]()
        params = random_params(config, args.dtype)
        floor_ms = 1e3 * weight_bytes(params) / bandwidth
        runs = []
        for batch, k in itertools.product(args.batch, args.num_scheduler_steps):
            r = run_engine(
                config,
                params,
                batch,
                args,
                backend,
                num_scheduler_steps=k,
                logprobs=args.logprobs,
                repeats=args.repeats,
                tokenizer=tokenizers[name],
            )
            runs.append(r)
            print(
                f"{name} batch {batch:3d} [{r['backend']}, {k} steps/call]: {r['tokens_per_s']:9.1f} tokens/s "
                f"(decode {r['decode_tokens_per_s']:9.1f}), decode step {r['decode_step_ms_median']:.3f} ms "
                f"(weight-read floor {floor_ms:.3f} ms), host {r['host_ms_per_step_median']:.3f} ms/step, "
                f"{r['compilations_after_warmup']} compilations after warm-up",
                flush=True,
            )
            for m in r["repeats"]:
                print(
                    f"    run at {m['began_unix_s']:.1f}: {m['tokens_per_s']:9.1f} tokens/s, decode step "
                    f"{m['decode_step_ms_median']:.3f} ms (p10-p90 {m['decode_step_ms_p10_p90'][0]:.3f}-"
                    f"{m['decode_step_ms_p10_p90'][1]:.3f}), host {m['host_ms_per_step_median']:.3f} ms/step, "
                    f"host CPU {m['host_cpu_ms_per_call_median']:.3f} ms/call; busy threads "
                    + ", ".join(f"{b['name']}{'*' if b['main'] else ''} {b['busy']:.2f} (cpu {b['cpu']})"
                                for b in m["busy_threads"][:4]),
                    flush=True,
                )  # fmt: skip
        del params
        peers = []
        models.append({"model": name, "weight_read_floor_ms": floor_ms, "runs": runs, "peers": peers})
        for batch in (args.peer_batch or args.batch) if args.peers else ():
            for compiled in (False, True):
                try:
                    p = run_transformers(config, batch, args, compiled)
                except Exception as e:  # a peer that fails is recorded, not fatal
                    p = {"batch": batch, "compiled": compiled, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"{name} batch {batch:3d} peer failed: {p['error']}", flush=True)
                else:
                    print(f"{name} batch {batch:3d} [{p['peer']}]: {p['tokens_per_s']:9.1f} tokens/s", flush=True)
                peers.append(p)
    result = {
        "workload": {
            "weights": "random",
            "dtype": str(args.dtype),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "greedy": args.temperature == 0,  # the engine's (transformers' peers are always greedy)
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "detokenize": None if args.detokenize is None else args.detokenize or "the embedded SmolLM2's tokenizer",
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "machine": {
            "device": device.device_kind,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "num_devices": jax.device_count(),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpus": host_cpus(),
            # How CUDA waits for the device (unset: its automatic choice, which spins on a CPU
            # while the process has fewer contexts than CPUs); read by XLA's stream executor.
            "gpu_device_schedule": os.environ.get("TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE"),
        },
        "models": models,
    }
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
