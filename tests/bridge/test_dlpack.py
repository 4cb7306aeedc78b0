"""bridge.dlpack: zero-copy round trips by pointer identity, and one test per refusal."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.dlpack import CPU_ALIGNMENT, SUPPORTED_DTYPES, BridgeError, to_jax, to_jax_int32, to_torch

ROUND_TRIP_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
    torch.bool,
]


def _values(dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(-24, 24, dtype=torch.float32).reshape(6, 8) / 4
    if dtype is torch.bool:
        return base > 0
    return base.to(dtype)


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_round_trip_shares_memory(dtype):
    t = _values(dtype)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == (6, 8) and np.dtype(a.dtype) == SUPPORTED_DTYPES[dtype]
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), t.float().numpy())
    # A JAX result crosses to torch without a copy too.
    result = jnp.asarray(a) if dtype is torch.bool else a[::-1]
    r = to_torch(result)
    assert r.data_ptr() == result.unsafe_buffer_pointer()


def test_to_torch_view_sees_the_jax_buffer():
    a = jnp.arange(16, dtype=jnp.float32) * 2
    t = to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.arange(16) * 2)


def test_aligned_storage_offset_is_zero_copy():
    base = torch.zeros(1024)
    view = base[CPU_ALIGNMENT // 4 :]  # 64 bytes in: still aligned
    assert to_jax(view).unsafe_buffer_pointer() == view.data_ptr()


def test_misaligned_storage_offset_is_an_error():
    view = torch.zeros(1024)[1:]
    with pytest.raises(BridgeError, match=r"storage_offset=1\) is not 64-byte aligned"):
        to_jax(view)


@pytest.mark.parametrize(
    "make", [lambda: torch.zeros(8, 16).t(), lambda: torch.zeros(8, 16)[:, ::2]], ids=["transposed", "strided"]
)
def test_non_contiguous_is_an_error(make):
    with pytest.raises(BridgeError, match=r"is not C-contiguous.*\.contiguous\(\)"):
        to_jax(make())


def test_sparse_is_an_error_that_does_not_advise_contiguous():
    with pytest.raises(BridgeError, match=r"layout=torch.sparse_coo; DLPack shares dense .* \.to_dense\(\)") as e:
        to_jax(torch.eye(4).to_sparse())
    assert "contiguous" not in str(e.value)


def test_to_torch_inside_jit_is_an_error():
    with pytest.raises(
        BridgeError, match=r"array is a traced value \(float32\[3\]\) inside jax.jit.*outside the jitted"
    ):
        jax.jit(to_torch)(jnp.zeros(3))


def test_requires_grad_is_an_error():
    with pytest.raises(BridgeError, match=r"requires grad.*detach\(\)"):
        to_jax(torch.zeros(4, requires_grad=True))


def test_int64_is_refused_without_x64():
    with pytest.raises(BridgeError, match=r"dtype=torch.int64.*to_jax_int32"):
        to_jax(torch.arange(4))


def test_float64_is_refused_without_x64():
    with pytest.raises(BridgeError, match=r"dtype=torch.float64.*tensor.float\(\)"):
        to_jax(torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16], ids=str)
def test_unsupported_dtype_names_the_supported_ones(dtype):
    with pytest.raises(
        BridgeError, match=rf"dtype={dtype}, which the bridge does not support. Supported: float32, bfloat16"
    ):
        to_jax(torch.zeros(4, dtype=dtype))


def test_to_torch_refuses_complex():
    with pytest.raises(BridgeError, match=r"dtype=complex64"):
        to_torch(jnp.zeros(4, jnp.complex64))


def test_to_torch_refuses_deleted_array():
    a = jnp.zeros(4)
    a.delete()
    with pytest.raises(BridgeError, match="has been deleted"):
        to_torch(a)


def test_wrong_types():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got ndarray"):
        to_jax(np.zeros(3))
    with pytest.raises(TypeError, match="must be a jax.Array, got Tensor"):
        to_torch(torch.zeros(3))


def test_int32_metadata_is_zero_copy():
    t = torch.arange(10, dtype=torch.int32)
    assert to_jax_int32(t).unsafe_buffer_pointer() == t.data_ptr()


def test_int64_metadata_is_checked_and_narrowed():
    a = to_jax_int32(torch.tensor([[0, 5], [2**31 - 1, -(2**31)]]))
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), [[0, 5], [2**31 - 1, -(2**31)]])


def test_int64_metadata_out_of_range_names_the_value():
    with pytest.raises(BridgeError, match=r"slot_mapping\[1, 0\]=2147483648 is outside int32's range"):
        to_jax_int32(torch.tensor([[0, 1], [2**31, 3]]), name="slot_mapping")


def test_int_metadata_refuses_floats():
    with pytest.raises(BridgeError, match="must be int32 or int64"):
        to_jax_int32(torch.zeros(3))


def test_cuda_tensor_without_jax_gpu_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BridgeError, match="device=meta is not supported"):
        to_jax(torch.zeros(3, device="meta"))


def test_x64_lets_int64_and_float64_through():
    code = (
        "import jax; jax.config.update('jax_enable_x64', True)\n"
        "import torch\nfrom bridge.dlpack import to_jax, to_torch\n"
        "for dt in (torch.int64, torch.float64):\n"
        "    t = torch.arange(8, dtype=dt); a = to_jax(t)\n"
        "    assert a.unsafe_buffer_pointer() == t.data_ptr() and str(a.dtype) == str(dt)[6:], a.dtype\n"
        "    assert to_torch(a).data_ptr() == t.data_ptr()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})


def test_jax_memory_policy_is_set_on_import_unless_the_user_chose():
    code = "import os, bridge; print(bridge.JAX_MEMORY_POLICY, os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["set", "false"]
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ".5"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["user", "None"]


def test_jax_memory_policy_too_late_warns():
    code = (
        "import jax; jax.devices()\nimport logging; logging.basicConfig()\n"
        "import bridge; print(bridge.JAX_MEMORY_POLICY)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["too-late"]
    assert "could not be set" in result.stderr


def test_device_mapping_cpu():
    from bridge.dlpack import jax_device_for, torch_device_for

    assert jax_device_for(torch.device("cpu")) == jax.devices("cpu")[0]
    assert torch_device_for(jax.devices("cpu")[0]) == torch.device("cpu")
