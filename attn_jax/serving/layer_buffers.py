"""Each layer's weight matrices as one buffer: fewer arguments for the jitted step to pass.

Every array a jitted call takes costs the call's dispatch host time (about 2 us a leaf on an
H200 host, BENCHMARKS.md), and a one-step decode call is host-bound: SmolLM2's 30 layers of
4 weight matrices were 120 of its step's ~158 argument leaves. ``fuse_params`` stores every
matrix [out, in], and ``LlamaModel.row_matrices`` names them. ``pack_layers`` stacks a
layer's named matrices that end in the hidden size H (``wqkv`` and ``w_gate_up``, ``wo``
[H, Hq*D] where Hq*D = H, ``w_down`` [H, I] where I = H), each as its ``[-1, H]`` rows, into
one ``[N, H]`` buffer; ``unpack_layer``, traced inside the step, slices each back out as a
block of rows and reshapes it (a bitcast). XLA reads such a block in place, also when it
splits the matmul's sum (split-K) over the block's last dimension. A block summed over its
rows instead (a matrix stored [in, out]) was copied out every step when XLA split its sum, and
so were matrices stored transposed or sliced from a flat buffer (BENCHMARKS.md, stops 65 and
66): so a model that does not name its [out, in] matrices is not packed. Every layer has the
same ``LayerLayout``, so each of the step's per-layer matmul fusions stays one computation
(autotuned once, as with separate arrays). Other arrays (biases, ``w_down`` where I != H) stay
arrays beside the buffer.

Example::

    layout = model_layout(model, params)                # None: nothing to pack
    layers = pack_layers(params["layers"], layout)
    layer = unpack_layer(layers[0], layout)             # {"wqkv": ..., "wo": ..., ...}
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ROWS = "rows"
"""The key of a packed layer's ``[N, H]`` buffer (``fuse_params`` names no array so)."""


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Where a layer's matrices lie in its buffer's rows: (name, first row, shape) each, by
    name; ``others`` the names kept as arrays; ``rows`` x ``hidden_size`` the buffer's shape,
    of ``itemsize``-byte elements."""

    entries: tuple[tuple[str, int, tuple[int, ...]], ...]
    others: tuple[str, ...]
    rows: int
    hidden_size: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        """A layer's buffer's bytes."""
        return self.rows * self.hidden_size * self.itemsize


def layer_layout(layer: Mapping, hidden_size: int, names: Sequence[str]) -> LayerLayout | None:
    """The layout of ``layer`` (name -> array): its matrices among ``names`` (stored [out, in])
    that end in ``hidden_size`` packed, by name (as jax orders a dict's leaves); None when fewer
    than two would pack (nothing to gain) or their dtypes differ."""
    entries, others, row, dtypes = [], [], 0, set()
    for name, a in sorted(layer.items()):
        shape = tuple(a.shape)
        if name not in names or len(shape) < 2 or shape[-1] != hidden_size:
            others.append(name)
            continue
        entries.append((name, row, shape))
        row += math.prod(shape[:-1])
        dtypes.add(np.dtype(a.dtype))
    if len(entries) < 2 or len(dtypes) != 1:
        return None
    return LayerLayout(tuple(entries), tuple(others), row, hidden_size, dtypes.pop().itemsize)


def model_layout(model, params: Mapping) -> LayerLayout | None:
    """The layout ``ModelRunner`` packs ``params``' layers in for ``model``: the matrices the
    model stores [out, in] (its ``row_matrices``; ``LlamaModel``'s) that end in H; None when the
    model names none, its layers are not a list of dicts, a model axis splits its matrices
    (each along its own axis), or the layers' layouts differ: then they stay as they are."""
    names, layers = getattr(model, "row_matrices", ()), params.get("layers")
    if not names or getattr(model, "attn_sharded", False) or getattr(model, "mlp_sharded", False):
        return None
    if not isinstance(layers, (list, tuple)) or not layers:
        return None
    hidden_size = model.config.hidden_size
    layout = layer_layout(layers[0], hidden_size, names)
    if layout is None or any(layer_layout(layer, hidden_size, names) != layout for layer in layers[1:]):
        return None
    return layout


def pack_layers(layers: Sequence[Mapping], layout: LayerLayout) -> list[dict]:
    """Each layer as ``{ROWS: its [N, H] buffer, **the arrays kept}`` in ``layout`` (NumPy when
    its matrices are NumPy, else on their device: then a copy of them, the caller's arrays
    untouched)."""
    out = []
    for layer in layers:
        matrices = [layer[name] for name, _, _ in layout.entries]
        if all(isinstance(a, np.ndarray) for a in matrices):
            rows = np.concatenate([a.reshape(-1, layout.hidden_size) for a in matrices])
        else:
            rows = _stack_rows(matrices, layout.hidden_size)
        out.append({ROWS: rows, **{name: layer[name] for name in layout.others}})
    return out


@functools.partial(jax.jit, static_argnums=1)
def _stack_rows(matrices, hidden_size: int):
    """``pack_layers``' buffer of device arrays (one program a layout)."""
    return jnp.concatenate([a.reshape(-1, hidden_size) for a in matrices])


def unpack_layer(layer: Mapping, layout: LayerLayout) -> dict:
    """The layer's arrays (name -> array of its shape) from ``pack_layers``' dict, each matrix
    a block of the buffer's rows, reshaped (traced: read in place; concrete: a copy each)."""
    rows = layer[ROWS]
    out = {name: rows[first : first + math.prod(shape[:-1])].reshape(shape) for name, first, shape in layout.entries}
    return {**out, **{name: layer[name] for name in layout.others}}


@functools.partial(jax.jit, static_argnums=1)
def unpack_copy(layer: Mapping, layout: LayerLayout) -> dict:
    """``unpack_layer`` of a concrete layer on its device: one program a layout, each array a copy."""
    return unpack_layer(layer, layout)
