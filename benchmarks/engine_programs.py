"""How many step programs the engine can meet, and how long compiling them all takes.

For each (max_num_seqs, max_num_batched_tokens) given (default: the platform's defaults,
and 64 x 2048), ``Engine.warmup(max_shapes=0)`` counts the programs without compiling any;
``--warmup`` then compiles every one at the platform's defaults, as ``attn-stack serve``
does before it listens, ``--workers`` threads at once (with ``--compilation-cache DIR``:
through JAX's persistent cache, so a second run times a warm start; with ``--executable-cache DIR``
as well, as ``attn-stack serve`` compiles). Model: a shape of random weights (``--model``).

    python benchmarks/engine_programs.py --limits 256x2048 64x2048 --warmup --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time

import jax
from results_io import add_output_args, output_path, write_json  # benchmarks/, the script's folder

from attn_jax.models.llama import LlamaModel
from attn_jax.serving import Engine
from attn_jax.testing.models import MODEL_SHAPES, random_params


def _limits(text: str) -> tuple[int, int]:
    seqs, tokens = text.lower().split("x")
    return int(seqs), int(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--limits", type=_limits, nargs="*", default=[(64, 2048)], help="SEQSxTOKENS pairs")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--warmup", action="store_true", help="compile every program at the platform's defaults")
    parser.add_argument("--workers", type=int, default=None, help="compile threads (default: Engine.warmup's)")
    parser.add_argument("--compilation-cache", default=None, metavar="DIR", help="JAX's persistent cache folder")
    parser.add_argument(
        "--executable-cache", default=None, metavar="DIR", help="the warm-up's executable cache (as serve keeps one)"
    )
    add_output_args(parser, "engine_programs_{model}.json")
    args = parser.parse_args()
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = MODEL_SHAPES[args.model]()
    dtype = jax.numpy.dtype(args.dtype)
    params = random_params(config, dtype)
    kwargs = dict(max_model_len=args.max_model_len, num_scheduler_steps=args.num_scheduler_steps)
    counts = []
    for seqs, tokens in [(None, None), *args.limits]:
        start = time.perf_counter()
        engine = Engine(
            LlamaModel(config, block_size=16, dtype=dtype), params, max_num_seqs=seqs, max_num_batched_tokens=tokens,
            **kwargs,
        )  # fmt: skip
        report = engine.warmup(max_shapes=0)
        row = {
            "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
            "programs": report.num_skipped, "probes": report.num_probes, "seconds": time.perf_counter() - start,
            "backend": engine.model.attn_backend.get_name(), "kv_cache": engine.kv_cache_summary(),
        }  # fmt: skip
        counts.append(row)
        print(json.dumps(row), flush=True)
        del engine
        gc.collect()  # the engine's caches go before the next one sizes its own
    warmup = None
    if args.warmup:
        engine = Engine(LlamaModel(config, block_size=16, dtype=dtype), params, **kwargs)
        start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if done % 5 == 0 or done == total:
                print(f"compiled {done} of {total} programs in {time.perf_counter() - start:.1f} s", flush=True)

        report = engine.warmup(progress=progress, workers=args.workers, executable_cache=args.executable_cache)
        warmup = {
            "summary": report.summary(), "programs": report.num_shapes, "seconds": report.seconds,
            "workers": report.workers,
        }  # fmt: skip
        print(report.summary(), flush=True)
    result = {
        "model": args.model, "dtype": args.dtype, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "compilation_cache":
        args.compilation_cache, "executable_cache": args.executable_cache, "counts": counts, "warmup": warmup,
    }  # fmt: skip
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
