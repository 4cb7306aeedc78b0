"""One process of a multi-process engine run (tests/test_distributed.py starts two with
``python -m attn_jax.launch``): joins the others, serves a tiny model over a mesh of every
process's devices, and process 0 prints the tokens as JSON, with each process's engine
limits when the processes offer different KV cache budgets (every one must build the same
cache: the smallest)."""

from __future__ import annotations

import json

from attn_jax.distributed import initialize_from_env, is_main_process

assert initialize_from_env(), "started without attn_jax.launch's environment"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from attn_jax.models.llama import LlamaModel, init_params  # noqa: E402
from attn_jax.serving import Engine  # noqa: E402
from attn_jax.serving.model_runner import kv_cache_bytes_per_block  # noqa: E402
from attn_jax.sharding import local_model_kwargs, make_mesh  # noqa: E402
from tests.multiprocess_case import CONFIG, generate  # noqa: E402

mesh = make_mesh(jax.device_count(), model_parallel=1)
tokens = generate(mesh, local_model_kwargs(CONFIG, mesh))
model = LlamaModel(CONFIG, block_size=4, **local_model_kwargs(CONFIG, mesh))
budget = (20 + 8 * jax.process_index()) * kv_cache_bytes_per_block(model)  # as free memory may differ
engine = Engine(model, init_params(CONFIG, seed=2), mesh=mesh, max_model_len=48, kv_cache_bytes=budget)
limits = multihost_utils.process_allgather(
    np.array([engine.num_blocks, engine.max_num_seqs, engine.max_num_batched_tokens])
)
if is_main_process():
    result = {"tokens": tokens, "processes": jax.process_count(), "mesh": dict(mesh.shape), "limits": limits.tolist()}
    print("RESULT " + json.dumps(result))
