"""One buffer per step: pack / unpack round-trip every packable dtype, empty leaves and
the 256-byte alignment of each leaf; other dtypes are refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from attn_jax.serving.step_inputs import ALIGNMENT, pack, repack, unpack


def test_round_trip_keeps_values_dtypes_and_alignment():
    tree = {
        "ids": np.arange(5, dtype=np.int32),
        "temperature": np.array([0.0, 0.7, np.inf], np.float32),
        "empty": np.zeros((0,), np.int32),
        "seeds": np.array([0, 2**32 - 1], np.uint32),
        "table": np.arange(70, dtype=np.int32).reshape(7, 10),
    }
    buffer, layout = pack(tree)
    assert buffer.dtype == np.int32 and buffer.size == 5 * ALIGNMENT  # 5, 3 and 2 values: 64 each; 70: 128
    out = jax.jit(unpack, static_argnums=1)(buffer, layout)
    for name, want in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert pack(tree)[1] == layout and hash(layout) == hash(pack(tree)[1])  # a stable jit key


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match=r"leaf 0 of the step inputs has dtype float64; packable: \['int32'"):
        pack([np.zeros(3)])


def test_non_contiguous_and_scalar_leaves_round_trip():
    tree = {
        "transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,  # a view in Fortran order
        "strided": np.arange(10, dtype=np.uint32)[::3],
        "scalar": np.int32(-7),
    }
    buffer, layout = pack(tree)
    assert buffer.size == 3 * ALIGNMENT
    out = jax.jit(unpack, static_argnums=1)(buffer, layout)
    for name, want in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(want).dtype and np.array_equal(got, want), name


def test_repack_writes_the_changed_leaves_into_the_buffer():
    tree = {"ids": np.arange(5, dtype=np.int32), "t": np.array([0.5, -1.0], np.float32), "e": np.zeros(0, np.int32)}
    tree["seeds"] = np.array([2**32 - 1], np.uint32)
    buffer, layout = pack(tree)
    changed = {**tree, "ids": tree["ids"] + 7, "t": np.array([2.0, 3.0], np.float32)}

    def moved(b):
        old = unpack(b, layout)
        return repack(b, layout, old, {**old, "ids": old["ids"] + 7, "t": old["t"] * 0 + np.array([2.0, 3.0])})

    np.testing.assert_array_equal(np.asarray(jax.jit(moved)(buffer)), pack(changed)[0])
    with pytest.raises(ValueError, match=r"leaf 1 is float32\[3\]; the layout has int32\[5\]"):
        repack(buffer, layout, tree, {**tree, "ids": np.zeros(3, np.float32)})
