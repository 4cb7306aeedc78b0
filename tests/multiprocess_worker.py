"""One process of a multi-process engine run (tests/test_distributed.py starts two with
``python -m attn_jax.launch``): joins the others, serves a tiny model over a mesh of every
process's devices, and process 0 prints the tokens as JSON."""

from __future__ import annotations

import json

from attn_jax.distributed import initialize_from_env, is_main_process

assert initialize_from_env(), "started without attn_jax.launch's environment"

import jax  # noqa: E402

from attn_jax.sharding import local_model_kwargs, make_mesh  # noqa: E402
from tests.multiprocess_case import CONFIG, generate  # noqa: E402

mesh = make_mesh(jax.device_count(), model_parallel=1)
tokens = generate(mesh, local_model_kwargs(CONFIG, mesh))
if is_main_process():
    print("RESULT " + json.dumps({"tokens": tokens, "processes": jax.process_count(), "mesh": dict(mesh.shape)}))
