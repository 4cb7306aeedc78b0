"""Which hardware this process runs on: tpu, gpu or cpu, the device kind and count, and
the host cores it may use (``host_cpus``).

The selector keys its platform priority list on ``Platform.kind``. Detection reads the
default JAX backend's devices; tests build a ``Platform`` directly and pass it to the
selector instead of patching JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any, Literal, get_args

import jax

PlatformKind = Literal["tpu", "gpu", "cpu"]

PLATFORM_KINDS: tuple[str, ...] = get_args(PlatformKind)

# jax's Device.platform -> our kind. Device.platform is "gpu" on older jaxlibs.
_JAX_PLATFORM_TO_KIND: dict[str, PlatformKind] = {
    "tpu": "tpu",
    "cuda": "gpu",
    "rocm": "gpu",
    "gpu": "gpu",
    "cpu": "cpu",
}


@dataclasses.dataclass(frozen=True)
class Platform:
    """The devices of one JAX backend; hashable, so it can key selection caches.

    Example::

        Platform(kind="gpu", device_kind="NVIDIA H100 80GB HBM3", num_devices=8)
    """

    kind: PlatformKind
    """One of "tpu", "gpu", "cpu"."""
    device_kind: str
    """JAX's ``Device.device_kind``, e.g. "TPU v5 lite", "NVIDIA H100 80GB HBM3", "cpu"."""
    num_devices: int
    """Number of devices of that backend visible to this process (>= 1)."""

    def __post_init__(self) -> None:
        if self.kind not in PLATFORM_KINDS:
            raise ValueError(f"Unknown platform kind={self.kind!r}. Valid options are: {', '.join(PLATFORM_KINDS)}")
        n = self.num_devices
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_devices={self.num_devices!r} must be a positive integer")

    def __str__(self) -> str:
        return f"{self.kind} ({self.device_kind}) x {self.num_devices}"


def detect_platform(devices: Sequence[Any] | None = None) -> Platform:
    """The ``Platform`` of ``devices`` (default: ``jax.devices()``, the default backend's).

    ``devices`` are ``jax.Device``-like objects with ``.platform`` and ``.device_kind``;
    they must all belong to one platform. JAX's "cuda", "rocm" and "gpu" map to "gpu".
    """
    if devices is None:
        devices = jax.devices()
    if len(devices) == 0:
        raise ValueError("detect_platform needs at least one device; got devices=[]")
    jax_platforms = sorted({d.platform for d in devices})
    if len(jax_platforms) > 1:
        raise ValueError(f"devices span several platforms {jax_platforms}; pass the devices of one backend")
    jax_platform = jax_platforms[0]
    kind = _JAX_PLATFORM_TO_KIND.get(jax_platform)
    if kind is None:
        raise ValueError(
            f"Unsupported JAX platform={jax_platform!r}. Valid options are: {', '.join(_JAX_PLATFORM_TO_KIND)}"
        )
    return Platform(kind=kind, device_kind=devices[0].device_kind, num_devices=len(devices))


def is_cuda(device: Any) -> bool:
    """Whether ``device`` (a ``jax.Device``) is an NVIDIA GPU under CUDA. Its ``platform`` is
    "gpu" under CUDA and ROCm alike, so its client's ``platform_version`` tells them apart, as
    ``jax.Array.__cuda_array_interface__`` does."""
    return _JAX_PLATFORM_TO_KIND.get(device.platform) == "gpu" and "cuda" in device.client.platform_version.lower()


@functools.cache
def current_platform() -> Platform:
    """``detect_platform()`` for this process, computed once (devices do not change)."""
    return detect_platform()


def host_cpus() -> int:
    """The host cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
