"""Runs sharded engines on 8 forced CPU devices and prints their tokens as JSON.

Started by tests/test_sharding.py in a subprocess: ``XLA_FLAGS`` must be set before jax
initialises, which pytest's worker processes have already done.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from attn_jax.metadata import MetadataBuckets  # noqa: E402
from attn_jax.models.llama import LlamaConfig, LlamaModel, init_params  # noqa: E402
from attn_jax.registry import AttentionBackendEnum  # noqa: E402
from attn_jax.serving import Engine, SamplingParams  # noqa: E402
from attn_jax.sharding import describe_mesh, local_model_kwargs, make_mesh  # noqa: E402
from attn_jax.testing.engine_probes import count_backend_compiles, record_step_call  # noqa: E402


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def small_engine(model, params, tokenizer=None, mesh=None, **kwargs) -> Engine:
    return Engine(
        model, params, tokenizer, mesh=mesh, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
        num_blocks=16, buckets=MetadataBuckets((32,), (4,), (4,)), **kwargs,
    )  # fmt: skip


def record_continued(engine: Engine) -> list:
    """Each ``continue_decode`` result of ``engine``'s runner from now on (None: built on the host)."""
    continued = []
    original = engine.runner.continue_decode

    def recording(*args, **kwargs):
        continued.append(original(*args, **kwargs))
        return continued[-1]

    engine.runner.continue_decode = recording
    return continued


def tiny() -> dict:
    """Heads that divide: attention and its cache split over the model axis, and the untied
    LM head's vocabulary."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    params = init_params(config, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 9, 17, 3, 1, 30, 2)]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out = {"single": [c.output_ids for c in small_engine(LlamaModel(config), params).generate(prompts, sp)]}
    for data, model_axis in ((2, 2),):
        mesh = make_mesh(data * model_axis, model_parallel=model_axis, num_kv_heads=config.num_kv_heads)
        model = LlamaModel(config, **local_model_kwargs(config, mesh))
        engine = small_engine(model, params, mesh=mesh)
        continued = record_continued(engine)
        out[f"{data}x{model_axis}"] = [c.output_ids for c in engine.generate(prompts, sp)]
        out[f"{data}x{model_axis}_continued"] = sum(c is not None for c in continued)
        out[f"{data}x{model_axis}_continued_across_pages"] = any(
            c is not None and c.page_delta is not None for c in continued
        )
        out[f"{data}x{model_axis}_attn_sharded"] = model.attn_sharded
        out[f"{data}x{model_axis}_head_sharded"] = model.head_sharded
        engine = small_engine(model, params, mesh=mesh, num_scheduler_steps=4)
        continued = record_continued(engine)
        out[f"{data}x{model_axis}_multistep"] = [c.output_ids for c in engine.generate(prompts, sp)]
        out[f"{data}x{model_axis}_multistep_continued"] = sum(c is not None and c.num_steps == 4 for c in continued)
        out[f"{data}x{model_axis}_multistep_calls"] = sorted({s.num_steps for s in engine.stats})
        # The engine's default buckets (6 step shapes at these limits), as the warm-up meets them in use.
        warmed = Engine(
            model, params, mesh=mesh, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_blocks=16,
            num_scheduler_steps=4,
        )  # fmt: skip
        out["warmup"] = warm_then_serve(warmed, prompts, sp)
    # Prompt and sampled log-probabilities on the mesh (the 40-token prompt in two chunks) and on one device.
    scored = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    for name, scoring in (("single", small_engine(LlamaModel(config), params)), ("mesh", engine)):
        out[f"logprobs_{name}"] = [
            [c.output_ids, c.logprobs, c.prompt_logprobs] for c in scoring.generate(prompts[:3], scored)
        ]
    return out


def warm_then_serve(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> dict:
    """A new ``engine`` serves ``prompts[3]`` (17 tokens: its full page stays cached, while the
    warm-up's scratch page is page 0 of each data shard; the other prompts meet a program it
    did not), warms up, then serves every prompt and batches of 1 to 3 of them: the shapes
    warmed, the XLA compilations and step traces after the warm-up, and the tokens of every
    prompt served after it."""
    engine.generate([prompts[3]], sp)
    report = engine.warmup()
    traces = engine.num_compilations
    with count_backend_compiles() as compiles:
        tokens = [c.output_ids for c in engine.generate(prompts, sp)]
        for batch in ([prompts[1]], prompts[:3], prompts[5:]):
            engine.generate(batch, sp)
    return dict(
        shapes=report.num_shapes, compiles=len(compiles), traces=engine.num_compilations - traces, tokens=tokens
    )


def collectives(engine: Engine, prompts: list[list[int]]) -> dict[str, int]:
    """Collective ops in the compiled HLO of the engine's decode step (``generate``, then
    the last step's arguments lowered again); a multi-step engine's last call is a
    multi-step decode (its loop body's ops counted once)."""
    sp = SamplingParams(max_new_tokens=1 + 2 * engine.num_scheduler_steps, ignore_eos=True)
    jit_step, args = record_step_call(engine, lambda: engine.generate(prompts, sp))
    hlo = jit_step.lower(*args).compile().as_text()
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {op: len(re.findall(rf"= [^=]*\b{op}(-start)?\(", hlo)) for op in ops}


def agreement() -> dict:
    """Data shards agree on static structure for every backend: one request (idle shards),
    uneven requests; tokens equal one device's. Plus the collectives of a TP and a DP step."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64
    )
    params = init_params(config, seed=1)
    rng = np.random.default_rng(1)
    cases = {
        "one": [rng.integers(0, 128, 6).tolist()],
        "uneven": [rng.integers(0, 128, n).tolist() for n in (3, 21, 2)],
    }
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    out = {}
    # One device's tokens of each case, on XLA: every backend's sharded run must give them (a
    # Pallas kernel in the interpreter compiles for seconds, so no one-device run of its own).
    single = {
        case: [c.output_ids for c in small_engine(LlamaModel(config), params).generate(prompts, sp)]
        for case, prompts in cases.items()
    }
    # Each backend's kernels in the interpreter are the slow part: every (backend, case) pair
    # that adds coverage once, the idle shards of "one" and the uneven split of "uneven".
    runs = (("XLA", "one", 4), ("XLA", "uneven", 2), ("PALLAS_GPU", "one", 2), ("PALLAS_TPU", "uneven", 2))
    engines = {}
    for backend, case, devices in runs:
        cls = AttentionBackendEnum[backend].get_class()
        mesh = make_mesh(devices, model_parallel=1)
        model = LlamaModel(config, attn_backend=cls, **local_model_kwargs(config, mesh))
        engines[backend, devices] = small_engine(model, params, mesh=mesh)
        got = engines[backend, devices].generate(cases[case], sp)
        out[f"{backend}/{case}/{devices}"] = [c.output_ids for c in got] == single[case]
    for name, (data, model_axis) in {"dp": (4, 1), "tp": (1, 2)}.items():
        mesh = make_mesh(data * model_axis, model_parallel=model_axis, num_kv_heads=config.num_kv_heads)
        for steps, suffix in ((1, ""), (3, "_multistep")):
            if (name, steps) == ("dp", 1):  # the XLA run's DP=4 engine (XLA: the CPU's default backend)
                engine = engines["XLA", 4]
            else:
                model = LlamaModel(config, **local_model_kwargs(config, mesh))
                engine = small_engine(model, params, mesh=mesh, num_scheduler_steps=steps)
            out[f"collectives/{name}{suffix}"] = collectives(engine, cases["uneven"])
    untied = dataclasses.replace(config, tie_word_embeddings=False)  # the LM head split over "model" too
    mesh = make_mesh(2, model_parallel=2)
    model = LlamaModel(untied, **local_model_kwargs(untied, mesh))
    engine = small_engine(model, init_params(untied, seed=1), mesh=mesh)
    out["collectives/tp_split_head"] = collectives(engine, cases["uneven"])
    return out


def replicated_kv_heads() -> dict:
    """3 KV heads (SmolLM2's count) on 4 devices: data 2 x model 2, attention and its cache
    replicated over the model axis while the MLP splits; the tokens equal one device's."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16
    )
    params = init_params(config, seed=5)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (6, 23, 11)]
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    single = [c.output_ids for c in small_engine(LlamaModel(config), params).generate(prompts, sp)]
    mesh = make_mesh(4, model_parallel=2, num_kv_heads=config.num_kv_heads)
    model = LlamaModel(config, **local_model_kwargs(config, mesh))
    tokens = [c.output_ids for c in small_engine(model, params, mesh=mesh).generate(prompts, sp)]
    return {"mesh": dict(mesh.shape), "attn_sharded": model.attn_sharded, "mlp_sharded": model.mlp_sharded,
            "tokens": tokens, "single": single}  # fmt: skip


def meshes_of_four() -> dict:
    """TP=4 and DP=2 x TP=2 through ``Engine.from_llama(devices=4, model_parallel=...)``
    on a model of 2 KV heads (TP=4 copies each twice) and an untied LM head: each mesh's
    tokens, one device's, and the split each describes."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    params = init_params(config, seed=4)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, n).tolist() for n in (7, 3, 12, 5)]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    limits = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, num_blocks=16)
    out = {"single": [c.output_ids for c in Engine.from_llama(config, params, **limits).generate(prompts, sp)]}
    for name, model_parallel in (("TP=4", 4), ("DP=2 x TP=2", 2)):  # DP=4: agreement()'s XLA/one/4
        engine = Engine.from_llama(config, params, devices=4, model_parallel=model_parallel, **limits)
        out[name] = {
            "tokens": [c.output_ids for c in engine.generate(prompts, sp)],
            "describe": describe_mesh(engine.mesh, engine.model.config),
            "local_kv_heads": engine.model.num_kv_heads,
        }
    return out


def smollm2_layout() -> dict:
    """``Engine.from_gguf(devices=4)`` on the embedded SmolLM2: the mesh it builds for 3 KV
    heads and where its weights and caches live (nothing compiled)."""
    engine = Engine.from_gguf(devices=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_blocks=16)
    weights = jax.tree.leaves(engine.params)
    return {
        "mesh": dict(weights[0].sharding.mesh.shape),
        "attn_sharded": engine.model.attn_sharded,
        "mlp_sharded": engine.model.mlp_sharded,
        "weight_devices": sorted({len(x.sharding.device_set) for x in weights}),
    }


def per_shard_uploads() -> dict:
    """``ShardedStep.put_per_shard`` on a data 2 x model 2 mesh: each data shard's row, given
    as a list of rows or as their stack, lands on that shard's devices (both model devices of
    a row hold it), and a row count other than the data axis's is refused."""
    from attn_jax.sharding import ShardedStep

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)  # fmt: skip
    mesh = make_mesh(4, model_parallel=2)
    step = ShardedStep(LlamaModel(config, **local_model_kwargs(config, mesh)), mesh)
    rows = [np.arange(6, dtype=np.int32).reshape(2, 3) + 10 * i for i in range(2)]
    out = {}
    for name, x in (("list", rows), ("array", np.stack(rows))):
        placed = step.put_per_shard(x)
        out[name] = bool((np.asarray(placed) == np.stack(rows)).all()) and all(
            (np.asarray(s.data) == rows[s.index[0].start or 0][None]).all() for s in placed.addressable_shards
        ) and len(placed.addressable_shards) == 4 and placed.sharding.spec[0] == "data"  # fmt: skip
    try:
        step.put_per_shard(rows[:1])
        out["refused"] = False
    except ValueError:
        out["refused"] = True
    return out


def main() -> None:
    handler = Collect()
    logging.getLogger("attn_jax").addHandler(handler)
    result = {
        "tiny": tiny(),
        "agreement": agreement(),
        "replicated": replicated_kv_heads(),
        "four": meshes_of_four(),
        "smollm2": smollm2_layout(),
        "uploads": per_shard_uploads(),
    }
    result["warnings"] = handler.messages
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
