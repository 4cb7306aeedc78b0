"""``Engine.warmup``: after it, traffic of any prompt length, batch size and step count
compiles nothing (counted by JAX's own backend-compile events, any function, and the
jitted step's cache), its dummy calls change no KV page a request can see, and requests
give the tokens an engine that never warmed up gives."""

from __future__ import annotations

import re
import types

import jax
import numpy as np
import pytest

from attn_jax.registry import AttentionBackendEnum
from attn_jax.serving import SamplingParams, warmup
from attn_jax.serving.model_runner import ModelRunner
from attn_jax.serving.warmup import _dummy_batch, candidate_calls, decode_step_counts, query_len_patterns
from attn_jax.testing.engine_probes import count_backend_compiles
from attn_jax.testing.models import tiny_random_engine

# 16-token steps, 1 / 2 requests, 4 pages of 16: few shapes, so the warm-up takes seconds on 2 cores.
LIMITS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_scheduler_steps=4)


@pytest.fixture(scope="module")
def executables(tmp_path_factory):
    """The executable cache folder the ``warmed`` engine fills."""
    return tmp_path_factory.mktemp("executables")


@pytest.fixture(scope="module")
def warmed(executables):
    engine = tiny_random_engine(**LIMITS)
    report = engine.warmup(workers=2, executable_cache=executables)  # two threads at once, then each run once
    return engine, report


def traffic(engine) -> list:
    """Prompts of 1 to 40 tokens, alone and in pairs, greedy, sampled and filtered (top-k,
    top-p, both: values the warm-up never saw), some stopping early; returns the completions."""
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    out = []
    for lengths in ([1], [5], [16], [17], [40], [3, 30], [2, 9], [12, 12, 7]):
        prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
        params = [
            SamplingParams(max_new_tokens=m, temperature=t, top_k=k, top_p=p, seed=i, ignore_eos=True)
            for i, (m, t, k, p) in enumerate(
                zip([3, 20, 7], [0.0, 0.8, 1.3], [0, 37, 0], [1.0, 0.93, 0.5], strict=True)
            )
        ][: len(prompts)]
        out += engine.generate(prompts, params)
    return out


def test_report_counts_shapes_and_time(warmed):
    engine, report = warmed
    assert report.num_shapes == report.num_compilations == engine.num_compilations > 0
    assert report.num_probes >= report.num_shapes and report.seconds > 0 and report.num_skipped == 0
    # With an executable cache every program is called as compiled (or loaded), never through jit's dispatch.
    assert engine.runner._jit_step._cache_size() == 0 and len(engine.runner._loaded) == report.num_shapes
    assert f"{report.num_shapes} step shapes" in report.summary() and "by 2 thread(s)" in report.summary()
    # Where the compilations went, summed over the programs (two threads at once: up to twice the wall).
    assert 0 < report.lower_seconds and 0 < report.compile_seconds
    assert report.lower_seconds + report.compile_seconds <= 2 * report.seconds
    assert f"tracing and lowering {report.lower_seconds:.1f} s" in report.summary()


def test_traffic_after_warmup_compiles_nothing(warmed):
    engine, report = warmed
    before, cache = engine.num_compilations, engine.runner._jit_step._cache_size()
    with count_backend_compiles() as compiles:
        done = traffic(engine)
    assert compiles == [] and engine.num_compilations == before and engine.runner._jit_step._cache_size() == cache
    assert any(s.num_steps == 4 for s in engine.stats) and any(s.num_prefill_tokens for s in engine.stats)
    assert all(c.finish_reason == "length" for c in done)


def test_penalty_values_after_warmup_compile_nothing(warmed):
    """Penalties are data of the sampled program: greedy rows with them, values the warm-up
    never saw, multi-step calls included, compile nothing."""
    engine, _ = warmed
    before, cache = engine.num_compilations, engine.runner._jit_step._cache_size()
    params = [
        SamplingParams(max_new_tokens=9, presence_penalty=1.1, frequency_penalty=-0.4, ignore_eos=True),
        SamplingParams(max_new_tokens=5, repetition_penalty=1.7, temperature=0.6, seed=2, ignore_eos=True),
    ]
    with count_backend_compiles() as compiles:
        done = engine.generate([[7, 7, 7], list(range(100, 130))], params)
    assert compiles == [] and engine.num_compilations == before and engine.runner._jit_step._cache_size() == cache
    assert [len(c.output_ids) for c in done] == [9, 5]


def test_warmed_engine_gives_the_cold_engines_tokens(warmed):
    engine, _ = warmed
    cold = tiny_random_engine(**LIMITS)
    got, want = traffic(engine), traffic(cold)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]


def test_a_new_engine_loads_every_program_from_the_executable_cache(warmed, executables, caplog):
    """A second engine of the same model loads the warmed engine's programs without tracing
    or compiling (``ExecutableCache``), gives its tokens, and compiles nothing in traffic; a
    damaged file is compiled again (and rewritten), with a warning."""
    engine, report = warmed
    loaded = tiny_random_engine(**LIMITS)
    with count_backend_compiles() as compiles:
        again = loaded.warmup(executable_cache=executables)
        got = traffic(loaded)
    assert again.num_loaded == report.num_shapes and again.num_compilations == loaded.num_compilations == 0
    assert "loaded from the executable cache" in again.summary() and "tracing" not in again.summary()
    assert again.lower_seconds == again.compile_seconds == 0
    # The call list the first warm-up stored: one dummy call per program, the enumeration's keys.
    assert again.listed and again.num_probes == again.num_shapes and "call list" in again.summary()
    assert loaded.runner.dispatched_keys == set(candidate_calls(loaded)[0])
    assert compiles == [] and [c.output_ids for c in got] == [c.output_ids for c in traffic(engine)]
    (folder,) = executables.iterdir()  # one fingerprint: the same model, devices and sources
    damaged = sorted(folder.glob("*.pkl"))[0]
    damaged.write_bytes(b"not a program")
    third = tiny_random_engine(**LIMITS).warmup(executable_cache=executables)
    assert (third.num_loaded, third.num_compilations) == (report.num_shapes - 1, 1)
    assert "could not be loaded" in caplog.text and damaged.read_bytes() != b"not a program"


def test_warmup_preserves_cached_pages():
    """A prefix cached before the warm-up is still served, and gives the same tokens."""
    engine = tiny_random_engine(**LIMITS)
    prompt = list(range(100, 140))
    (first,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    caches = [np.asarray(x) for x in jax.tree.leaves(engine.kv_caches)]
    axis = engine.runner._page_axes()[0]
    assert np.abs(np.take(caches[0], 0, axis=axis)).sum() > 0  # the scratch page held this prompt's keys
    engine.warmup()
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(caches, jax.tree.leaves(engine.kv_caches), strict=True))
    hits = engine.prefix_cache_stats.hits
    (again,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert engine.prefix_cache_stats.hits > hits and again.output_ids == first.output_ids


def test_warmup_refuses_a_busy_engine():
    engine = tiny_random_engine(**LIMITS)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="1 request"):
        engine.warmup()
    with pytest.raises(ValueError, match="workers=0 must be an int >= 1"):
        tiny_random_engine(**LIMITS).warmup(workers=0)


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 2), (16, 16), (64, warmup.MAX_WORKERS)])
def test_the_warmup_compiles_on_a_thread_per_core_up_to_max_workers(monkeypatch, cpus, workers):
    monkeypatch.setattr(warmup, "host_cpus", lambda: cpus)
    assert warmup.default_workers() == workers


def test_max_shapes_warms_the_likeliest_first():
    engine = tiny_random_engine(**LIMITS)
    report = engine.warmup(max_shapes=2)
    assert report.num_shapes == 2 and report.num_skipped > 0
    with count_backend_compiles() as compiles:  # a single decoding request: warmed
        engine.generate([[5]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert compiles == []


def test_max_shapes_warms_prefills_before_sampled_decode_programs():
    # A prompt's call always samples (greedy rows are exact there), and every request needs one:
    # its programs come right after the greedy decode ones, before the sampled decode twins.
    engine = tiny_random_engine(**LIMITS)
    calls, _ = candidate_calls(engine)
    order = sorted(calls.values(), key=lambda x: x[0])  # (priority, PreparedCall), the warm-up's order
    # priority = (prompt log-probabilities, sampled decode batch, prefill, cascade)
    prefills = [i for i, ((logprobs, _, prefill, _), p) in enumerate(order) if prefill and not logprobs]
    sampled_decodes = [i for i, ((_, sampled_decode, _, _), p) in enumerate(order) if sampled_decode]
    assert prefills and sampled_decodes and max(prefills) < min(sampled_decodes)
    assert all(order[i][1].sampled for i in prefills)
    engine.warmup(max_shapes=min(sampled_decodes))  # greedy decodes and prefills only
    with count_backend_compiles() as compiles:  # greedy prompts of every length: warmed
        engine.generate([[3] * 10, [4] * 5, [5]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert compiles == []


def test_patterns_cover_every_bucket_pair():
    engine = tiny_random_engine(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    patterns = list(query_len_patterns(engine.buckets, 8, 64))
    fit = type(engine.buckets).fit
    pairs = {
        (fit(engine.buckets.token_buckets, sum(p), "t"), fit(engine.buckets.request_buckets, len(p), "r"))
        for p in patterns
    }
    want = {(t, r) for t in engine.buckets.token_buckets for r in engine.buckets.request_buckets if r // 2 + 1 <= t}
    assert pairs == want
    assert all(sum(p) <= 64 and len(p) <= 8 and min(p) >= 1 for p in patterns)
    assert decode_step_counts(4, 256, 8) == [4] and decode_step_counts(100, 256, 8) == [8, 16, 32, 64, 100]


def test_the_warm_up_meets_a_mixed_batch_of_a_small_token_bucket():
    """40 decodes and a 10-token chunk lie at neither end of the 64-request bucket (1 request,
    or 64 decodes filling the 64-token bucket), and PALLAS_GPU keys a batch of decodes and a
    prefill apart ("mixed" metadata): the warm-up must compile it (an 8-step server on an
    H200 met it in traffic)."""
    backend = AttentionBackendEnum.PALLAS_GPU.get_class()
    engine = tiny_random_engine(attn_backend=backend, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=256)
    lens = (10,) + (1,) * 40
    batch = _dummy_batch(lens, 256, engine.block_size, SamplingParams(temperature=0.0))
    rows = {r: ModelRunner.request_row(r, q, {}) for r, q in zip(batch.requests, lens, strict=True)}
    prepared = engine.runner.prepare([batch], rows, [[1] * len(lens)], 1)
    assert prepared.token_bucket == 64 and prepared.key in candidate_calls(engine)[0]


def _device(platform: str, version: str):
    """A ``jax.Device`` stand-in: its ``platform`` and its client's ``platform_version``."""
    return types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version))


def test_step_programs_compile_with_cublas_dots_on_cuda_only(monkeypatch):
    """On CUDA the step programs of 256 tokens and more turn XLA's Triton GEMM fusions off
    (cuBLAS dots); elsewhere, below, or when ``XLA_FLAGS`` names the flag, XLA's defaults
    stand. A CUDA device's ``platform`` is "gpu", as a ROCm device's is: its client's platform
    version tells them apart."""
    from attn_jax.serving.model_runner import step_compiler_options

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cuda, cublas = _device("gpu", "cuda 13000"), {"xla_gpu_enable_triton_gemm": False}
    assert step_compiler_options(cuda, 256) == step_compiler_options(cuda, 2048) == cublas
    assert step_compiler_options(cuda, 64) is None  # small steps keep Triton's fused GEMMs
    assert step_compiler_options(_device("cuda", "cuda 12080"), 256) == cublas
    assert step_compiler_options(_device("gpu", "rocm 60400"), 256) is None
    assert step_compiler_options(_device("cpu", "<unknown>"), 256) is None
    assert step_compiler_options(_device("tpu", "PJRT C API"), 256) is None
    assert step_compiler_options(jax.devices("cpu")[0], 256) is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert step_compiler_options(cuda, 256) is None


@pytest.mark.gpu
def test_a_compiled_step_on_cuda_runs_its_dots_on_cublas(monkeypatch):
    """A 256-token step program XLA compiles on CUDA has no Triton GEMM fusion: its matmuls
    are cuBLAS calls (``step_compiler_options``); a 16-token one keeps them. SmolLM2's shape
    in bf16: the tiny model's dots are small enough for XLA to emit them as reductions."""
    from attn_jax.models.llama import LlamaModel
    from attn_jax.platforms import is_cuda
    from attn_jax.serving import Engine
    from attn_jax.testing.models import MODEL_SHAPES, random_params

    if not is_cuda(jax.devices()[0]):
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # read when the runner is built
    config, dtype = MODEL_SHAPES["smollm2-135m"](), jax.numpy.bfloat16
    limits = dict(LIMITS, max_num_seqs=256, max_num_batched_tokens=256)
    engine = Engine(LlamaModel(config, block_size=16, dtype=dtype), random_params(config, dtype), **limits)
    texts = {}
    for _, prepared in candidate_calls(engine)[0].values():
        if prepared.token_bucket in (16, 256) and prepared.token_bucket not in texts:
            runner = engine.runner
            texts[prepared.token_bucket] = (
                runner.jit_for(prepared).lower(*runner._step_args(prepared)).compile().as_text()
            )
    # A Triton GEMM fusion's kind is __triton_gemm or (XLA of jax 0.11) __triton_nested_gemm_fusion.
    triton = r'"kind":"__triton_(?:gemm|nested_gemm_fusion)"'
    assert not re.findall(triton, texts[256])
    assert texts[256].count('custom_call_target="__cublas') >= config.num_layers * 4  # q/k/v, o, gate/up, down
    assert len(re.findall(triton, texts[16])) >= config.num_layers * 4
