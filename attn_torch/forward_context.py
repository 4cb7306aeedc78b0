"""The per-step forward context: batch metadata for every attention layer (vLLM's).

A model runner wraps each model step in ``set_forward_context(attn_metadata)``; the
``attn_torch.Attention`` layers read the metadata from ``get_forward_context()``, so the
model's ``forward`` signature stays free of it (vLLM's ``vllm.forward_context``)::

    md = build_common_attn_metadata(query_lens, seq_lens, block_table, block_size=16)
    with set_forward_context(md):
        hidden = model(input_ids)

``attn_metadata`` is a ``CommonAttentionMetadata`` shared by every layer, or a dict
from layer name (``prefix``) to one. Its device fields may be NumPy arrays, jax arrays
or torch tensors (int32, or int64 within int32's range: ``bridge.dlpack.to_jax_int32``);
its ``_cpu`` fields are NumPy (or CPU tensors). The context converts them once per step
and per device and backend builder, whatever the number of layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import torch

from attn_jax.metadata import CommonAttentionMetadata
from attn_jax.ops.ragged_paged_attention.validate import dynamic_validate_inputs
from bridge.dlpack import BridgeError, jax_device_for, to_jax_int32

__all__ = [
    "ForwardContext",
    "use_forward_context",
    "PreparedMetadata",
    "get_forward_context",
    "is_forward_context_available",
    "set_forward_context",
]

_DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
_HOST_FIELDS = ("query_start_loc_cpu", "seq_lens_cpu", "num_computed_tokens_cpu")


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedMetadata:
    """One step's metadata ready for one backend builder on one device."""

    backend_metadata: Any  # the builder's metadata (jax arrays on the device)
    write_rows: torch.Tensor | None  # i64[n] on the device: rows of k/v to write; None = rows 0..n-1
    write_slots: torch.Tensor  # i64[n] on the device: their flat cache slots (slot_mapping >= 0)
    num_tokens: int  # rows of the padded token axis
    max_slot: int  # the largest slot written (-1 if none), checked against the cache's size


@dataclasses.dataclass(eq=False)
class ForwardContext:
    """What ``set_forward_context`` installs for one step."""

    attn_metadata: CommonAttentionMetadata | Mapping[str, CommonAttentionMetadata] | None
    virtual_engine: int = 0
    _prepared: dict = dataclasses.field(default_factory=dict, repr=False)
    _common: dict = dataclasses.field(default_factory=dict, repr=False)

    def metadata_for(self, layer_name: str) -> CommonAttentionMetadata:
        """The ``CommonAttentionMetadata`` of ``layer_name``; ValueError naming the valid ones."""
        md = self.attn_metadata
        if isinstance(md, Mapping):
            if layer_name not in md:
                raise ValueError(
                    f"The forward context's attn_metadata has no entry for layer {layer_name!r}; it has: {sorted(md)}"
                )
            md = md[layer_name]
        if not isinstance(md, CommonAttentionMetadata):
            raise TypeError(
                f"attn_metadata for layer {layer_name!r} is {type(md).__name__}; attn_torch layers take a "
                "CommonAttentionMetadata (attn_torch.build_common_attn_metadata builds one)"
            )
        return md

    def prepare(
        self, layer_name: str, builder, device: torch.device, *, num_blocks: int | None = None, causal: bool = True
    ) -> PreparedMetadata:
        """The layer's metadata built by ``builder`` on ``device``, cached for the step.

        With ``num_blocks`` (the layer's cache pages) the metadata first gets the JAX op's
        dynamic checks (``validate.dynamic_validate_inputs``: lengths consistent, seq_len >=
        query_len when ``causal``, the block ids requests use in [0, num_blocks), slots in
        range), once per step: ValueError naming the first bad value.
        """
        md = self.metadata_for(layer_name)
        key = (id(md), type(builder), builder.kv_cache_spec, device, num_blocks, causal)
        prepared = self._prepared.get(key)
        if prepared is None:
            common = self._on_device(md, device)
            host_slots = _host_int32(md.slot_mapping, "slot_mapping")
            if num_blocks is not None:
                dynamic_validate_inputs(
                    _host_int32(md.query_start_loc, "query_start_loc"), _host_int32(md.seq_lens, "seq_lens"),
                    _host_int32(md.block_table_tensor, "block_table_tensor"), host_slots,
                    num_blocks=num_blocks, block_size=builder.kv_cache_spec.block_size, causal=causal,
                )  # fmt: skip
            rows = np.flatnonzero(host_slots >= 0)
            contiguous = rows.size == 0 or (rows[0] == 0 and rows[-1] == rows.size - 1)
            prepared = PreparedMetadata(
                # Built once per step; device_put so host-built fields (a schedule) are not re-sent per layer.
                backend_metadata=jax.device_put(builder.build(0, common), jax_device_for(device)),
                write_rows=None if contiguous else torch.from_numpy(rows).to(device),
                write_slots=torch.from_numpy(host_slots[rows].astype(np.int64)).to(device),
                num_tokens=int(host_slots.shape[0]),
                max_slot=int(host_slots.max(initial=-1)),
            )
            self._prepared[key] = prepared
        return prepared

    def _on_device(self, md: CommonAttentionMetadata, device: torch.device) -> CommonAttentionMetadata:
        key = (id(md), device)
        if key not in self._common:
            jax_device = jax_device_for(device)
            fields = {name: _device_int32(getattr(md, name), name, device, jax_device) for name in _DEVICE_FIELDS}
            fields |= {name: _host_int32(getattr(md, name), name) for name in _HOST_FIELDS}
            self._common[key] = dataclasses.replace(md, **fields)
        return self._common[key]


def _device_int32(x, name: str, device: torch.device, jax_device: jax.Device) -> jax.Array:
    """An int32 jax array on ``jax_device``: torch tensors cross zero-copy (int64: checked)."""
    if isinstance(x, torch.Tensor):
        if x.device != device:
            raise BridgeError(
                f"attn_metadata.{name} is on {x.device} but the layer's tensors are on {device}; "
                "metadata and activations must share a device"
            )
        return to_jax_int32(x.contiguous() if x.dim() == 0 else x, name=f"attn_metadata.{name}")
    array = np.asarray(x) if not isinstance(x, jax.Array) else x
    if array.dtype != np.int32:
        if array.dtype.kind not in "iu":
            raise BridgeError(f"attn_metadata.{name} has dtype={array.dtype}; it must hold integers (int32)")
        array = _checked_int32(np.asarray(array), f"attn_metadata.{name}")
    return jax.device_put(array, jax_device)  # small metadata, one explicit transfer per step


def _host_int32(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    array = np.asarray(x)
    if array.dtype != np.int32:
        if array.dtype.kind not in "iu":
            raise BridgeError(f"attn_metadata.{name} has dtype={array.dtype}; it must hold integers (int32)")
        array = _checked_int32(array, f"attn_metadata.{name}")
    return array


def _checked_int32(array: np.ndarray, name: str) -> np.ndarray:
    info = np.iinfo(np.int32)
    bad = (array < info.min) | (array > info.max)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise BridgeError(
            f"{name}[{', '.join(map(str, index))}]={int(array[index])} is outside int32's range "
            f"[{info.min}, {info.max}]"
        )
    return array.astype(np.int32)


_forward_context: ForwardContext | None = None


def is_forward_context_available() -> bool:
    """True inside ``set_forward_context``."""
    return _forward_context is not None


def get_forward_context() -> ForwardContext:
    """The current step's context; RuntimeError outside ``set_forward_context``."""
    if _forward_context is None:
        raise RuntimeError(
            "attn_torch.Attention.forward was called outside a forward context: wrap the model call in "
            "`with attn_torch.set_forward_context(attn_metadata):` (attn_metadata: a CommonAttentionMetadata, "
            "or a dict from layer name to one)"
        )
    return _forward_context


@contextlib.contextmanager
def use_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Installs an existing ``ForwardContext`` (and its per-step caches) inside the block.

    For integrations that call the layers one at a time but share one step's prepared
    metadata between them; ``set_forward_context`` makes a fresh context.
    """
    global _forward_context
    previous = _forward_context
    _forward_context = context
    try:
        yield context
    finally:
        _forward_context = previous


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: CommonAttentionMetadata | Mapping[str, CommonAttentionMetadata] | None,
    vllm_config: Any = None,
    virtual_engine: int = 0,
) -> Iterator[ForwardContext]:
    """Installs ``attn_metadata`` for the layers called inside the block (vLLM's signature).

    ``vllm_config`` is accepted for signature parity and unused. ``virtual_engine``
    selects each layer's ``kv_cache[virtual_engine]``. Contexts nest; the previous one
    is restored on exit.
    """
    del vllm_config
    with use_forward_context(ForwardContext(attn_metadata=attn_metadata, virtual_engine=virtual_engine)) as context:
        yield context
