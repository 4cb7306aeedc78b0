"""A step's host inputs as one int32 buffer: one host-to-device copy per step.

The engine's step takes a dozen small arrays (token ids, positions, the attention
metadata's index arrays, sampling parameters). Uploaded one by one, each is a copy of
its own; ``pack`` lays them end to end in one i32 buffer (float32 and uint32 leaves by
their bits), and ``unpack`` slices them back out inside ``jit``. The layout (tree
structure, shapes, dtypes) is static and hashable: part of the jit key, fixed per bucket.

Example::

    buffer, layout = pack({"ids": np.arange(4, dtype=np.int32), "t": np.ones(2, np.float32)})
    tree = jax.jit(unpack, static_argnums=1)(buffer, layout)   # the same arrays, on the device
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALIGNMENT = 64
"""Each leaf starts on a multiple of 64 int32 (256 bytes) of the buffer: XLA may hand a
slice of it to a kernel as is, and some kernels (Mosaic GPU's) need 256-byte aligned
operands."""

_PACKABLE = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of a packed tree lies in the buffer: its tree structure and, per
    leaf, its shape and dtype name (the buffer holds them in order)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]


def pack(tree) -> tuple[np.ndarray, PackedLayout]:
    """i32[n] buffer holding every leaf of ``tree`` (NumPy arrays or scalars of int32,
    uint32 or float32), and its layout. TypeError names a leaf of another dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    parts, specs = [], []
    for i, leaf in enumerate(leaves):
        arr = np.asarray(leaf)
        if arr.dtype not in _PACKABLE:
            raise TypeError(
                f"leaf {i} of the step inputs has dtype {arr.dtype}; packable: {[str(d) for d in _PACKABLE]}"
            )
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.int32)
        parts += [flat, np.zeros(-flat.size % ALIGNMENT, np.int32)]
        specs.append((arr.shape, arr.dtype.name))
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buffer, PackedLayout(treedef, tuple(specs))


def unpack(buffer, layout: PackedLayout):
    """The tree ``pack`` packed, sliced out of i32[n] ``buffer`` (traceable)."""
    leaves, offset = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape))
        if n == 0:  # an empty leaf is a constant, not a slice of the buffer
            leaves.append(jnp.zeros(shape, dtype))
            continue
        part = buffer[offset : offset + n].reshape(shape)
        offset += n + (-n % ALIGNMENT)
        leaves.append(part if dtype == "int32" else jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)))
    return jax.tree.unflatten(layout.treedef, leaves)
