"""Backend selection: precedence, errors that list reasons, caching, explain reports."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax import selector
from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend
from attn_jax.backends.pallas_tpu import PallasTPUAttentionBackend
from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.metadata import get_kv_cache_layout, set_kv_cache_layout
from attn_jax.platforms import Platform
from attn_jax.registry import AttentionBackendEnum, register_backend
from attn_jax.selector import (
    ENV_VAR,
    explain_attn_backend_selection,
    get_attn_backend,
    get_global_forced_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)

ABE = AttentionBackendEnum
CPU = Platform("cpu", "cpu", 1)
TPU = Platform("tpu", "TPU v5 lite", 4)
GPU = Platform("gpu", "NVIDIA H100 80GB HBM3", 8)

PALLAS_AND_MLA = ["XLA", "PALLAS_TPU", "PALLAS_GPU", "XLA_MLA", "PALLAS_MLA_TPU", "PALLAS_MLA_GPU"]


class MLABackend(XLAAttentionBackend):
    """XLA, plus MLA: a backend only a registration can make selectable."""

    supports_mla = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"


class HNDBackend(XLAAttentionBackend):
    @staticmethod
    def get_required_kv_cache_layout() -> str | None:
        return "HND"


class NotABackend:
    pass


class SizedBackend(XLAAttentionBackend):
    """XLA restricted to the head and block sizes a typical kernel supports."""

    @classmethod
    def get_supported_head_sizes(cls):
        return (64, 128)

    @classmethod
    def get_supported_block_sizes(cls):
        return (16, 32)


def select(head_size=128, **kw):
    kw.setdefault("platform", CPU)
    return get_attn_backend(head_size, jnp.bfloat16, **kw)


def explain(head_size=128, **kw):
    kw.setdefault("platform", CPU)
    return explain_attn_backend_selection(head_size, jnp.bfloat16, **kw)


# --- priority lists -------------------------------------------------------------------


def test_cpu_selects_xla():
    assert select() is XLAAttentionBackend
    assert get_attn_backend(64, np.float32) is XLAAttentionBackend  # the real platform (CPU in CI)


@pytest.mark.parametrize(
    ("platform", "priority", "chosen"),
    [
        (CPU, ("XLA", "XLA_MLA"), ABE.XLA),
        (TPU, ("PALLAS_TPU", "XLA", "PALLAS_MLA_TPU", "XLA_MLA"), ABE.PALLAS_TPU),
        (GPU, ("PALLAS_GPU", "XLA", "PALLAS_MLA_GPU", "XLA_MLA"), ABE.PALLAS_GPU),
    ],
)
def test_priority_list_per_platform(platform, priority, chosen):
    report = explain(platform=platform)
    assert tuple(b.name for b in report.priority) == priority
    assert report.how == "priority"
    assert report.chosen is chosen
    assert select(platform=platform) is chosen.get_class()


def test_tpu_selects_pallas_tpu():
    report = explain(platform=TPU)
    assert report.chosen is ABE.PALLAS_TPU
    assert report.row(ABE.PALLAS_TPU).reasons == []
    assert report.row(ABE.PALLAS_GPU).reasons == ["not in the priority list for platform tpu"]
    assert report.row(ABE.XLA).reasons == []
    assert select(platform=TPU) is PallasTPUAttentionBackend
    assert get_kv_cache_layout() == "HND"  # the TPU cache keeps heads before slots


def test_tpu_falls_back_to_xla_with_pallas_tpus_reasons():
    report = explain(platform=TPU, kv_cache_dtype="float16")
    assert report.chosen is ABE.XLA
    assert report.row(ABE.PALLAS_TPU).reasons == [
        "kv_cache_dtype='float16' is not supported; supported: "
        "['auto', 'bfloat16', 'float32', 'fp8', 'fp8_e4m3', 'fp8_e5m2']"
    ]


def test_gpu_selects_pallas_gpu():
    report = explain(platform=GPU, has_sink=True, kv_cache_dtype="fp8_e5m2")
    assert report.chosen is ABE.PALLAS_GPU
    assert report.row(ABE.PALLAS_GPU).reasons == []
    assert report.row(ABE.PALLAS_TPU).reasons[0] == "not in the priority list for platform gpu"
    assert select(platform=GPU) is PallasGPUAttentionBackend


def test_gpu_falls_back_to_xla_with_pallas_gpus_reasons():
    report = explain(platform=GPU, head_size=100)
    assert report.chosen is ABE.XLA
    assert report.row(ABE.PALLAS_GPU).reasons == ["head_size=100 is not supported; supported: multiples of 8 up to 256"]
    assert "PALLAS_GPU" in report.format() and "head_size=100 is not supported" in report.format()


def test_gpu_serves_head_sizes_vllm_serves():
    for head_size in (80, 96, 112, 192):
        assert explain(platform=GPU, head_size=head_size).chosen is ABE.PALLAS_GPU


@pytest.mark.parametrize(
    ("platform", "expected"), [(TPU, MLABackend), (GPU, PallasGPUAttentionBackend), (CPU, XLAAttentionBackend)]
)
def test_first_usable_backend_in_priority_order_wins(platform, expected):
    register_backend(ABE.PALLAS_TPU, class_path=f"{__name__}.MLABackend")  # usable everywhere
    assert select(platform=platform) is expected


def test_no_usable_backend_shows_each_backends_reasons():
    with pytest.raises(ValueError) as e:
        select(use_mla=True, has_sink=True, platform=TPU)
    msg = str(e.value)
    assert msg.startswith("No attention backend can serve head_size=128, dtype=bfloat16")
    assert "use_mla=True" in msg
    assert "on platform tpu (TPU v5 lite) x 4 (priority list: PALLAS_TPU, XLA, PALLAS_MLA_TPU, XLA_MLA)" in msg
    assert "PALLAS_TPU: MLA is not supported." in msg
    assert "XLA: MLA is not supported." in msg
    assert "XLA_MLA: attention sinks are not supported." in msg
    assert "PALLAS_GPU: not in the priority list for platform tpu" in msg
    assert "\n" not in msg


# --- forcing and the environment ------------------------------------------------------


def test_force_and_get():
    assert get_global_forced_attn_backend() is None
    global_force_attn_backend(ABE.XLA)
    assert get_global_forced_attn_backend() is ABE.XLA
    assert select(platform=TPU) is XLAAttentionBackend
    assert explain(platform=TPU).how == "forced"
    global_force_attn_backend(None)
    assert get_global_forced_attn_backend() is None


def test_force_rejects_non_members():
    msg = r"attn_backend='XLA' must be None or an AttentionBackendEnum member.*Valid options are: XLA, PALLAS_TPU"
    with pytest.raises(TypeError, match=msg):
        global_force_attn_backend("XLA")


def test_forced_pallas_tpu_that_cannot_serve_lists_every_reason():
    global_force_attn_backend(ABE.PALLAS_TPU)
    with pytest.raises(ValueError) as e:
        select(use_mla=True, kv_cache_dtype="fp8", block_size=16)
    msg = str(e.value)
    assert msg.startswith("Forced attention backend PALLAS_TPU cannot serve head_size=128")
    assert "MLA is not supported; kv_cache_dtype='fp8' with block_size=16: fp8 pages need block_size >= 32" in msg
    assert "not in the priority list" not in msg  # forcing bypasses the priority list
    assert msg.endswith("Usable backends here: XLA_MLA.")  # MLA: XLA cannot serve it, XLA_MLA can


def test_forced_backend_beats_env(monkeypatch):
    global_force_attn_backend(ABE.XLA)
    monkeypatch.setenv(ENV_VAR, "BAD")  # not even read while a backend is forced
    assert select() is XLAAttentionBackend
    assert explain().how == "forced"


def test_env_selects_backend(monkeypatch):
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.MLABackend")
    monkeypatch.setenv(ENV_VAR, "CUSTOM")
    assert select(use_mla=True) is MLABackend
    report = explain()
    assert report.how == "env" and report.requested is ABE.CUSTOM and report.chosen is ABE.CUSTOM
    assert "environment: ATTN_STACK_BACKEND='CUSTOM'" in report.format()


def test_env_backend_that_cannot_serve_lists_every_reason(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "PALLAS_GPU")
    with pytest.raises(ValueError) as e:
        select(use_mla=True)
    msg = str(e.value)
    assert msg.startswith("ATTN_STACK_BACKEND='PALLAS_GPU' names attention backend PALLAS_GPU, which cannot serve")
    assert "PALLAS_GPU, which cannot serve" in msg and "MLA is not supported." in msg
    assert msg.endswith("Usable backends here: XLA_MLA.")


def test_bad_env_value_names_the_variable_and_valid_options(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "FLASH_ATTN")
    expected = (
        "ATTN_STACK_BACKEND='FLASH_ATTN' is not an attention backend. "
        "Valid options are (any case): XLA, PALLAS_TPU, PALLAS_GPU, XLA_MLA, PALLAS_MLA_TPU, PALLAS_MLA_GPU, CUSTOM"
    )
    with pytest.raises(ValueError) as e:
        select()
    assert str(e.value) == expected
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        explain()


@pytest.mark.parametrize("value", ["pallas_gpu", "Pallas_GPU", " PALLAS_GPU "])
def test_env_backend_name_is_case_insensitive(monkeypatch, value):
    """As `attn-stack generate --backend pallas_gpu` is."""
    monkeypatch.setenv(ENV_VAR, value)
    report = explain()
    assert report.how == "env" and report.requested is ABE.PALLAS_GPU


def test_empty_env_counts_as_unset(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")
    assert select() is XLAAttentionBackend
    assert explain().how == "priority"


def test_unregistered_custom_named_in_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "CUSTOM")
    report = explain()
    row = report.row(ABE.CUSTOM)
    assert row.class_path is None and not row.usable
    assert row.reasons[0].startswith("not registered: Backend AttentionBackendEnum.CUSTOM must be registered")
    with pytest.raises(ValueError, match=r"names attention backend CUSTOM, which cannot serve .*not registered"):
        select()


def test_forced_custom_that_fails_to_import():
    register_backend(ABE.CUSTOM, class_path="no_such_pkg.Backend")
    global_force_attn_backend(ABE.CUSTOM)
    with pytest.raises(ValueError, match=r"import failed: Cannot import 'no_such_pkg.Backend'"):
        select()


def test_forced_custom_that_is_not_a_backend():
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.NotABackend")
    global_force_attn_backend(ABE.CUSTOM)
    with pytest.raises(ValueError, match=rf"{__name__}.NotABackend is not an AttentionBackend subclass"):
        select()


def test_forced_backend_rejects_unsupported_head_and_block_sizes():
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.SizedBackend")
    global_force_attn_backend(ABE.CUSTOM)
    assert select(block_size=32) is SizedBackend
    with pytest.raises(ValueError) as err:
        get_attn_backend(80, jnp.bfloat16, block_size=8, platform=CPU)
    msg = str(err.value)
    assert "head_size=80 is not supported; supported: [64, 128]" in msg
    assert "block_size=8 is not supported; supported: [16, 32]" in msg


# --- argument validation ----------------------------------------------------------------


def test_bad_kv_cache_dtype_lists_valid_ones():
    valid = "auto, bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2"
    with pytest.raises(ValueError, match=rf"'fp4'. Valid values are: {valid}"):
        select(kv_cache_dtype="fp4")


def test_bad_attn_type_lists_valid_ones():
    valid = "'decoder', 'encoder', 'encoder_only', 'encoder_decoder'"
    with pytest.raises(ValueError, match=rf"'cross'. Valid options are: {valid}"):
        select(attn_type="cross")


def test_bad_dtype_lists_valid_ones():
    with pytest.raises(TypeError, match=r"int32.*Valid dtypes are: float32, bfloat16, float16"):
        get_attn_backend(128, jnp.int32, platform=CPU)


@pytest.mark.parametrize(
    ("name", "value"), [("head_size", 0), ("head_size", 64.0), ("block_size", -16), ("block_size", True)]
)
def test_bad_sizes(name, value):
    kw = {"head_size": 128, "dtype": jnp.float32, name: value}
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a positive integer"):
        get_attn_backend(**kw, platform=CPU)


def test_attn_type_and_dtype_spellings_share_the_cache():
    assert select(attn_type="encoder_only") is select(attn_type=selector.AttentionType.ENCODER_ONLY)
    before = selector._cached_get_attn_backend.cache_info().hits
    get_attn_backend(128, "bfloat16", platform=CPU)
    get_attn_backend(128, np.dtype(jnp.bfloat16), platform=CPU)
    assert selector._cached_get_attn_backend.cache_info().hits == before + 2


# --- the cache never goes stale -----------------------------------------------------------


def test_cache_follows_force():
    assert select() is XLAAttentionBackend
    global_force_attn_backend(ABE.PALLAS_TPU)
    assert select() is PallasTPUAttentionBackend  # forced on a CPU: the TPU interpreter
    with pytest.raises(ValueError, match="Forced attention backend PALLAS_TPU"):
        select(use_mla=True)
    global_force_attn_backend(None)
    assert select() is XLAAttentionBackend


def test_cache_follows_context_manager_and_restores_prior_value():
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.MLABackend")
    assert select() is XLAAttentionBackend
    global_force_attn_backend(ABE.XLA)
    with global_force_attn_backend_context_manager(ABE.CUSTOM):
        assert get_global_forced_attn_backend() is ABE.CUSTOM
        assert select() is MLABackend
        with global_force_attn_backend_context_manager(None):
            assert select() is XLAAttentionBackend
        assert select() is MLABackend
    assert get_global_forced_attn_backend() is ABE.XLA
    assert select() is XLAAttentionBackend


def test_context_manager_restores_after_an_error():
    with pytest.raises(RuntimeError):
        with global_force_attn_backend_context_manager(ABE.PALLAS_GPU):
            raise RuntimeError
    assert get_global_forced_attn_backend() is None


def test_cache_follows_env(monkeypatch):
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.MLABackend")
    assert select() is XLAAttentionBackend
    monkeypatch.setenv(ENV_VAR, "CUSTOM")
    assert select() is MLABackend
    monkeypatch.setenv(ENV_VAR, "PALLAS_TPU")
    assert select() is PallasTPUAttentionBackend
    with pytest.raises(ValueError, match="PALLAS_TPU"):
        select(use_mla=True)
    monkeypatch.delenv(ENV_VAR)
    assert select() is XLAAttentionBackend


def test_cache_follows_register_backend_override():
    assert select() is XLAAttentionBackend
    register_backend(ABE.XLA)(MLABackend)
    assert select() is MLABackend
    ABE.XLA.clear_override()
    assert select() is XLAAttentionBackend


def test_cache_follows_platform():
    register_backend(ABE.PALLAS_GPU, class_path=f"{__name__}.MLABackend")
    assert select(platform=CPU) is XLAAttentionBackend
    assert select(platform=GPU) is MLABackend


# --- explain reports ----------------------------------------------------------------------


def test_report_has_a_row_for_every_backend():
    report = explain()
    assert [r.name for r in report.rows] == PALLAS_AND_MLA  # CUSTOM: unregistered
    xla = report.row(ABE.XLA)
    assert (xla.class_path, xla.usable, xla.reasons) == ("attn_jax.backends.xla.XLAAttentionBackend", True, [])
    tpu = report.row(ABE.PALLAS_TPU)
    assert tpu.class_path == "attn_jax.backends.pallas_tpu.PallasTPUAttentionBackend"
    assert not tpu.usable
    assert tpu.reasons == ["not in the priority list for platform cpu"]
    with pytest.raises(KeyError):
        report.row(ABE.CUSTOM)


def test_report_includes_registered_custom():
    register_backend(ABE.CUSTOM, class_path=f"{__name__}.MLABackend")
    report = explain(use_mla=True)
    assert [r.name for r in report.rows] == [*PALLAS_AND_MLA, "CUSTOM"]
    custom = report.row(ABE.CUSTOM)
    assert custom.class_path == f"{__name__}.MLABackend"
    assert custom.reasons == ["not in the priority list for platform cpu"]
    assert report.row(ABE.XLA).reasons == ["MLA is not supported"]
    assert report.chosen is ABE.XLA_MLA  # the MLA backend in the CPU's priority list


def test_report_fields_and_format():
    report = explain(has_sink=True, kv_cache_dtype="fp8")
    assert report.request.has_sink and report.request.kv_cache_dtype == "fp8"
    assert report.request.dtype == np.dtype(jnp.bfloat16)
    assert report.platform == CPU
    assert report.how == "priority" and report.requested is None and report.chosen is ABE.XLA
    assert report.failure_message() == ""
    text = report.format()
    assert str(report) == text
    assert "kv_cache_dtype='fp8'" in text and "has_sink=True" in text
    assert "platform:   cpu (cpu) x 1" in text
    assert "decided by: platform priority list for cpu" in text
    assert "chosen:     XLA (attn_jax.backends.xla.XLAAttentionBackend)" in text
    assert "* XLA" in text
    assert "- not in the priority list for platform cpu" in text
    assert "- not in the priority list for platform cpu" in text.split("PALLAS_GPU")[1]


def test_report_format_when_nothing_is_chosen():
    global_force_attn_backend(ABE.PALLAS_GPU)
    report = explain(head_size=100)
    assert report.how == "forced" and report.chosen is None
    text = report.format()
    assert "decided by: forced: global_force_attn_backend(PALLAS_GPU)" in text
    assert "chosen:     none" in text
    assert "error: Forced attention backend PALLAS_GPU cannot serve" in text
    assert "*" not in text


# --- side effects ----------------------------------------------------------------------


def test_selection_pins_the_required_kv_cache_layout(monkeypatch, caplog):
    monkeypatch.setenv("ATTN_STACK_KV_CACHE_LAYOUT", "HND")
    with caplog.at_level(logging.INFO, logger="attn_jax.selector"):
        assert select() is XLAAttentionBackend
    assert get_kv_cache_layout() == "NHD"
    assert "Using NHD KV cache layout for XLA backend (was HND)." in caplog.text


def test_layout_is_set_again_on_a_cache_hit():
    register_backend(ABE.XLA, class_path=f"{__name__}.HNDBackend")
    select()
    set_kv_cache_layout("NHD")
    select()
    assert get_kv_cache_layout() == "HND"


# --- the Pallas GPU backend ------------------------------------------------------------


def test_pallas_gpu_shares_the_xla_cache_layout_and_runs_forced_on_cpu():
    cls = PallasGPUAttentionBackend
    assert cls.get_kv_cache_shape(7, 16, 8, 128) == XLAAttentionBackend.get_kv_cache_shape(7, 16, 8, 128)
    assert cls.get_kv_cache_stride_order() == XLAAttentionBackend.get_kv_cache_stride_order()
    assert cls.unavailable_reason(CPU) is None  # forced on a CPU it runs in the interpreter
    global_force_attn_backend(ABE.PALLAS_GPU)
    assert select(head_size=64) is cls
