"""Sharded serving: heads over a "model" axis, requests over a "data" axis.

The multi-device runs happen in a subprocess with 8 forced CPU devices
(tests/sharded_worker.py): tiny models whose KV heads split, and whose 3 KV heads
(SmolLM2's count) do not (replicated, with a warning), each checked token for token
against one device, and the mesh and weight placement ``Engine.from_gguf(devices=4)``
builds for SmolLM2 itself. SmolLM2's tokens are checked against transformers on one
device only (tests/serving/test_engine.py, test_cli_generate.py).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import pytest

from attn_jax.models.llama import LlamaConfig, LlamaModel
from attn_jax.sharding import check_num_devices, local_model_kwargs, make_mesh
from tests.subprocess_env import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sharded():
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharded_worker"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_tensor_parallel_heads_match_one_device(sharded):
    tiny = sharded["tiny"]
    assert tiny["2x2_attn_sharded"]  # 4 KV heads over a model axis of 2, requests over a data axis of 2
    assert tiny["2x2_head_sharded"]  # the untied LM head's 256 vocabulary columns too
    assert tiny["2x2"] == tiny["single"]
    # One-step decode calls continue the last call's inputs on the mesh too (the persistent batch),
    # across page crossings (each data shard's pages written in by its page delta).
    assert tiny["2x2_continued"] >= 5 and tiny["2x2_continued_across_pages"]


def test_multi_step_decoding_on_a_mesh_matches_one_device(sharded):
    """Four decode steps per call on a 2 x 2 mesh: the same tokens as one device, one step at a
    time; the later calls continue the last one's inputs on the mesh (the persistent batch)."""
    tiny = sharded["tiny"]
    assert tiny["2x2_multistep_calls"] == [1, 4]  # prefill calls of one step, decode calls of four
    assert tiny["2x2_multistep_continued"] >= 1
    assert tiny["2x2_multistep"] == tiny["single"]


def test_warm_up_on_a_mesh_compiles_every_program_traffic_meets(sharded):
    """``Engine.warmup`` on a new 2 x 2 4-step engine (the default buckets) after it served a
    17-token prompt (its cached page held; the warm-up's scratch page is page 0 of each data
    shard): then prompts of 1 to 40 tokens in batches of 1 to 8, which without the warm-up
    compile a program more, compile and trace nothing, and their tokens are one device's."""
    warmup = sharded["tiny"]["warmup"]
    assert warmup["shapes"] > 0 and warmup["compiles"] == 0 and warmup["traces"] == 0, warmup
    assert warmup["tokens"] == sharded["tiny"]["single"]


def test_log_probabilities_on_a_mesh_match_one_device(sharded):
    """Sampled and prompt log-probabilities (``logprobs``, ``prompt_logprobs``; a prompt in
    two chunks) gathered from the data shards of a 2 x 2 mesh: one device's, to float32
    rounding (the model axis sums attention and MLP partials in another order)."""
    single, mesh = sharded["tiny"]["logprobs_single"], sharded["tiny"]["logprobs_mesh"]
    assert len(single) == len(mesh) == 3
    for (ids, lps, prompt), (mesh_ids, mesh_lps, mesh_prompt) in zip(single, mesh, strict=True):
        assert ids == mesh_ids and prompt[0] is None and mesh_prompt[0] is None and len(prompt) == len(mesh_prompt)
        for (value, top), (mesh_value, mesh_top) in zip(lps + prompt[1:], mesh_lps + mesh_prompt[1:], strict=True):
            assert abs(value - mesh_value) < 1e-4 and [t for t, _ in top] == [t for t, _ in mesh_top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(top, mesh_top, strict=True)) < 1e-4


def test_data_shards_agree_for_every_backend(sharded):
    """One request (the other shards idle) and uneven requests, on 2 and 4 data shards:
    the shards build one static structure and the tokens equal one device's on XLA (the
    reference of every backend, as in tests/serving/test_engine_backends.py)."""
    runs = {k: v for k, v in sharded["agreement"].items() if not k.startswith("collectives/")}
    assert set(runs) == {"XLA/one/4", "XLA/uneven/2", "PALLAS_GPU/one/2", "PALLAS_TPU/uneven/2"}
    assert all(runs.values()), runs


def test_only_the_needed_collectives_cross_devices(sharded):
    """Data parallel: one all-gather of the sampled tokens and nothing else, also when a call
    runs several decode steps. Tensor parallel
    (one layer): one all-reduce after the attention output projection, one after the MLP,
    and the tokens' all-gather; no weights, caches or activations gathered."""
    none = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}
    assert sharded["agreement"]["collectives/dp"] == none | {"all-gather": 1}
    assert sharded["agreement"]["collectives/tp"] == none | {"all-reduce": 2, "all-gather": 1}
    # A multi-step decode: every step is the loop body's (counted once in the HLO); the tokens
    # of every step are gathered once, after the loop.
    assert sharded["agreement"]["collectives/dp_multistep"] == none | {"all-gather": 1}
    assert sharded["agreement"]["collectives/tp_multistep"] == none | {"all-reduce": 2, "all-gather": 1}
    # An untied LM head split over the model axis: its logits gathered once a step.
    assert sharded["agreement"]["collectives/tp_split_head"] == none | {"all-reduce": 2, "all-gather": 2}


def test_every_mesh_of_four_devices_gives_one_devices_tokens(sharded):
    """TP=4 over 2 KV heads (each copied twice, vLLM's rule: one KV head per shard) and
    DP=2 x TP=2, built by ``Engine.from_llama(devices=4, model_parallel=...)`` (DP=4:
    ``test_data_shards_agree_for_every_backend``)."""
    four = sharded["four"]
    for name in ("TP=4", "DP=2 x TP=2"):
        assert four[name]["tokens"] == four["single"], name
    assert four["TP=4"]["local_kv_heads"] == 1 and four["DP=2 x TP=2"]["local_kv_heads"] == 1
    assert four["TP=4"]["describe"] == (
        "mesh data=1 x model=4: requests over data, 2 KV heads each copied 2 times, query heads split 4 ways over model"
    )
    assert four["DP=2 x TP=2"]["describe"] == (
        "mesh data=2 x model=2: requests over data, 2 KV heads split 2 ways over model"
    )


def test_replicated_kv_heads_on_a_mesh_match_one_device(sharded):
    run = sharded["replicated"]
    assert run["mesh"] == {"data": 2, "model": 2}
    assert not run["attn_sharded"] and run["mlp_sharded"]
    assert run["tokens"] == run["single"]


def test_smollm2_from_gguf_on_four_devices_splits_requests(sharded):
    """3 KV heads over 4 devices: a data axis of 4; every weight on all four."""
    assert sharded["smollm2"] == {"mesh": {"data": 4, "model": 1}, "attn_sharded": False, "mlp_sharded": False,
                                  "weight_devices": [4]}  # fmt: skip


def test_replicated_kv_heads_are_logged(sharded):
    warnings = "\n".join(sharded["warnings"])
    assert "num_kv_heads=3 cannot be split over 4 devices" in warnings
    assert "num_kv_heads=3 does not divide over the 'model' axis of 2: attention and its KV cache are replicated" in (
        warnings
    )


def test_per_shard_inputs_reach_their_own_shards(sharded):
    """The packed inputs and page deltas go up as each data shard's row straight to its
    devices (no stacked ``device_put``, issue 48): list and stacked forms alike."""
    assert sharded["uploads"] == {"list": True, "array": True, "refused": True}


def test_bad_device_counts():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"devices=0 must be a positive integer \(this host has {n}\)"):
        check_num_devices(0)
    with pytest.raises(
        ValueError, match=rf"devices={n + 1} but only {n} cpu device\(s\) are available; on a CPU, set XLA_FLAGS"
    ):
        make_mesh(n + 1)
    with pytest.raises(ValueError, match="model_parallel=2 must divide devices=1"):
        make_mesh(1, model_parallel=2)


def test_local_model_kwargs_on_one_device():
    config = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2
    )
    mesh = make_mesh(1)
    assert local_model_kwargs(config, mesh) == dict(
        num_heads=4, num_kv_heads=2, model_axis="model", attn_sharded=False, mlp_sharded=False, head_sharded=False
    )
    assert LlamaModel(config, **local_model_kwargs(config, mesh)).num_kv_heads == 2
