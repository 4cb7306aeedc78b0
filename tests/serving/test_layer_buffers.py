"""Each layer's matrices as row blocks of one buffer: the round trip, what stays an array, and the
engine holding one weight argument a layer."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_jax.models.llama import LlamaModel, init_params
from attn_jax.serving import Engine, SamplingParams
from attn_jax.serving.layer_buffers import ROWS, model_layout, pack_layers, unpack_copy, unpack_layer
from attn_jax.testing.models import tiny_random_config


@pytest.fixture(scope="module")
def biased():
    """A tiny config with q/k/v and output biases (Qwen2's and Llama's attention_bias)."""
    config = dataclasses.replace(tiny_random_config(512), qkv_bias=True, o_bias=True)
    return config, init_params(config, seed=3)


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_layers_round_trip_through_their_buffers(biased, kind):
    """Every matrix comes back exactly, traced (the step's way) and concrete; biases stay
    arrays beside the buffer; NumPy layers pack on the host, device ones on the device."""
    config, params = biased
    layers = params["layers"] if kind == "numpy" else jax.tree.map(jnp.asarray, params["layers"])
    layout = model_layout(LlamaModel(config), {**params, "layers": layers})
    packed = pack_layers(layers, layout)
    # Every matrix that ends in H packs: wo [H, Hq*D] too, as Hq*D = H here; w_down [H, I] not.
    assert {name for name, _, _ in layout.entries} == {"wqkv", "wo", "w_gate_up"}
    assert set(layout.others) == {"bqkv", "bo", "w_down"}
    h, rows = config.hidden_size, layout.rows
    for orig, layer in zip(params["layers"], packed, strict=True):
        assert set(layer) == {ROWS, "bqkv", "bo", "w_down"} and layer[ROWS].shape == (rows, h)
        assert isinstance(layer[ROWS], np.ndarray) == (kind == "numpy")
        copies = unpack_copy(layer, layout) if kind == "jax" else unpack_layer(layer, layout)
        for out in (jax.jit(lambda x: unpack_layer(x, layout))(layer), copies):
            assert set(out) == set(orig)
            for name, want in orig.items():
                np.testing.assert_array_equal(np.asarray(out[name]), want)


def test_layers_that_cannot_share_a_buffer_stay_as_they_are(biased):
    config, params = biased
    model, layers = LlamaModel(config), params["layers"]
    assert model_layout(model, {**params, "layers": []}) is None
    mixed = {**layers[0], "wo": layers[0]["wo"].astype(np.float16)}  # two dtypes
    assert model_layout(model, {**params, "layers": [mixed]}) is None
    other = {**layers[1], "wo": np.zeros((3, config.hidden_size), np.float32)}  # the layouts differ
    assert model_layout(model, {**params, "layers": [layers[0], other]}) is None
    one = {"wo": layers[0]["wo"], "w_down": layers[0]["w_down"]}  # one matrix ends in H: nothing to gain
    assert model_layout(model, {**params, "layers": [one]}) is None
    split = LlamaModel(config, model_axis="model", mlp_sharded=True)  # a model axis splits the matrices
    assert model_layout(split, params) is None
    # A model that does not name its [out, in] matrices (DeepSeekModel stores [in, out] ones,
    # which XLA would copy out of a buffer every step) is not packed, whatever their shapes.
    assert model_layout(types.SimpleNamespace(config=config), params) is None


def test_the_engine_passes_one_weight_argument_a_layer(biased):
    """The step takes each layer as its buffer and biases; ``Engine.params`` gives the model's
    layout back, and a second engine built from it generates the same tokens."""
    config, params = biased
    model = LlamaModel(config, block_size=16)
    limits = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=48)
    engine = Engine(model, params, **limits)
    assert engine.runner._layer_layout.nbytes == engine.runner.step_params["layers"][0][ROWS].nbytes
    assert all(set(layer) == {ROWS, "bqkv", "bo", "w_down"} for layer in engine.runner.step_params["layers"])
    weights = jax.tree.leaves(engine.runner.step_params)
    assert len(weights) == len(jax.tree.leaves({k: v for k, v in params.items() if k != "layers"})) + 4 * 2
    for got, want in zip(engine.params["layers"], params["layers"], strict=True):
        assert set(got) == set(want) and all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [list(range(5, 17)), list(range(30, 37))]
    first = [c.output_ids for c in engine.generate(prompts, sp)]
    again = Engine(model, engine.params, **limits)
    assert [c.output_ids for c in again.generate(prompts, sp)] == first
