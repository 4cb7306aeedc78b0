"""Runs another benchmark script with the engine's weights in another layout (issue 46's
argument count per call): the per-layer arrays the engine holds, or every weight name's
layers stacked into one [L, ...] array, read by each layer as a static slice or through a
dynamic index. Measured on an H200 in stop 63 and not taken (BENCHMARKS.md): static slices
compiled the 16-token step 4.4x slower (XLA autotunes each layer's GEMM fusion on its own),
dynamic indices cost the device about 120 us a step (every layer's q/k/v weight copied).

``--layout``:

- ``per_layer``: the engine as it is (since stop 66 a layer's matrices that end in H are one
  buffer, ``serving/layer_buffers.py``: SmolLM2's weights are 63 leaves; 123 before);
- ``stacked_static``: ``w[i]`` for layer ``i``, a Python int (7 leaves);
- ``stacked_dynamic``: ``lax.dynamic_slice`` at ``ids[i]`` of a u32[L] array the runner
  holds beside the weights (8 leaves), every stack stored [L, its first dim, the rest] and each slice
  reshaped to its layer's shape. The index is data, so the layers' GEMM fusions are one
  computation to XLA's autotuner.

The patch replaces ``ModelRunner.__init__`` (it stacks the weights it was given) and
``LlamaModel.step`` (it slices them again) in this process only::

    python benchmarks/layer_layout.py --layout stacked_dynamic benchmarks/generate_gpu.py --batch 1 256
    python benchmarks/layer_layout.py --layout stacked_static benchmarks/compile_breakdown.py --programs 16:1:greedy:0
"""

from __future__ import annotations

import argparse
import math

from wrapped_script import add_script_args, checked_script, run_script  # benchmarks/, the script's folder

LAYOUTS = ("per_layer", "stacked_static", "stacked_dynamic")


def patch(layout: str) -> None:
    """Makes every ``ModelRunner`` built from now on in this process hold a ``LlamaModel``'s
    weights in ``layout`` (one of ``LAYOUTS``) and its step read them so."""
    if layout == "per_layer":
        return
    import jax
    import jax.numpy as jnp

    from attn_jax.models import llama
    from attn_jax.serving import model_runner

    step, init = llama.LlamaModel.step, model_runner.ModelRunner.__init__
    shapes: dict[str, tuple[int, ...]] = {}  # a weight name's per-layer shape

    def stacked_step(self, params, *args, **kwargs):
        layers, ids = params["layers"], params.get("layer_ids")
        if isinstance(layers, dict):
            zero = jnp.uint32(0)

            def weight(name, w, i):
                if ids is None:
                    return w[i]
                return jax.lax.dynamic_slice(w, (ids[i], zero, zero), (1, *w.shape[1:])).reshape(shapes[name])

            per_layer = [{n: weight(n, w, i) for n, w in layers.items()} for i in range(self.config.num_layers)]
            params = {k: v for k, v in params.items() if k != "layer_ids"} | {"layers": per_layer}
        return step(self, params, *args, **kwargs)

    def stacking_init(self, model, params, **kwargs):
        if kwargs.get("mesh") is not None:
            raise SystemExit("layer_layout.py patches one device's engine; this engine has a mesh")
        layers = params["layers"]
        stacked = {name: jnp.stack([jnp.asarray(w[name]) for w in layers]) for name in layers[0]}
        extra = {}
        if layout == "stacked_dynamic":
            for name, w in stacked.items():
                shapes[name] = w.shape[1:]
                stacked[name] = w.reshape(w.shape[0], w.shape[1], math.prod(w.shape[2:]))
            extra["layer_ids"] = jnp.arange(len(layers), dtype=jnp.uint32)
        init(self, model, {**params, "layers": stacked, **extra}, **kwargs)

    llama.LlamaModel.step, model_runner.ModelRunner.__init__ = stacked_step, stacking_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    add_script_args(parser)
    args = parser.parse_args()
    script = checked_script(parser, args)
    patch(args.layout)
    run_script(script, args.args)


if __name__ == "__main__":
    main()
