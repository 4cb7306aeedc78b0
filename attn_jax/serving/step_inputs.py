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

_PACKABLE = {np.dtype(np.int32): "int32", np.dtype(np.uint32): "uint32", np.dtype(np.float32): "float32"}
"""The dtypes a leaf may have, with their names (``dtype.name`` is slow: once per step per leaf)."""


@dataclasses.dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where each leaf of a packed tree lies in the buffer: its tree structure and, per
    leaf, its shape and dtype name (the buffer holds them in order).

    A static jit argument, hashed and compared on every call: ``pack`` hands out one object
    per distinct layout, so the jit cache's comparison is an identity check, not a walk
    over the leaves (0.5 ms a call at 64 requests on a 2-core host)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    def __hash__(self) -> int:
        value = self.__dict__.get("_hash")
        if value is None:
            value = hash((self.treedef, self.leaves))
            object.__setattr__(self, "_hash", value)
        return value

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, PackedLayout):
            return NotImplemented
        return hash(self) == hash(other) and (self.treedef, self.leaves) == (other.treedef, other.leaves)


_LAYOUTS: dict[PackedLayout, PackedLayout] = {}
"""Every layout ``pack`` has made, each its own canonical object."""


def pack(tree) -> tuple[np.ndarray, PackedLayout]:
    """i32[n] buffer holding every leaf of ``tree`` (NumPy arrays or scalars of int32,
    uint32 or float32), and its layout. TypeError names a leaf of another dtype.

    The buffer is allocated once, zeroed, and each leaf copied into its aligned slice
    (this runs on the host for every engine step)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    specs, offsets, total = [], [], 0
    for i, arr in enumerate(arrays):
        name = _PACKABLE.get(arr.dtype)
        if name is None:
            raise TypeError(f"leaf {i} of the step inputs has dtype {arr.dtype}; packable: {list(_PACKABLE.values())}")
        specs.append((arr.shape, name))
        offsets.append(total)
        total += arr.size + (-arr.size % ALIGNMENT)
    buffer = np.zeros(total, np.int32)
    for arr, offset in zip(arrays, offsets, strict=True):
        if arr.size:
            buffer[offset : offset + arr.size].view(arr.dtype)[...] = arr.reshape(-1)
    layout = PackedLayout(treedef, tuple(specs))
    return buffer, _LAYOUTS.setdefault(layout, layout)


def _slots(layout: PackedLayout):
    """Each leaf's (offset into the buffer, size, shape, dtype name), in order."""
    offset = 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape))
        yield offset, n, shape, dtype
        offset += n + (-n % ALIGNMENT)


def leaf_offsets(layout: PackedLayout) -> list[int]:
    """Where each leaf of ``layout`` starts in its buffer (int32 elements)."""
    return [offset for offset, _, _, _ in _slots(layout)]


def unpack(buffer, layout: PackedLayout):
    """The tree ``pack`` packed, sliced out of i32[n] ``buffer`` (traceable)."""
    leaves = []
    for offset, n, shape, dtype in _slots(layout):
        if n == 0:  # an empty leaf is a constant, not a slice of the buffer
            leaves.append(jnp.zeros(shape, dtype))
            continue
        part = buffer[offset : offset + n].reshape(shape)
        leaves.append(part if dtype == "int32" else jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)))
    return jax.tree.unflatten(layout.treedef, leaves)


def repack(buffer, layout: PackedLayout, old, new):
    """``buffer`` (``layout``'s, holding the tree ``old``, as ``unpack`` gave it) with every
    leaf of ``new`` that is not ``old``'s own object written over its slice (traceable): the
    device-side ``pack`` of a tree that differs from the buffer's in a few leaves, a few
    in-place updates. ValueError names a leaf whose shape or dtype is not the layout's."""
    leaves, treedef = jax.tree.flatten(new)
    if treedef != layout.treedef:
        raise ValueError(f"the tree's structure {treedef} is not the layout's {layout.treedef}")
    slots = zip(leaves, jax.tree.leaves(old), _slots(layout), strict=True)
    for i, (leaf, before, (offset, n, shape, dtype)) in enumerate(slots):
        if leaf is before:
            continue
        if tuple(leaf.shape) != tuple(shape) or jnp.dtype(leaf.dtype) != jnp.dtype(dtype):
            got = f"{jnp.dtype(leaf.dtype)}{list(leaf.shape)}"
            raise ValueError(f"leaf {i} is {got}; the layout has {dtype}{list(shape)}")
        flat = jnp.asarray(leaf).reshape(n)
        if dtype != "int32":
            flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
        buffer = jax.lax.dynamic_update_slice(buffer, flat, (offset,))
    return buffer
