"""Cold start of ``attn-stack serve``: seconds from the command to ``/health`` answering 200.

Runs ``attn-stack serve --model DIR`` as a user would (its defaults: the warm-up compiles
every step program before the port opens) ``--runs`` times over one attn-stack cache
folder: the first from an empty JAX compilation cache, the next ones from what the first
left there. Each run records the seconds to a healthy server, the warm-up's own summary
line and the KV capacity line ``serve`` prints, then stops the server with SIGTERM.

``DIR`` is a Hugging Face checkpoint folder; ``--random-shape`` writes one instead (random
bfloat16 weights of a model shape, ``tokenizer.json`` from ``--tokenizer-dir``), so the GPU
machine, which has no network and no checkpoint, starts the server on the SmolLM2 shape::

    python benchmarks/serve_cold_start.py --random-shape smollm2-135m --tokenizer-dir /tmp/tok --out /tmp/cold.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.testing.models import MODEL_SHAPES


def write_random_checkpoint(folder: pathlib.Path, shape: str, tokenizer_dir: pathlib.Path, seed: int = 0) -> None:
    """A Llama checkpoint folder (``config.json``, ``model.safetensors`` in bfloat16,
    ``tokenizer.json``) of ``MODEL_SHAPES[shape]`` with random weights, readable by
    ``load_hf_checkpoint`` (the tensor names and [out, in] layout of transformers')."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from attn_jax.models.hf_checkpoint import _TENSOR_NAMES
    from attn_jax.models.llama import param_shapes

    c = MODEL_SHAPES[shape]()
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    tensors = {}
    for key, tensor_shape in param_shapes(c).items():
        if key == "lm_head" and c.tie_word_embeddings:
            continue
        template = _TENSOR_NAMES[key]
        names = [template.format(i=i) for i in range(c.num_layers)] if "{i}" in template else [template]
        for name in names:
            if key.endswith("norm"):
                value = np.ones(tensor_shape, np.float32)
            else:
                value = rng.standard_normal(tensor_shape, np.float32) * (tensor_shape[-1] ** -0.5)
            tensors[name] = value.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


_COMPILE_LOG = re.compile(
    r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation of) (\S+) .*?in ([0-9.]+) sec"
)
"""The phases JAX logs per compiled function under ``JAX_LOG_COMPILES=1``."""


def compile_log_totals(lines: list[str]) -> dict:
    """Seconds and counts of ``_device_step``'s logged compile phases (tracing, lowering to
    MLIR, XLA's compilation), summed over every program: what a cold start's threads did."""
    names = {"tracing": "trace", "jaxpr to MLIR module conversion": "lower", "XLA compilation of": "xla"}
    totals = {}
    for line in lines:
        match = _COMPILE_LOG.search(line)
        if match and "_device_step" in match.group(2):
            phase = totals.setdefault(names[match.group(1)], {"seconds": 0.0, "count": 0})
            phase["seconds"] += float(match.group(3))
            phase["count"] += 1
    return totals


def start_once(
    model_dir: pathlib.Path, cache_dir: pathlib.Path, port: int, extra: list[str], timeout_s: float,
    log_compiles: bool = False,
) -> dict:  # fmt: skip
    """One ``attn-stack serve`` from the command to ``/health`` (then SIGTERM): its seconds and
    the lines it printed about the model's dtype, the warm-up and the KV cache (with
    ``log_compiles``, also the step programs' summed compile phases, ``compile_log_totals``)."""
    env = {**os.environ, "ATTN_STACK_CACHE_DIR": str(cache_dir)}
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # serve's own cache folder, under cache_dir
    command = [sys.executable, "-m", "attn_jax", "serve", "--model", str(model_dir), "--port", str(port), *extra]
    log = tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = None
    try:
        while time.perf_counter() - start < timeout_s and process.poll() is None:
            if _healthy(port):
                seconds = time.perf_counter() - start
                break
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.seek(0)
    lines = log.read().splitlines()
    marks = ("weights and activations in", "warmed up", "KV cache", "Error")
    wanted = [line for line in lines if any(mark in line for mark in marks)]
    run = {"seconds_to_health": seconds, "exit_code": process.returncode, "lines": wanted, "tail": lines[-5:]}
    if log_compiles:
        run["compile_phases"] = compile_log_totals(lines)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=pathlib.Path, help="a Hugging Face checkpoint folder")
    source.add_argument("--random-shape", choices=sorted(MODEL_SHAPES), help="write a random checkpoint of this shape")
    parser.add_argument("--tokenizer-dir", type=pathlib.Path, help="tokenizer.json's folder (with --random-shape)")
    parser.add_argument("--runs", type=int, default=2, help="starts over one cache: the first cold, then warm")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on a start after this long")
    parser.add_argument(
        "--log-compiles", action="store_true",
        help="JAX_LOG_COMPILES=1 for the server: each run also sums its step programs' tracing, lowering and XLA time",
    )  # fmt: skip
    parser.add_argument("serve_args", nargs="*", help="more `attn-stack serve` arguments (after --)")
    add_output_args(parser, "serve_cold_start.json")
    args = parser.parse_args()
    if args.random_shape and args.tokenizer_dir is None:
        parser.error("--random-shape needs --tokenizer-dir (a folder with tokenizer.json)")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = scratch / args.random_shape
            write_random_checkpoint(model_dir, args.random_shape, args.tokenizer_dir)
        runs = []
        for i in range(args.runs):
            run = start_once(
                model_dir, scratch / "cache", args.port, args.serve_args, args.timeout_s, args.log_compiles
            )
            run["cache"] = "empty" if i == 0 else "warm"
            runs.append(run)
            print(json.dumps(run), flush=True)
    import jax

    result = {
        "benchmark": "serve_cold_start",
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": str(args.model_dir or f"random {args.random_shape}, bfloat16"),
        "serve_args": args.serve_args,
        "runs": runs,
    }
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
