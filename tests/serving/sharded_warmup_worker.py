"""``Engine.warmup`` on a 2 x 2 (data x model) mesh of 4 forced CPU devices; prints JSON.

Started by tests/serving/test_warmup.py in a subprocess (``XLA_FLAGS`` must be set before
jax initialises). The sharded engine serves two prompts, warms up (its scratch page is
page 0 of each data shard, held by a cached prefix), then serves prompts of 1 to 40
tokens in batches of 1 to 8; it prints the XLA compilations and step traces after the
warm-up and whether its tokens equal a one-device engine's.
"""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params  # noqa: E402
from attn_jax.serving import Engine, SamplingParams  # noqa: E402
from attn_jax.sharding import local_model_kwargs, make_mesh  # noqa: E402

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> None:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16
    )
    params = init_params(config, seed=3)
    limits = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_blocks=16, num_scheduler_steps=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 9, 17, 3, 1, 30, 2)]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [c.output_ids for c in Engine(LlamaModel(config), params, **limits).generate(prompts, sp)]

    mesh = make_mesh(4, model_parallel=2, num_kv_heads=config.num_kv_heads)
    engine = Engine(LlamaModel(config, **local_model_kwargs(config, mesh)), params, mesh=mesh, **limits)
    before_warmup = [c.output_ids for c in engine.generate(prompts[:2], sp)]
    report = engine.warmup()
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    traces = engine.num_compilations
    got = [c.output_ids for c in engine.generate(prompts, sp)]
    for batch in ([prompts[1]], prompts[:3], prompts[5:]):
        engine.generate(batch, sp)
    print(
        json.dumps(
            dict(
                shapes=report.num_shapes,
                compiles=len(compiles),
                traces=engine.num_compilations - traces,
                same=got == want,
                before_warmup_same=before_warmup == want[:2],
            )  # fmt: skip
        )
    )


if __name__ == "__main__":
    main()
