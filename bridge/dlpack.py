"""Zero-copy tensor exchange between PyTorch and JAX over DLPack, with explicit errors.

``to_jax(tensor)`` and ``to_torch(array)`` share memory (proved by pointer identity) or
raise: nothing is copied, narrowed or moved without being asked for. Plain
``jax.dlpack.from_dlpack`` (jax 0.11.2, torch 2.11) silently copies a CPU tensor whose
address is not 64-byte aligned and silently truncates int64 to int32 and float64 to
float32 when x64 is off; here each of those is an error (``BridgeError``) naming the
value and the fix, and the one narrowing attention needs, int64 batch metadata to int32,
is ``to_jax_int32``: a documented copy after a range check.

Rules of a crossing (each broken rule is a ``BridgeError``):

- dtype in ``SUPPORTED_DTYPES`` (float32, bfloat16, float16, float8_e4m3fn, float8_e5m2,
  int8, uint8, int32, bool; int64 and float64 only with ``jax_enable_x64``);
- C-contiguous (row-major, compact) strides, no autograd history (``requires_grad``);
- on CPU, a data pointer aligned to ``CPU_ALIGNMENT`` (64) bytes, as XLA's CPU client
  needs to alias a buffer (torch's CPU allocator returns 64-byte aligned storage, so only
  views with an odd storage offset fail);
- devices map one to one: torch ``cpu`` <-> JAX's CPU device, torch ``cuda:i`` <-> JAX
  GPU ``i`` (same ``CUDA_VISIBLE_DEVICES`` numbering).

On CUDA the DLPack stream protocol orders the two libraries' work: ``to_jax`` makes
JAX's import stream wait for the work queued on torch's current stream (what
``tensor.__dlpack__(stream=...)`` does, with a cached stream wrapper and a reused event)
and JAX records the array's ready event on that stream; ``to_torch`` passes torch's
current stream to JAX (JAX makes it wait until the array is computed).

Cost (``benchmarks/bridge_overhead.py``, BENCHMARKS.md): ``to_jax`` 10-15 us and
``to_torch`` 6 us on this project's CPU machine; 23-33 us and 6-10 us on an H100, where
jaxlib's import of a CUDA capsule alone is 16-23 us; ``jax.dlpack.from_dlpack`` takes
76-97 us there and 83-92 us on the CPU. The checks are done once here, and the conversion
calls jaxlib's DLPack entry points directly (``jax._src.lib._jax``, pinned jax 0.11.2).

Example::

    t = torch.arange(8, dtype=torch.float32)
    a = to_jax(t)                       # f32[8], the same memory
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = to_torch(a * 2)              # a torch view of JAX's result buffer
"""

from __future__ import annotations

import functools
import threading

import jax
import ml_dtypes
import numpy as np
import torch
from jax._src.lib import _jax
from torch.utils import dlpack as torch_dlpack

__all__ = [
    "CPU_ALIGNMENT",
    "SUPPORTED_DTYPES",
    "BridgeError",
    "jax_device_for",
    "to_jax",
    "to_jax_int32",
    "to_torch",
    "torch_device_for",
]

CPU_ALIGNMENT = 64
"""Bytes: XLA's CPU client creates a view of (aliases) only buffers aligned to this."""

SUPPORTED_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.int32: np.dtype(np.int32),
    torch.bool: np.dtype(np.bool_),
}
"""torch dtype -> JAX dtype of every zero-copy crossing (both ways), x64 off."""

_X64_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.int64: np.dtype(np.int64),
    torch.float64: np.dtype(np.float64),
}
"""Cross zero-copy only with ``jax_enable_x64``; JAX would truncate them otherwise."""

_TORCH_DTYPE_OF = {v: k for k, v in (SUPPORTED_DTYPES | _X64_DTYPES).items()}

_DL_CPU, _DL_CUDA = 1, 2  # DLDeviceType codes


class BridgeError(ValueError):
    """A tensor cannot cross between PyTorch and JAX without a copy or a narrowing."""


def _supported_names() -> str:
    names = [str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES]
    return ", ".join(names) + "; int64, float64 with jax_enable_x64"


def _check_dtype_torch(dtype: torch.dtype, what: str) -> None:
    if dtype in SUPPORTED_DTYPES:
        return
    if dtype in _X64_DTYPES:
        if jax.config.jax_enable_x64:
            return
        hint = (
            "use bridge.dlpack.to_jax_int32 for int32-range metadata (a checked copy)"
            if dtype is torch.int64
            else "cast it explicitly, e.g. tensor.float()"
        )
        raise BridgeError(
            f"{what} has dtype={dtype}, which JAX would silently narrow to 32 bits with x64 off "
            f"(jax_enable_x64=False): {hint}, or enable x64"
        )
    raise BridgeError(f"{what} has dtype={dtype}, which the bridge does not support. Supported: {_supported_names()}")


@functools.cache
def _jax_gpu_devices() -> dict[int, jax.Device]:
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError as e:
        raise BridgeError(
            f"a CUDA tensor needs JAX's GPU backend, which is unavailable ({e}); install jax[cuda13]"
        ) from None
    return {d.local_hardware_id: d for d in devices}


_JAX_DEVICE_OF: dict[torch.device, jax.Device] = {}
"""torch device -> JAX device, filled by ``jax_device_for`` (devices never change)."""


def jax_device_for(device: torch.device) -> jax.Device:
    """JAX's device for a torch device: cpu -> JAX's CPU device, cuda:i -> JAX GPU i."""
    cached = _JAX_DEVICE_OF.get(device)
    if cached is not None:
        return cached
    jax_device = _jax_device_for(device)
    if device.type == "cpu" or device.index is not None:  # "cuda" alone means the current device
        _JAX_DEVICE_OF[device] = jax_device
    return jax_device


def _jax_device_for(device: torch.device) -> jax.Device:
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        gpus = _jax_gpu_devices()
        if index not in gpus:
            raise BridgeError(f"device={device} has no JAX GPU twin; JAX sees GPUs {sorted(gpus)}")
        return gpus[index]
    raise BridgeError(f"device={device} is not supported by the bridge; supported: cpu, cuda:i")


def torch_device_for(device: jax.Device) -> torch.device:
    """torch's device for a JAX device: JAX's CPU -> cpu, JAX GPU i -> cuda:i."""
    if device.platform == "cpu":
        return torch.device("cpu")
    if device.platform in ("gpu", "cuda"):
        return torch.device("cuda", device.local_hardware_id)
    raise BridgeError(f"JAX device {device} (platform {device.platform!r}) has no torch twin; supported: cpu, gpu")


@functools.cache
def _jax_import_stream(device: jax.Device) -> tuple[int, torch.cuda.ExternalStream]:
    """JAX's DLPack import stream on a GPU: its handle, and torch's wrapper of it (made once)."""
    handle = device.get_stream_for_external_ready_events()
    return handle, torch.cuda.ExternalStream(handle, device=torch_device_for(device))


class _ThreadEvents(threading.local):
    """One reusable CUDA event per device and thread (record and wait are two calls)."""

    def __init__(self) -> None:
        self.by_device: dict[int, torch.cuda.Event] = {}


_EVENTS = _ThreadEvents()
_TORCH_STREAMS: dict[tuple[int, int], torch.cuda.ExternalStream] = {}
"""(device index, raw cudaStream_t) -> a torch wrapper of it, made once per stream."""


def _torch_current_stream(index: int) -> torch.cuda.Stream:
    """torch's current stream on GPU ``index``, from its raw handle (0.1 us, against 3.5 us for
    ``torch.cuda.current_stream``, which builds a new Stream object each call)."""
    raw = torch._C._cuda_getCurrentRawStream(index)  # what torch.compile's generated code calls
    stream = _TORCH_STREAMS.get((index, raw))
    if stream is None:
        stream = _TORCH_STREAMS[index, raw] = torch.cuda.ExternalStream(raw, device=index)
    return stream


def _jax_stream_after_torch(device: torch.device, jax_device: jax.Device) -> int:
    """Makes JAX's import stream wait for the work queued on torch's current stream; returns it.

    What ``tensor.__dlpack__(stream=...)`` does (17-26 us per call on an H100), minus its
    per-call stream wrappers and event object (2-3 us here): JAX records the imported
    buffer's ready event on this stream, so JAX's kernels run after torch's writes to the
    tensor.
    """
    handle, jax_stream = _jax_import_stream(jax_device)
    index = device.index
    event = _EVENTS.by_device.get(index)
    if event is None:
        event = _EVENTS.by_device[index] = torch.cuda.Event()
    event.record(_torch_current_stream(index))
    jax_stream.wait_event(event)
    return handle


def to_jax(tensor: torch.Tensor, *, name: str = "tensor") -> jax.Array:
    """The JAX array sharing ``tensor``'s memory: same shape, dtype, device. Never copies.

    Args:
      tensor: a C-contiguous torch tensor without grad, on cpu or cuda:i, with a dtype in
        ``SUPPORTED_DTYPES`` (int64/float64 only with x64); on CPU 64-byte aligned.
      name: how errors refer to the tensor.

    Returns a ``jax.Array`` on ``jax_device_for(tensor.device)`` whose
    ``unsafe_buffer_pointer()`` is ``tensor.data_ptr()``. JAX treats arrays as immutable:
    do not write the tensor while JAX may still read the array.

    Raises BridgeError (a ValueError) naming the rule broken and the fix; TypeError if
    ``tensor`` is not a torch.Tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise BridgeError(
            f"{name} has layout={tensor.layout}; DLPack shares dense (torch.strided) tensors only. Convert it "
            "with .to_dense() (a copy) if a copy is acceptable"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        _check_dtype_torch(tensor.dtype, name)
    if tensor.requires_grad:
        raise BridgeError(
            f"{name} requires grad: JAX cannot carry torch's autograd history. Pass tensor.detach(), "
            "or run inference under torch.no_grad() / torch.inference_mode()"
        )
    if not tensor.is_contiguous():
        raise BridgeError(
            f"{name} with shape={tuple(tensor.shape)} and strides={tensor.stride()} is not C-contiguous; "
            "zero-copy needs row-major compact strides. Call .contiguous() (a copy) first if a copy is acceptable"
        )
    device = tensor.device
    jax_device = jax_device_for(device)
    if device.type == "cpu":
        ptr = tensor.data_ptr()
        if ptr % CPU_ALIGNMENT and tensor.numel():
            raise BridgeError(
                f"{name}'s data pointer {ptr:#x} (storage_offset={tensor.storage_offset()}) is not "
                f"{CPU_ALIGNMENT}-byte aligned: XLA's CPU client would copy it. Use a tensor whose data starts "
                f"on a {CPU_ALIGNMENT}-byte boundary, or .clone() it (a copy)"
            )
        stream, dl_type = None, _DL_CPU
    else:
        stream, dl_type = _jax_stream_after_torch(device, jax_device), _DL_CUDA
    capsule = torch_dlpack.to_dlpack(tensor)  # the legacy capsule: no stream sync of its own
    try:  # copy=False: jaxlib makes a view or raises, never copies (the tests check every dtype by pointer)
        return _jax.dlpack_managed_tensor_to_buffer(capsule, jax_device, stream, False, dl_type)
    except Exception as e:
        raise BridgeError(f"JAX refused to alias {name} (shape={tuple(tensor.shape)}, device={device}): {e}") from e


def to_torch(array: jax.Array, *, name: str = "array") -> torch.Tensor:
    """The torch tensor sharing ``array``'s memory: same shape, dtype, device. Never copies.

    Args:
      array: a single-device ``jax.Array`` (not deleted, not sharded) on CPU or a GPU,
        with a dtype in ``SUPPORTED_DTYPES`` (or int64/float64).
      name: how errors refer to the array.

    Returns a tensor on ``torch_device_for(array.device)`` with
    ``data_ptr() == array.unsafe_buffer_pointer()``; it keeps the buffer alive. Writing
    to it changes the JAX array: do so only for buffers you own, such as a KV cache.
    """
    if isinstance(array, jax.core.Tracer):
        raise BridgeError(
            f"{name} is a traced value ({array.aval}) inside jax.jit (or another transformation): it has no buffer "
            "to share. Call to_torch on the concrete result, outside the jitted function"
        )
    if not isinstance(array, jax.Array):
        raise TypeError(f"{name} must be a jax.Array, got {type(array).__name__}")
    if array.is_deleted():
        raise BridgeError(f"{name} has been deleted (donated to a jitted call?): there is no buffer to share")
    devices = array.devices()
    if len(devices) != 1:
        raise BridgeError(f"{name} is sharded over {len(devices)} devices; the bridge crosses one device at a time")
    dtype = _TORCH_DTYPE_OF.get(np.dtype(array.dtype))
    if dtype is None:
        raise BridgeError(
            f"{name} has dtype={array.dtype}, which the bridge does not support. Supported: {_supported_names()}"
        )
    (device,) = devices
    torch_device = torch_device_for(device)
    stream = torch._C._cuda_getCurrentRawStream(torch_device.index) if torch_device.type == "cuda" else None
    tensor = torch_dlpack.from_dlpack(_jax.buffer_to_dlpack_managed_tensor(array, stream=stream))
    if tensor.numel() and tensor.data_ptr() != array.unsafe_buffer_pointer():  # pragma: no cover
        raise BridgeError(f"torch copied {name} instead of aliasing it")
    return tensor


def to_jax_int32(tensor: torch.Tensor, *, name: str = "tensor") -> jax.Array:
    """Integer metadata as int32 JAX: int32 zero-copy, int64 range-checked and narrowed.

    int32 tensors cross like ``to_jax`` (no copy). int64 tensors, PyTorch's default
    integer dtype, are checked to lie in int32's range, then converted with
    ``tensor.to(torch.int32)``: a copy of the (small) metadata, never of activations.
    Other dtypes raise BridgeError.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype is torch.int32:
        return to_jax(tensor, name=name)
    if tensor.dtype is not torch.int64:
        raise BridgeError(f"{name} has dtype={tensor.dtype}; integer metadata must be int32 or int64")
    if tensor.numel():
        info = torch.iinfo(torch.int32)
        lo, hi = torch.aminmax(tensor)
        lo, hi = int(lo), int(hi)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            index = tuple(int(i) for i in (tensor == bad).nonzero()[0])
            raise BridgeError(
                f"{name}[{', '.join(map(str, index))}]={bad} is outside int32's range "
                f"[{info.min}, {info.max}]; attention metadata is int32"
            )
    return to_jax(tensor.to(torch.int32).contiguous(), name=name)
