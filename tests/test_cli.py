"""The attn-stack command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from attn_jax.cli import build_parser, main
from attn_jax.platforms import current_platform
from attn_jax.selector import ENV_VAR


def test_info_default_request(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    p = current_platform()
    assert f"jax {jax.__version__}, jaxlib " in out
    assert f"platform: {p.kind}, device kind {p.device_kind!r}, {p.num_devices} device(s)" in out
    assert "head_size=128, dtype=bfloat16, kv_cache_dtype='auto', block_size=16" in out
    assert "attn_type='decoder'" in out
    for name in ("XLA", "PALLAS_TPU", "PALLAS_GPU"):
        assert name in out
    assert "attn_jax.backends.pallas_tpu.PallasTPUAttentionBackend" in out


def test_info_cpu_chooses_xla(capsys):
    if current_platform().kind != "cpu":
        pytest.skip("the default choice is checked on CPU")
    main(["info"])
    assert "chosen:     XLA (attn_jax.backends.xla.XLAAttentionBackend)" in capsys.readouterr().out


def test_info_says_which_kernel_serves_which_batches(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_STACK_BACKEND", "pallas_gpu")  # any case, as --backend takes it
    assert main(["info", "--head-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "PALLAS_GPU kernels on this device:" in out
    assert "decode and mixed batches: one Triton-lowered Pallas launch (pallas_triton)" in out
    assert "prefill batches: the Triton kernel" in out
    assert "cascade attention (PALLAS_GPU): when the running batch shares >= 256 tokens" in out
    assert "over >= 8 requests, without ALiBi, sliding window or chunked attention" in out


def test_info_says_when_the_tpu_builder_runs_cascade(capsys, monkeypatch):
    monkeypatch.setenv("ATTN_STACK_BACKEND", "PALLAS_TPU")
    assert main(["info"]) == 0
    assert "cascade attention (PALLAS_TPU): when the running batch shares >= 256 tokens" in capsys.readouterr().out


def test_info_other_request(capsys):
    argv = ["info", "--head-size", "64", "--dtype", "float16", "--kv-cache-dtype", "fp8_e5m2",
            "--block-size", "32", "--attn-type", "encoder_only", "--has-sink"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "head_size=64, dtype=float16, kv_cache_dtype='fp8_e5m2', block_size=32" in out
    assert "has_sink=True" in out and "attn_type='encoder_only'" in out
    assert "PALLAS_GPU" in out and "not in the priority list for platform cpu" in out


def test_info_selection_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "NOPE")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("attn-stack info: error: ATTN_STACK_BACKEND='NOPE' is not an attention backend.")
    valid = "XLA, PALLAS_TPU, PALLAS_GPU, XLA_MLA, PALLAS_MLA_TPU, PALLAS_MLA_GPU, CUSTOM"
    assert f"Valid options are (any case): {valid}" in err


def test_info_bad_head_size_exit_2(capsys):
    assert main(["info", "--head-size", "0"]) == 2
    assert capsys.readouterr().err == "attn-stack info: error: head_size=0 must be a positive integer\n"


def test_info_nothing_usable_prints_report_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "PALLAS_TPU")
    assert main(["info", "--head-size", "112"]) == 2
    captured = capsys.readouterr()
    assert "chosen:     none" in captured.out
    assert captured.err == "attn-stack info: error: no attention backend can serve this configuration (reasons above)\n"


def test_bad_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--kv-cache-dtype", "fp4"])
    assert e.value.code == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_parser_lists_info():
    assert "info" in build_parser().format_help()


def test_version(capsys):
    import attn_jax

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"attn-stack {attn_jax.__version__}\n"
    assert attn_jax.__version__ == importlib.metadata.version("attn-stack")


def test_help_has_no_raw_markup():
    for text in (build_parser().format_help(), *(p.format_help() for p in _subparsers())):
        assert "``" not in text and "usage: attn-stack" in text


def _subparsers():
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices.values())


@pytest.mark.parametrize("module", ["attn_jax", "attn_jax.cli"])
def test_python_dash_m_prints_help(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: attn-stack [-h] [--version] COMMAND")
    assert "generate" in result.stdout and "info" in result.stdout


def test_info_use_mla_chooses_an_mla_backend(capsys):
    if current_platform().kind != "cpu":
        pytest.skip("the default choice is checked on CPU")
    assert main(["info", "--use-mla", "--head-size", "576", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "use_mla=True" in out and "chosen:     XLA_MLA (attn_jax.backends.mla_xla.XLAMLABackend)" in out
    assert main(["info", "--use-mla", "--use-sparse", "--head-size", "576"]) == 0
    assert "use_sparse=True" in capsys.readouterr().out
    assert main(["info", "--use-mla", "--has-sink"]) == 2
    assert "XLA_MLA: attention sinks are not supported." in capsys.readouterr().out


def test_info_says_which_kernel_serves_mla_decodes_and_prefills(monkeypatch, capsys):
    from attn_jax.backends.mla_pallas import PallasMLAGPUBackend

    monkeypatch.setenv("ATTN_STACK_BACKEND", "PALLAS_MLA_GPU")
    assert main(["info", "--use-mla", "--head-size", "576", "--block-size", "64"]) == 0
    assert "PALLAS_MLA_GPU kernels on this device:" in capsys.readouterr().out
    h100 = PallasMLAGPUBackend.kernel_plan(576, jnp.bfloat16, "auto", 64, "NVIDIA H100 80GB HBM3")
    assert "in the Mosaic GPU prefill kernel (prefill_pallas_mosaic_gpu)" in h100[-1], h100
    assert "with >= 64 query heads the Mosaic GPU MLA decode kernel" in h100[0], h100
    assert "batches of >= 16 requests" in h100[0], h100
    a100 = PallasMLAGPUBackend.kernel_plan(576, jnp.bfloat16, "auto", 64, "NVIDIA A100-SXM4-80GB")
    assert "in the Triton kernel (the Mosaic GPU prefill needs Hopper" in a100[-1], a100
    assert "(the Mosaic GPU MLA decode needs Hopper)" in a100[0], a100
    fp8 = PallasMLAGPUBackend.kernel_plan(576, jnp.bfloat16, "fp8", 64, "NVIDIA H100 80GB HBM3")
    assert "Triton-lowered" in fp8[0] and "float8_e4m3fn" in fp8[0], fp8
    monkeypatch.setenv("ATTN_STACK_MGPU_MLA_DECODE", "0")
    assert "turned off" in PallasMLAGPUBackend.kernel_plan(576, jnp.bfloat16, "auto", 64, "NVIDIA H100 80GB HBM3")[0]
    monkeypatch.setenv("ATTN_STACK_MGPU_PREFILL", "0")
    assert "turned off" in PallasMLAGPUBackend.kernel_plan(576, jnp.bfloat16, "auto", 64, "NVIDIA H100 80GB HBM3")[-1]


def test_generate_and_serve_share_the_engine_flags_with_their_own_step_defaults():
    from attn_jax.cli import NUM_SCHEDULER_STEPS, SERVE_NUM_SCHEDULER_STEPS, build_parser

    parser = build_parser()
    flags = ["--backend", "XLA", "--devices", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    gen = parser.parse_args(["generate", *flags, "--no-prefix-caching"])
    serve = parser.parse_args(["serve", *flags, "--no-prefix-caching"])
    for args in (gen, serve):
        assert (args.backend, args.devices, args.max_num_seqs, args.max_num_batched_tokens) == ("XLA", 2, 4, 64)
        assert args.no_prefix_caching
    assert parser.parse_args(["generate"]).num_scheduler_steps == NUM_SCHEDULER_STEPS
    assert parser.parse_args(["serve"]).num_scheduler_steps == SERVE_NUM_SCHEDULER_STEPS


def test_memory_and_limit_flags(capsys):
    from attn_jax.cli import build_parser

    parser = build_parser()
    default = parser.parse_args(["serve"])
    assert default.max_num_seqs is None and default.max_num_batched_tokens is None  # the platform's defaults
    assert default.gpu_memory_utilization == 0.9 and default.kv_cache_memory is None
    for text, want in (("4GiB", 4 << 30), ("500MB", 500 * 10**6), ("1048576", 1 << 20), ("1.5kib", 1536)):
        assert parser.parse_args(["serve", "--kv-cache-memory", text]).kv_cache_memory == want
    assert parser.parse_args(["generate", "--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    assert parser.parse_args(["serve", "--max-request-bytes", "1MiB"]).max_request_bytes == 1 << 20
    assert parser.parse_args(["serve"]).max_request_bytes is None  # derived from --max-model-len
    for flag, bad, words in (
        ("--kv-cache-memory", "4 parsecs", "is not a size"), ("--kv-cache-memory", "0", "at least one byte"),
        ("--gpu-memory-utilization", "1.5", "must be in (0, 1]"), ("--gpu-memory-utilization", "x", "not a number"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, bad])
        assert words in capsys.readouterr().err


def test_serve_warmup_flags(capsys):
    from attn_jax.cli import build_parser

    parser = build_parser()
    default = parser.parse_args(["serve"])
    assert not default.no_warmup and default.warmup_max_shapes is None
    assert (
        not default.no_compilation_cache and parser.parse_args(["serve", "--no-compilation-cache"]).no_compilation_cache
    )
    args = parser.parse_args(["serve", "--no-warmup", "--warmup-max-shapes", "9"])
    assert args.no_warmup and args.warmup_max_shapes == 9
    assert parser.parse_args(["serve", "--warmup-max-shapes", "ALL"]).warmup_max_shapes == "all"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--warmup-sampling", "greedy"])  # sampling values compile nothing: no flag
    capsys.readouterr()
    for bad in ("0", "some"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--warmup-max-shapes", bad])
        assert "--warmup-max-shapes" in capsys.readouterr().err


def test_dtype_flag_resolves_auto_per_platform_and_checkpoint(tmp_path):
    """``--dtype auto``: float32 on a CPU; on an accelerator a checkpoint's stored 16-bit
    dtype, else bfloat16; other values as given, a bad one named with the valid ones."""
    import json

    from attn_jax.server.model_source import resolve_dtype
    from attn_jax.testing.models import TINY_RANDOM

    parser = build_parser()
    assert parser.parse_args(["serve"]).dtype == parser.parse_args(["generate"]).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dtype", "float64"])
    folders = {}
    for stored in ("float16", "bfloat16", "float32", None):
        folder = tmp_path / str(stored)
        folder.mkdir()
        config = {"model_type": "llama"} if stored is None else {"model_type": "llama", "torch_dtype": stored}
        (folder / "config.json").write_text(json.dumps(config))
        folders[stored] = str(folder)
    (tmp_path / "v5").mkdir()
    (tmp_path / "v5" / "config.json").write_text(json.dumps({"dtype": "float16"}))  # transformers 5's key
    for model in (*folders.values(), None, TINY_RANDOM):
        assert resolve_dtype("auto", model, "cpu")[0] == "float32"
        assert resolve_dtype("float16", model, "gpu") == ("float16", "--dtype")
    assert resolve_dtype("auto", folders["float16"], "gpu") == ("float16", "--dtype auto: the checkpoint's float16")
    assert resolve_dtype("auto", str(tmp_path / "v5"), "tpu")[0] == "float16"
    assert resolve_dtype("auto", folders["bfloat16"], "tpu")[0] == "bfloat16"
    for model in (folders["float32"], folders[None], None, TINY_RANDOM):
        assert resolve_dtype("auto", model, "gpu") == ("bfloat16", "--dtype auto on a GPU")
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; supported: \['auto', 'float32', 'bf"):
        resolve_dtype("int8", None, "gpu")


def test_an_engine_built_in_bfloat16_holds_bfloat16_weights():
    """``build_engine(dtype=...)``: the model computes in it and every floating weight is
    converted to it (tiny-random's are drawn in float32)."""
    from attn_jax.server.model_source import build_engine
    from attn_jax.testing.models import TINY_RANDOM

    engine = build_engine(TINY_RANDOM, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    assert engine.model.dtype == jnp.bfloat16
    dtypes = {str(x.dtype) for x in jax.tree.leaves(engine.runner.params)}
    assert dtypes == {"bfloat16"}, dtypes
