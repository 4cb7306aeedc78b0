"""Platform detection from JAX devices."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import jax
import pytest

from attn_jax.platforms import PLATFORM_KINDS, Platform, current_platform, detect_platform, host_cpus


def _devices(platform: str, device_kind: str, n: int = 1):
    return [SimpleNamespace(platform=platform, device_kind=device_kind) for _ in range(n)]


@pytest.mark.parametrize(
    ("jax_platform", "device_kind", "kind"),
    [
        ("tpu", "TPU v5 lite", "tpu"),
        ("cuda", "NVIDIA H100 80GB HBM3", "gpu"),
        ("rocm", "AMD Instinct MI300X", "gpu"),
        ("gpu", "NVIDIA A100-SXM4-40GB", "gpu"),
        ("cpu", "cpu", "cpu"),
    ],
)
def test_detect_platform_maps_jax_platforms(jax_platform, device_kind, kind):
    p = detect_platform(_devices(jax_platform, device_kind, n=4))
    assert p == Platform(kind=kind, device_kind=device_kind, num_devices=4)


def test_detect_platform_defaults_to_jax_devices():
    devices = jax.devices()
    p = detect_platform()
    assert p.num_devices == len(devices)
    assert p.device_kind == devices[0].device_kind
    assert p.kind in PLATFORM_KINDS


def test_current_platform_is_cached_detection():
    assert current_platform() is current_platform()
    assert current_platform() == detect_platform()


def test_platform_is_frozen_and_hashable():
    p = Platform("gpu", "NVIDIA H100 80GB HBM3", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.kind = "tpu"
    assert {p: 1}[Platform("gpu", "NVIDIA H100 80GB HBM3", 8)] == 1
    assert str(p) == "gpu (NVIDIA H100 80GB HBM3) x 8"


def test_platform_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"kind='npu'.*Valid options are: tpu, gpu, cpu"):
        Platform("npu", "x", 1)


@pytest.mark.parametrize("n", [0, -1, True, 1.0])
def test_platform_rejects_bad_num_devices(n):
    with pytest.raises(ValueError, match=rf"num_devices={n!r} must be a positive integer"):
        Platform("cpu", "cpu", n)


def test_detect_platform_rejects_unknown_jax_platform():
    with pytest.raises(ValueError, match=r"platform='metal'.*Valid options are: tpu, cuda, rocm, gpu, cpu"):
        detect_platform(_devices("metal", "Apple M3"))


def test_detect_platform_rejects_no_devices():
    with pytest.raises(ValueError, match=r"at least one device"):
        detect_platform([])


def test_detect_platform_rejects_mixed_platforms():
    with pytest.raises(ValueError, match=r"several platforms \['cpu', 'cuda'\]"):
        detect_platform(_devices("cpu", "cpu") + _devices("cuda", "NVIDIA H100 80GB HBM3"))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="the OS gives no CPU affinity")
def test_host_cpus_counts_the_cores_this_process_may_use():
    assert host_cpus() == len(os.sched_getaffinity(0)) >= 1
