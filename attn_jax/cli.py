"""The ``attn-stack`` command line: ``generate``, ``serve`` and ``info`` (also ``python -m attn_jax``).

``attn-stack generate`` runs prompts concurrently through the serving engine on the
embedded SmolLM2-135M-Instruct (or ``--model PATH``: a Llama GGUF, or a Hugging Face
checkpoint folder of a Llama, Mistral or Qwen2 model) and prints each
continuation, prefill and decode tokens/s, and the attention backend chosen with why.
``attn-stack serve`` serves the same models over an OpenAI-compatible HTTP API
(``attn_jax.server``; the ``serve`` extra). ``attn-stack info`` prints the JAX versions,
the platform and why each attention backend would or would not serve a request
(default: head_size 128, bfloat16).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from attn_jax import __version__
from attn_jax.types import ACTIVATION_DTYPES, CACHE_DTYPES, SEED_LIMIT, AttentionType


def _add_selection_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``get_attn_backend``, shared by every subcommand that selects one."""
    parser.add_argument("--head-size", type=int, default=128, help="per-head dimension D (default: 128)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=[str(d) for d in ACTIVATION_DTYPES],
        help="activation dtype (default: bfloat16)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=CACHE_DTYPES, help="KV cache dtype (default: auto)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache page (default: 16)")
    parser.add_argument(
        "--attn-type",
        default=AttentionType.DECODER.value,
        choices=[t.value for t in AttentionType],
        help="attention type (default: decoder)",
    )
    parser.add_argument("--has-sink", action="store_true", help="the layer has attention sinks")


def _cmd_info(args: argparse.Namespace) -> int:
    """Prints the JAX versions, the platform and the backend selection report."""
    import jax
    import jaxlib

    from attn_jax.platforms import current_platform
    from attn_jax.selector import explain_attn_backend_selection

    platform = current_platform()
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    print(f"platform: {platform.kind}, device kind {platform.device_kind!r}, {platform.num_devices} device(s)")
    print()
    try:
        report = explain_attn_backend_selection(
            args.head_size,
            args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            has_sink=args.has_sink,
            attn_type=args.attn_type,
            use_mla=args.use_mla,
            use_sparse=args.use_sparse,
            platform=platform,
            query_quant=args.query_quant,
        )
    except ValueError as e:
        return _error(args, e)
    print(report.format())
    if report.chosen is None:
        return _error(args, "no attention backend can serve this configuration (reasons above)")
    kernel_plan = getattr(report.chosen.get_class(), "kernel_plan", None)
    if kernel_plan is not None:  # backends with several kernels say which serves which batches
        print()
        print(f"{report.chosen.name} kernels on this device:")
        for line in kernel_plan(
            args.head_size, args.dtype, args.kv_cache_dtype, args.block_size, platform.device_kind,
            causal=AttentionType(args.attn_type).is_causal, has_sink=args.has_sink,
            **({"query_quant": True} if args.query_quant else {}),
        ):  # fmt: skip
            print(f"  {line}")
    print()
    print(f"cascade attention ({report.chosen.name}): {report.chosen.get_class().get_builder_cls().cascade_summary()}")
    return 0


DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
)
"""What ``attn-stack generate`` continues when no ``--prompt`` is given."""

MAX_MODEL_LEN = 2048
"""Prompt + new tokens per request: ``attn-stack serve``'s default, and ``attn-stack generate``'s
cap on its default (the model's context length or this, whichever is smaller)."""

WARMUP_TOKENS = 2
"""New tokens per request of the warm-up generation: a prefill step and a decode step."""

NUM_SCHEDULER_STEPS = 8
"""Decode steps per device call in ``attn-stack generate`` (the engine's multi-step
decoding): on an H100 it took SmolLM2 at batch 1 from 635 to 1093 tokens/s (BENCHMARKS.md)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def check_mesh_args(args: argparse.Namespace) -> None:
    """ValueError naming a bad --devices, or a --model-parallel that does not fit them."""
    from attn_jax.sharding import check_num_devices

    check_num_devices(args.devices)
    m = args.model_parallel
    if m is not None and (args.devices % m or (m > 1 and args.devices == 1)):
        raise ValueError(f"--model-parallel {m} must divide --devices {args.devices} (and needs --devices > 1)")


def _mesh_kwargs(args: argparse.Namespace) -> dict:
    """``build_engine``'s mesh keywords from --devices / --model-parallel."""
    if args.devices == 1:
        return {}
    return dict(devices=args.devices, model_parallel=args.model_parallel)


MODEL_DTYPE_CHOICES = ("auto", *(str(d) for d in ACTIVATION_DTYPES))
"""``--dtype`` of ``generate`` and ``serve`` (``model_source.resolve_dtype``)."""


def _model_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """``(dtype, why)`` for ``--dtype`` and ``--model`` on this process's platform."""
    from attn_jax.platforms import current_platform
    from attn_jax.server.model_source import resolve_dtype

    return resolve_dtype(args.dtype, args.model, current_platform().kind)


def _add_engine_args(parser: argparse.ArgumentParser, *, num_scheduler_steps: int) -> None:
    """The engine's flags, shared by ``generate`` and ``serve`` (which differ only in the
    default number of decode steps per device call)."""
    parser.add_argument("--backend", default=None, help="force an attention backend, e.g. XLA (default: selected)")
    parser.add_argument(
        "--dtype", default="auto", choices=MODEL_DTYPE_CHOICES,
        help="weights and activations (default: auto: float32 on a CPU; on a GPU or TPU the checkpoint's float16 "
        "or bfloat16, else bfloat16)",
    )  # fmt: skip
    parser.add_argument(
        "--devices", type=int, default=1,
        help="devices to shard over (requests over a data axis, heads over a model axis); default 1",
    )  # fmt: skip
    parser.add_argument(
        "--model-parallel", type=_positive_int, default=None, metavar="M",
        help="the model axis of --devices (tensor parallel; the rest split requests); default: the KV heads' "
        "largest share of the devices",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-seqs", type=_positive_int, default=None,
        help="requests per step, the step's request slots (default: 256 on a GPU or TPU, 8 on a CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=_positive_int, default=None,
        help="token budget per step; longer prompts are prefilled in chunks (default: 2048 on a GPU or TPU, "
        "256 on a CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization", type=_fraction, default=0.9,
        help="share of the accelerator's memory pool the engine fills; the KV cache takes what the weights and "
        "a step's activations leave (default: 0.9; no effect on a CPU, whose cache is 256 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-memory", type=_bytes, default=None, metavar="BYTES",
        help="the KV cache's size instead (per data shard), e.g. 4GiB or 500MB: a device shared with others",
    )  # fmt: skip
    parser.add_argument(
        "--num-scheduler-steps", type=_positive_int, default=num_scheduler_steps,
        help=f"decode steps per device call once every request decodes (default: {num_scheduler_steps})",
    )  # fmt: skip
    parser.add_argument(
        "--no-prefix-caching", action="store_true",
        help="turn automatic prefix caching off (default: on; a prompt's cached full blocks are not recomputed)",
    )  # fmt: skip


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes(text: str) -> int:
    """A size such as ``4GiB``, ``500MB`` or ``1048576`` in bytes."""
    number = text.strip().lower().rstrip("bikmg")
    unit = text.strip().lower()[len(number) :]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes with an optional unit, one of {[u for u in _BYTE_UNITS if u]}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one byte")
    return int(value)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number of seconds >= 0")
    return value


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt", action="append", default=None, metavar="TEXT",
        help="a prompt (repeatable); its raw text is continued unless --chat. Default: a few built-in prompts",
    )  # fmt: skip
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens per prompt (default: 32)")
    parser.add_argument(
        "--max-model-len", type=_positive_int, default=None,
        help=f"prompt + new tokens per request (default: the model's context length or {MAX_MODEL_LEN}, "
        "whichever is smaller)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    parser.add_argument(
        "--seed", type=int, default=0,
        help="sampling seed in [0, 2**32); prompt i uses (seed + i) mod 2**32 (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true",
        help="print one JSON object instead of text (text is streamed as generated when stdout is a terminal)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=None, metavar="PATH",
        help="a Llama GGUF file or a Hugging Face checkpoint folder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, "
        "Gemma 3 text safetensors); default: embedded SmolLM2",
    )  # fmt: skip
    _add_engine_args(parser, num_scheduler_steps=NUM_SCHEDULER_STEPS)


def _throughput(totals) -> dict:
    """Prefill and decode tokens/s over the calls that compiled nothing (``EngineTotals``
    of the run: each call timed from its dispatch to its tokens being read back).

    A call with any prefill tokens counts as prefill time; decode tokens/s is over the
    calls with only decodes."""
    return {
        "prefill_tokens": totals.prefill_tokens,
        "prefill_tokens_per_s": totals.prefill_tokens_per_s,
        "decode_tokens_per_s": totals.decode_tokens_per_s,
        "steps": totals.steps,
        "prefix_cache_queried_tokens": totals.prefix_cache_queried_tokens,
        "prefix_cache_hit_tokens": totals.prefix_cache_hit_tokens,
        "mean_host_ms_per_step": totals.mean_host_ms_per_step,
    }


def _check_sampling_args(args: argparse.Namespace) -> str | None:
    """The first sampling flag out of its range, as a one-line message naming the flag; None if all are fine."""
    if not 0 <= args.seed < SEED_LIMIT:
        return f"--seed {args.seed} is outside [0, 2**32): give an integer from 0 to {SEED_LIMIT - 1}"
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if not math.isfinite(value):
            return f"{flag} {value} is not a finite number"
    if args.temperature < 0:
        return f"--temperature {args.temperature} must be >= 0 (0 = greedy)"
    if not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p} must be in (0, 1] (1 = off)"
    if args.top_k < 0:
        return f"--top-k {args.top_k} must be >= 0 (0 = off)"
    return None


def _warm_up(engine, prompt_ids: list[list[int]], args: argparse.Namespace) -> None:
    """Compiles the step for this run's shapes with a throwaway generation of at most
    ``WARMUP_TOKENS`` tokens per prompt (each prompt cut to one step's token budget), so the
    user's generation runs once, warm. Steps of it that still compile (a longer context's
    page bucket, a later prefill chunk's) are left out of the rates."""
    from attn_jax.serving import SamplingParams

    warm = SamplingParams(
        max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens), temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=0, ignore_eos=True,
    )  # fmt: skip
    for ids in prompt_ids:
        engine.add_request(ids[: engine.max_num_batched_tokens], warm)
    for _ in engine.stream():
        pass


def _run_streaming(engine, ids: list[str], prompts: list[str], args: argparse.Namespace) -> None:
    """Runs the requests to completion, showing each one's latest text as it is generated
    (a live region on stdout, one line per request, cleared at the end)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    shown = {i: ("" if args.chat else p) for i, p in zip(ids, prompts, strict=True)}
    done = dict.fromkeys(ids, 0)
    start = time.perf_counter()
    console = Console()

    def render():
        lines = []
        for n, i in enumerate(ids):
            label = f"[{n + 1}] "
            last = shown[i].rstrip("\n").rsplit("\n", 1)[-1]
            room = max(console.width - len(label) - 1, 8)
            if len(last) > room:  # the newest text, not the line's start
                last = "…" + last[-(room - 1) :]
            lines.append(Text.assemble((label, "bold"), last, no_wrap=True, overflow="crop"))
        total = len(ids) * args.max_new_tokens
        status = f"generating: {sum(done.values())}/{total} tokens, {time.perf_counter() - start:.1f} s"
        return Group(*lines, Text(status, style="dim"))

    with Live(get_renderable=render, console=console, refresh_per_second=10, transient=True):
        for event in engine.stream():
            shown[event.request_id] += event.text
            done[event.request_id] = args.max_new_tokens if event.finished else done[event.request_id] + 1


def _run_with_progress(engine, progress, num_requests: int, args: argparse.Namespace) -> None:
    """Runs the requests to completion with a progress bar (stderr)."""
    task = progress.add_task(f"generating ({num_requests} requests)", total=num_requests * args.max_new_tokens)
    for event in engine.stream():
        progress.advance(task)
        if event.finished:  # stopped early: the bar counts its unused tokens as done
            left = args.max_new_tokens - len(engine.get_request(event.request_id).output_ids)
            progress.advance(task, left)


def _cmd_generate(args: argparse.Namespace) -> int:
    """Generates continuations of prompts with the serving engine.

    The model loads (progress on stderr), a short warm-up generation compiles the step,
    then the prompts run once, concurrently; on a terminal their text shows as it is
    generated. Rates leave out steps that compiled."""
    prompts = list(DEFAULT_PROMPTS) if args.prompt is None else args.prompt
    for i, p in enumerate(prompts):
        if not p.strip():
            return _error(args, f"--prompt number {i + 1} is empty: give some text to continue")
    bad = _check_sampling_args(args)
    if bad is not None:
        return _error(args, bad)
    try:
        from attn_jax.serving import SamplingParams

        params = [
            SamplingParams(
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=(args.seed + i) % SEED_LIMIT,
            )  # fmt: skip
            for i in range(len(prompts))
        ]
    except ValueError as e:
        return _error(args, e)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from attn_jax.models.gguf_loader import ModelLoadError
    from attn_jax.selector import explain_attn_backend_selection, global_force_attn_backend_context_manager
    from attn_jax.server.model_source import build_engine
    from attn_jax.sharding import describe_mesh

    try:
        check_mesh_args(args)
        forced = _forced_backend(args.backend)
    except ValueError as e:
        return _error(args, e)
    if args.max_model_len is not None and args.max_new_tokens >= args.max_model_len:  # before loading anything
        return _error(
            args,
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: --max-model-len {args.max_model_len}",
        )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    columns += (TimeElapsedColumn(),)

    def progress_bar():  # nothing at all when stderr is not a terminal
        console = Console(stderr=True)
        return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)

    stream = not args.json and sys.stdout.isatty()
    force = global_force_attn_backend_context_manager(forced) if forced is not None else contextlib.nullcontext()
    with force:
        try:
            with progress_bar() as progress:
                tasks: dict[str, int] = {}

                def on_load(stage: str, done: int, total: int) -> None:
                    label = {"weights": "loading weights", "tokenizer": "loading tokenizer"}[stage]
                    if stage not in tasks:
                        tasks[stage] = progress.add_task(label, total=total)
                    progress.update(tasks[stage], completed=done)

                engine_kwargs = dict(
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_memory,
                    max_model_len=args.max_model_len, seed=args.seed, num_scheduler_steps=args.num_scheduler_steps,
                    enable_prefix_caching=not args.no_prefix_caching,
                )  # fmt: skip
                dtype, dtype_why = _model_dtype(args)
                engine = build_engine(
                    args.model, dtype=dtype, progress=on_load, **_mesh_kwargs(args), **engine_kwargs
                )  # fmt: skip
                mla = getattr(engine.model.config, "kv_lora_rank", None)  # DeepSeek: the latent row's width
                report = explain_attn_backend_selection(
                    engine.model.config.head_dim if mla is None else mla + engine.model.config.qk_rope_head_dim,
                    engine.model.dtype, block_size=engine.block_size, use_mla=mla is not None,
                )  # fmt: skip
                max_model_len = engine.max_model_len  # --max-model-len's default: the model's context, capped
                if args.max_new_tokens >= max_model_len:
                    raise ValueError(
                        f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt: max_model_len="
                        f"{max_model_len} (the model's context length, at most {MAX_MODEL_LEN}; see --max-model-len)"
                    )
                prompt_ids = [engine.encode(p, chat=args.chat) for p in prompts]
                for i, p_ids in enumerate(prompt_ids):  # before compiling anything
                    if len(p_ids) + args.max_new_tokens > max_model_len:
                        raise ValueError(
                            f"--prompt number {i + 1} has {len(p_ids)} tokens: with --max-new-tokens "
                            f"{args.max_new_tokens} that exceeds max_model_len={max_model_len}"
                        )
                progress.add_task(f"compiling the step (a {WARMUP_TOKENS}-token warm-up generation)", total=None)
                _warm_up(engine, prompt_ids, args)
                engine.reset_prefix_cache()  # the user's prompts are not served from the warm-up's blocks
            compilations, warm_totals = engine.num_compilations, engine.totals
            ids = [engine.add_request(p_ids, sp) for p_ids, sp in zip(prompt_ids, params, strict=True)]
            start = time.perf_counter()
            if stream:
                _run_streaming(engine, ids, prompts, args)
            else:
                with progress_bar() as progress:
                    _run_with_progress(engine, progress, len(ids), args)
            wall = time.perf_counter() - start
        except (ModelLoadError, ValueError, FileNotFoundError) as e:
            return _error(args, e)

    completions = [engine.completion(i) for i in ids]
    stats = _throughput(engine.totals - warm_totals)
    ttfts = [c.ttft_seconds for c in completions if c.ttft_seconds is not None]
    stats["mean_ttft_seconds"] = sum(ttfts) / len(ttfts) if ttfts else None
    stats["generated_tokens"] = sum(len(c.output_ids) for c in completions)  # not those computed past EOS
    stats["wall_seconds"] = wall
    stats["compilations_in_warmup"] = compilations
    stats["compilations_after_warmup"] = engine.num_compilations - compilations
    backend = engine.model.attn_backend.get_name()
    why = report.decided_by
    if args.json:
        out = {
            "model": engine.model.config.name,
            "backend": backend,
            "backend_reason": why,
            "dtype": dtype,
            "devices": args.devices,
            "max_model_len": engine.max_model_len,
            "results": [
                {
                    "prompt": p,
                    "text": c.text,
                    "token_ids": c.output_ids,
                    "num_prompt_tokens": len(c.prompt_ids),
                    "finish_reason": c.finish_reason,
                }  # fmt: skip
                for p, c in zip(prompts, completions, strict=True)
            ],
            "stats": stats,
        }
        print(json.dumps(out, indent=2))
        return 0
    config = engine.model.config
    print(f"model: {config.name} ({config.num_layers} layers, {dtype}: {dtype_why}), devices: {args.devices}")
    if engine.mesh is not None:
        print(describe_mesh(engine.mesh, engine.model.config))
    print(f"attention backend: {backend} ({why})")
    for row in report.rows:
        if row.name != backend:
            reason = "; ".join(row.reasons) if row.reasons else "usable, lower priority"
            print(f"  not {row.name}: {reason}")
    for p, c in zip(prompts, completions, strict=True):
        print()
        print(f"--- {p!r} ({len(c.prompt_ids)} prompt tokens, {len(c.output_ids)} new, {c.finish_reason})")
        print(p + c.text if not args.chat else c.text)
    print()

    def rate(x):
        return "n/a" if x is None else f"{x:.1f} tokens/s"

    ttft = "n/a" if stats["mean_ttft_seconds"] is None else f"{1e3 * stats['mean_ttft_seconds']:.1f} ms"

    print(
        f"prefill: {rate(stats['prefill_tokens_per_s'])}, decode: {rate(stats['decode_tokens_per_s'])}, "
        f"time to first token: {ttft} ({stats['generated_tokens']} tokens in {stats['steps']} steps, {wall:.2f} s, "
        f"{stats['mean_host_ms_per_step']:.2f} ms host time per step; {compilations} step compilations in "
        f"the warm-up, {stats['compilations_after_warmup']} during the run, left out of the rates)"
    )
    if engine.enable_prefix_caching:
        queried, hits = stats["prefix_cache_queried_tokens"], stats["prefix_cache_hit_tokens"]
        print(f"prefix cache: {hits} of {queried} prompt tokens found cached ({hits / max(queried, 1):.0%})")
    return 0


SERVE_NUM_SCHEDULER_STEPS = 8
"""Decode steps per device call in ``attn-stack serve`` once every running request decodes
and none waits for room (the engine's multi-step decoding): the host's scheduling and
dispatch are paid once per 8 tokens. Each token still streams as its own chunk (the 8
arrive together); stop strings and max_tokens end a request at its exact token; a request
that arrives meanwhile is admitted at the next call, at most 8 decode steps later."""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: give 0 to 65535")
    return value


def _max_shapes(text: str) -> int | str:
    if text.strip().lower() == "all":
        return "all"
    return _positive_int(text)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, metavar="PATH",
        help="a Llama GGUF (default: embedded SmolLM2), a Hugging Face checkpoint directory where this build "
        "loads them, or 'tiny-random' (a 2-layer random model for tests)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000)")
    parser.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the name clients pass as 'model' (default: the model file's name)",
    )  # fmt: skip
    _add_engine_args(parser, num_scheduler_steps=SERVE_NUM_SCHEDULER_STEPS)
    parser.add_argument(
        "--max-model-len", type=_positive_int, default=MAX_MODEL_LEN,
        help=f"prompt + completion tokens per request (default: {MAX_MODEL_LEN})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="draws the seeds of requests that give none (default: 0)")
    parser.add_argument(
        "--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
        help="on SIGTERM / SIGINT, in-flight requests run this long, then end (finish reason 'abort') and the "
        "process exits 0 (default: 30)",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-bytes", type=_bytes, default=None, metavar="BYTES",
        help="the largest request body taken; larger ones are 413s before anything is parsed or tokenized "
        "(default: 32 bytes per token of --max-model-len and 64 KiB)",
    )  # fmt: skip
    parser.add_argument(
        "--api-server-count", type=_positive_int, default=None, metavar="N",
        help="HTTP processes over the one engine process, sharing --port (SO_REUSEPORT; Linux): each parses its "
        "share of the requests and streams its share of the tokens (vLLM's --api-server-count; default: 1 on the "
        "CPU, on an accelerator one per 4 of the host's cores, at most 4)",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: info)",
    )  # fmt: skip
    parser.add_argument(
        "--no-warmup", action="store_true",
        help="listen at once, compiling each step shape when traffic first meets it (default: compile every "
        "shape first; the port opens after)",
    )  # fmt: skip
    parser.add_argument(
        "--no-compilation-cache", action="store_true",
        help="compile every step program afresh (default: JAX's persistent compilation cache in "
        "$ATTN_STACK_CACHE_DIR/jax-compilation, or JAX_COMPILATION_CACHE_DIR when set, and the compiled step "
        "programs in the same folder name with -executables, so a restart loads them without tracing)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-max-shapes", type=_max_shapes, default=None, metavar="N|all",
        help="compile at most N step programs before listening, the likeliest first (default: all of them, a few "
        "dozen at the defaults, fixed by the engine's limits; sampling values never add one)",
    )  # fmt: skip


def _forced_backend(name: str | None):
    """``--backend``'s ``AttentionBackendEnum`` member (None: selected); ValueError naming the valid ones."""
    from attn_jax.registry import AttentionBackendEnum

    return None if name is None else AttentionBackendEnum[name.strip().upper()]


def _serve_engine(args: argparse.Namespace):
    """(In the engine process.) The engine ``attn-stack serve`` serves, warmed up; prints
    its progress and, last, what is served where. ValueError / OSError for a model or a
    flag it cannot take."""

    from attn_jax.selector import global_force_attn_backend_context_manager
    from attn_jax.server.model_source import build_engine, default_served_name
    from attn_jax.sharding import describe_mesh

    check_mesh_args(args)
    forced = _forced_backend(args.backend)
    executables = None
    if not args.no_compilation_cache:
        from attn_jax.cache_dir import enable_compilation_cache, executable_cache_dir

        folder = enable_compilation_cache()
        executables = executable_cache_dir(folder)
        print(
            f"attn-stack serve: compilation cache {folder}, compiled step programs {executables}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    force = global_force_attn_backend_context_manager(forced) if forced is not None else contextlib.nullcontext()
    dtype, dtype_why = _model_dtype(args)
    print(f"attn-stack serve: weights and activations in {dtype} ({dtype_why})", file=sys.stderr, flush=True)
    with force:
        engine = build_engine(
            args.model, dtype=dtype, **_mesh_kwargs(args), max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            seed=args.seed, num_scheduler_steps=args.num_scheduler_steps,
            enable_prefix_caching=not args.no_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_bytes=args.kv_cache_memory,
        )  # fmt: skip
        if engine.mesh is not None:
            print(f"attn-stack serve: {describe_mesh(engine.mesh, engine.model.config)}", file=sys.stderr, flush=True)
        print(
            f"attn-stack serve: {engine.kv_cache_summary()}; {engine.max_num_seqs} request slots, "
            f"{engine.max_num_batched_tokens} tokens per step",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        if not args.no_warmup:
            start = time.perf_counter()

            def progress(done: int, total: int) -> None:
                if done == 1 or done == total or done % 25 == 0:
                    print(
                        f"attn-stack serve: compiled {done} of {total} step programs before listening "
                        f"({time.perf_counter() - start:.0f} s; --warmup-max-shapes N|all sets how many, --no-warmup "
                        "skips them)",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip

            max_shapes = None if args.warmup_max_shapes in (None, "all") else args.warmup_max_shapes
            report = engine.warmup(max_shapes=max_shapes, progress=progress, executable_cache=executables)
            print(f"attn-stack serve: {report.summary()}", file=sys.stderr, flush=True)
    name = args.served_model_name or default_served_name(args.model)
    print(
        f"attn-stack serve: {name!r} ({engine.model.config.num_layers} layers, attention backend "
        f"{engine.model.attn_backend.get_name()}, max_model_len {engine.max_model_len}) at "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return engine


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serves a model over an OpenAI-compatible HTTP API.

    Routes: /v1/models, /v1/completions, /v1/chat/completions (streaming with
    "stream": true), /health and /metrics (Prometheus). The engine runs in a process of
    its own, the HTTP server in this one. The model loads first, then every step shape
    the engine can meet is compiled (unless --no-warmup); the server listens once both
    are done, so no compilation stalls traffic."""
    try:
        from attn_jax.server.api_servers import ApiServers, listening_sockets, start_engine
        from attn_jax.server.app import build_app
        from attn_jax.server.engine_process import EngineStartError
        from attn_jax.server.gc_heap import freeze_startup_heap
        from attn_jax.server.model_source import default_served_name
        from attn_jax.server.uvicorn_server import EarlySignals, serve
    except ImportError as e:
        return _error(args, f"{e.name or e} is missing: install the serve extra, pip install 'attn-stack[serve]'")
    if not 0 <= args.seed < SEED_LIMIT:
        return _error(args, f"--seed {args.seed} is outside [0, 2**32): give an integer from 0 to {SEED_LIMIT - 1}")
    try:  # checked here, before a process starts; the engine process forces it
        _forced_backend(args.backend)
    except ValueError as e:
        return _error(args, e)
    try:
        engine, count = start_engine(functools.partial(_serve_engine, args), args.api_server_count)
    except EngineStartError as e:
        return _error(args, e)
    name = args.served_model_name or default_served_name(args.model)
    servers = sockets = early_signals = None
    try:
        app = build_app(engine, name, max_request_bytes=args.max_request_bytes)
        if count > 1:
            early_signals = EarlySignals()  # the others may answer /health, and so draw a SIGTERM, before this one
            try:
                sockets = listening_sockets(args.host, args.port, count)
            except (OSError, ValueError) as e:
                return _error(args, f"--host {args.host} --port {args.port}: {e}")
            print(
                f"attn-stack serve: {count} HTTP processes share port {args.port}"
                + (" (--api-server-count's default on this host)" if args.api_server_count is None else ""),
                file=sys.stderr, flush=True,
            )  # fmt: skip
            servers = ApiServers(
                engine, sockets, served_model_name=name, max_request_bytes=args.max_request_bytes,
                log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
            )  # fmt: skip
        freeze_startup_heap()  # this process's too: it is the server's own
        serve(
            app, host=args.host, port=args.port, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
            sockets=sockets[:1] if sockets else None, on_exit=servers.stop if servers else None,
            early_signals=early_signals,
        )  # fmt: skip
    finally:
        if servers is not None:
            servers.stop()
            servers.join(args.shutdown_timeout + 10.0)
        engine.join(0)
    return 0


def _error(args: argparse.Namespace, message: object) -> int:
    """Prints a one-line error to stderr; returns exit code 2."""
    print(f"attn-stack {args.command}: error: {message}", file=sys.stderr)
    return 2


DESCRIPTION = (
    "attn-stack: ragged paged attention for LLM serving. 'generate' serves the embedded "
    "SmolLM2-135M-Instruct (or a Llama GGUF) through the serving engine; 'serve' puts it behind "
    "an OpenAI-compatible HTTP API; 'info' explains "
    "which attention backend would serve a layer, and why."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``attn-stack`` parser; each subcommand sets ``func(args) -> exit code``."""
    parser = argparse.ArgumentParser(
        prog="attn-stack", description=DESCRIPTION, epilog="Also runs as: python -m attn_jax COMMAND ..."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate", help="generate text with the serving engine (embedded SmolLM2-135M-Instruct)",
        description=_cmd_generate.__doc__,
    )  # fmt: skip
    _add_generate_args(generate)
    generate.set_defaults(func=_cmd_generate)
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the serving engine", description=_cmd_serve.__doc__
    )
    _add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)
    info = commands.add_parser(
        "info", help="versions, platform and attention backend selection", description=_cmd_info.__doc__
    )
    _add_selection_args(info)
    info.add_argument("--use-mla", action="store_true", help="a multi-head latent attention (MLA) layer")
    info.add_argument("--use-sparse", action="store_true", help="sparse attention over top-k positions (with MLA)")
    info.add_argument(
        "--query-quant", action="store_true",
        help="FP8 attention: the query quantised to e4m3 against an fp8 cache (with --kv-cache-dtype fp8)",
    )  # fmt: skip
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``attn-stack``; returns the exit code (2 for a usage or selection error).

    Example: ``main(["info", "--head-size", "64", "--kv-cache-dtype", "fp8"])``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    from attn_jax.distributed import initialize_from_env, is_main_process

    try:  # one of several processes started by `python -m attn_jax.launch`: join the others first
        joined = initialize_from_env()
    except ValueError as e:
        return _error(args, e)
    if joined and not is_main_process():  # every process runs the work; process 0 prints it
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return args.func(args)
    return args.func(args)


if __name__ == "__main__":  # python -m attn_jax.cli
    sys.exit(main())
