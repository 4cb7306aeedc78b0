"""Tokens/s of the attn-stack engine vs transformers on the same CPU, model and prompts.

SmolLM2-135M-Instruct from the embedded GGUF, float32, 8 prompts x 64 new greedy tokens
(EOS ignored by every contender, so each generates exactly 512 tokens):

* ``engine``: ``attn_jax.serving.Engine`` (the XLA backend's chunked op), after one warm-up
  run of the same workload (compilation), with the compilations of the measured run;
* ``hf_generate``: transformers' padded batched ``generate`` (left padding);
* ``hf_generate_batch``: transformers' continuous-batching ``generate_batch`` (paged cache).

Each is measured once, in one process, one after the other. Prints the results;
``--write`` writes ``benchmarks/results/generate_cpu.json`` (``--out PATH``: elsewhere);
``--quick`` runs 2 prompts x 8 tokens.

    .venv/bin/python benchmarks/generate_cpu.py --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a transformer is",
    "The quick brown fox",
    "My favourite recipe for pancakes starts with",
]


def machine() -> dict:
    import jax
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def run_engine(prompts: list[str], new_tokens: int) -> dict:
    from attn_jax.serving import Engine, SamplingParams

    t = time.perf_counter()
    engine = Engine.from_gguf(max_num_seqs=len(prompts), max_num_batched_tokens=256, max_model_len=512)
    load = time.perf_counter() - t
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(prompts, params)
    warmup = time.perf_counter() - t
    compiles = engine.num_compilations
    steps = len(engine.stats)
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(r.output_ids) for r in results)
    measured = engine.stats[steps:]
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "load_seconds": load,
        "warmup_seconds": warmup,
        "compilations_in_warmup": compiles,
        "compilations_after_warmup": engine.num_compilations - compiles,
        "steps": len(measured),
        "mean_host_ms_per_step": 1e3 * sum(s.host_seconds for s in measured) / len(measured),
        "backend": engine.model.attn_backend.get_name(),
        "token_ids": [r.output_ids for r in results],
    }


def load_hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attn_jax.models.smollm2 import gguf_path

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def run_hf_generate(model, tokenizer, prompts: list[str], new_tokens: int) -> dict:
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, **kwargs)  # warm-up
        t = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        wall = time.perf_counter() - t
    new = out[:, batch["input_ids"].shape[1] :]
    tokens = int(new.numel())
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "token_ids": new.tolist()}


def run_hf_generate_batch(model, tokenizer, prompts: list[str], new_tokens: int) -> dict:
    import torch
    from transformers import GenerationConfig

    ids = [tokenizer(p)["input_ids"] for p in prompts]
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)
        wall = time.perf_counter() - t
    generated = [list(o.generated_tokens) for o in out.values()]
    tokens = sum(len(g) for g in generated)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts x 8 tokens (a smoke test)")
    add_output_args(parser, "generate_cpu.json")
    args = parser.parse_args()
    prompts, new_tokens = (PROMPTS[:2], 8) if args.quick else (PROMPTS, 64)

    info = machine()
    engine = run_engine(prompts, new_tokens)
    compiles = engine["compilations_after_warmup"]
    print(f"engine: {engine['tokens_per_s']:.1f} tokens/s ({compiles} compilations after warm-up)")
    model, tokenizer = load_hf()
    hf = run_hf_generate(model, tokenizer, prompts, new_tokens)
    print(f"transformers generate (padded): {hf['tokens_per_s']:.1f} tokens/s")
    try:
        hf_batch = run_hf_generate_batch(model, tokenizer, prompts, new_tokens)
        print(f"transformers generate_batch: {hf_batch['tokens_per_s']:.1f} tokens/s")
    except Exception as e:  # noqa: BLE001 - recorded in the results, not hidden
        hf_batch = {"error": f"{type(e).__name__}: {e}"}
        print(f"transformers generate_batch failed: {hf_batch['error']}")
    best = max(hf["tokens_per_s"], hf_batch.get("tokens_per_s", 0.0))
    same = sum(a == b for a, b in zip(engine["token_ids"], hf["token_ids"], strict=True))
    result = {
        "workload": {"prompts": len(prompts), "new_tokens": new_tokens, "dtype": "float32", "greedy": True},
        "machine": info,
        "engine": {k: v for k, v in engine.items() if k != "token_ids"},
        "hf_generate": {k: v for k, v in hf.items() if k != "token_ids"},
        "hf_generate_batch": hf_batch,
        "speedup_vs_best_transformers": engine["tokens_per_s"] / best,
        "sequences_identical_to_hf_generate": f"{same}/{len(prompts)}",
    }
    print(f"speedup vs the better transformers path: {result['speedup_vs_best_transformers']:.2f}x")
    print(json.dumps(result, indent=2))
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
