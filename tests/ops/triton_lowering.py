"""Lowering Pallas kernels for an H100 from this CPU machine: ``jax.export`` for CUDA under an
abstract H100 device, which runs the Pallas -> Triton IR (and Mosaic GPU) lowering; PTX
compilation happens only on a GPU. Shared by the lowering tests."""

from __future__ import annotations

import jax
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax._src.pallas.triton import lowering as triton_lowering

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def export_for_h100(f, *shapes, donate_argnums=()) -> tuple[str, list[str]]:
    """(the StableHLO text of ``jax.jit(f)`` exported for CUDA, the text of every Triton module
    its Pallas Triton kernels lowered to), for arguments of ``shapes``."""
    modules = []
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    triton_lowering.lower_jaxpr_to_triton_module = capture
    try:
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H100)):
            exported = jax.export.export(jax.jit(f, donate_argnums=donate_argnums), platforms=["cuda"],
                                         disabled_checks=[TRITON])(*shapes)  # fmt: skip
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = lower
    assert exported.platforms == ("cuda",)
    return exported.mlir_module(), modules
