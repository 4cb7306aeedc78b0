"""Every benchmark script answers --help without running, and writes results only when asked."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
COMMITTED = [ROOT / "benchmarks" / "results", ROOT / "attn_jax" / "ops" / "ragged_paged_attention" / "tuned"]
ENV = os.environ | {"JAX_PLATFORMS": "cpu"}


def _fingerprint() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in COMMITTED
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run(script: pathlib.Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_every_script_answers_help_and_writes_nothing():
    """Each script as ``python SCRIPT --help`` runs it, all in one interpreter
    (tests/benchmark_help_worker.py: jax and the package imported once, not once a script)."""
    before = _fingerprint()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmark_help_worker", *map(str, SCRIPTS)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert list(results) == list(map(str, SCRIPTS))
    for script in SCRIPTS:
        result = results[str(script)]
        assert result["returncode"] == 0, f"{script.name} --help: {result['stderr']}"
        assert result["stdout"].startswith(f"usage: {script.name}"), (
            f"{script.name} --help printed {result['stdout'][:200]!r}"
        )
    assert _fingerprint() == before, "a --help run changed committed results"


def test_a_run_without_write_writes_nothing(tmp_path):
    script = ROOT / "benchmarks" / "tpu_block_tables.py"
    before = _fingerprint()
    result = _run(script)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tables not written: pass --write or --out DIR" in result.stdout
    assert _fingerprint() == before
    result = _run(script, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    committed = ROOT / "attn_jax" / "ops" / "ragged_paged_attention" / "tuned" / "tpu_v6e.json"
    assert json.loads((tmp_path / "tpu_v6e.json").read_text()) == json.loads(committed.read_text())
    assert _fingerprint() == before


def test_sampling_cost_times_every_program_and_the_samplers_agree_on_a_top_k_of_one(tmp_path):
    """``sampling_cost.py`` runs every program it names on a small batch (a compile time and a
    median each); its samplers, the engine's and the two it is timed against, all give the
    argmax for a top-k of 1."""
    result = _run(
        ROOT / "benchmarks" / "sampling_cost.py", "--rows", "3", "--vocab", "300", "--out", str(tmp_path / "s.json")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads((tmp_path / "s.json").read_text())["rows"]
    names = {k.removesuffix("_ms") for k in row if k.endswith("_ms")}
    assert {"argmax", "greedy_scores", "sample_tokens", "sort_sampler", "bisection_sampler"} <= names
    assert all(row[f"{n}_ms"] > 0 and row[f"{n}_compile_s"] > 0 for n in names)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from sampling_cost import bisection_sampler, sort_sampler
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from attn_jax.serving.sampling import sample_tokens

    logits = np.random.default_rng(0).normal(0, 3, (4, 300)).astype(np.float32)
    t, p, k = np.float32([0.7, 1.0, 1.5, 0.0]), np.float32([1.0, 0.5, 0.9, 1.0]), np.int32([1, 1, 1, 0])
    seeds, counters = np.arange(4, dtype=np.uint32), np.zeros(4, np.int32)
    for sampler in (sample_tokens, sort_sampler, bisection_sampler):
        np.testing.assert_array_equal(np.asarray(sampler(logits, t, p, k, seeds, counters)), logits.argmax(-1))


def test_write_and_out_are_exclusive():
    result = _run(ROOT / "benchmarks" / "metadata_build.py", "--write", "--out", "x.json")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_generate_gpu_detokenizes_only_the_tokenizers_own_vocabulary(tmp_path):
    """``generate_gpu.py --detokenize`` gives the engine the embedded SmolLM2's tokenizer, or
    with a folder the one ``GGUFTokenizer.save`` wrote there (the same tokenizer here), which a
    shape of another vocabulary cannot use, nor a folder without one: usage errors before
    anything is measured."""
    from attn_jax.testing.models import MODEL_SHAPES

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from generate_gpu import text_tokenizer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tokenizer = text_tokenizer(MODEL_SHAPES["smollm2-135m"]())
    assert tokenizer.decode(tokenizer.encode("Paris is"), skip_special_tokens=True) == "Paris is"
    tokenizer.save(tmp_path / "tok")
    saved = text_tokenizer(MODEL_SHAPES["smollm2-135m"](), str(tmp_path / "tok"))
    ids = tokenizer.encode("Paris is the capital of France")
    assert saved.encode("Paris is the capital of France") == ids and saved.decode(ids) == tokenizer.decode(ids)
    result = _run(ROOT / "benchmarks" / "generate_gpu.py", "--model", "llama3-8b-8l", "--detokenize")
    assert result.returncode == 2
    assert "--detokenize needs a model of the embedded SmolLM2's vocabulary (49152 tokens)" in result.stderr
    assert "llama3-8b-8l has 128256" in result.stderr
    result = _run(ROOT / "benchmarks" / "generate_gpu.py", "--detokenize", str(tmp_path / "none"))
    assert result.returncode == 2 and str(tmp_path / "none") in result.stderr


def test_engine_step_profile_replays_the_engines_last_decode_call():
    """``engine_step_profile.py``'s device-only timing runs the engine's last decode call again
    and again, the caches and rows' state fed back; the call's packed inputs were donated to it,
    so each replay takes a copy of the ones the engine holds for its next call (reusing the
    donated ones failed from stop 59 until stop 62). The engine then runs on to the end."""
    from attn_jax.serving import SamplingParams
    from attn_jax.testing.models import tiny_random_engine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from engine_step_profile import device_only_step_ms
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    engine = tiny_random_engine(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in ([5, 6, 7], [9, 10])]
    for _ in range(4):  # the prefill, then decodes continuing on the device
        engine.step()
    times = device_only_step_ms(engine, 3)
    assert set(times) == {"chained_tokens", "copy_to_host_async", "read_previous"}
    assert all(t > 0 for t in times.values()), times
    while engine.has_unfinished():
        engine.step()
    assert [len(engine.get_request(i).output_ids) for i in ids] == [12, 12]


def test_engine_admission_profile_keeps_the_engine_admitting():
    """``engine_admission_profile.py``'s load keeps its slots full and prompts waiting, so calls
    admit prompts beside the running decodes as fast as slots free (a slot frees once its last
    tokens are read back; a step whose admission call runs behind another also dispatches the
    call after it), compiling nothing new; its figures are the calls' own, by kind."""
    from attn_jax.testing.models import tiny_random_engine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from engine_admission_profile import AdmissionLoad, measure
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    engine = tiny_random_engine(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=40)
    load = AdmissionLoad(engine, slots=8, life=4, admit=2, prompt_len=12, vocab_size=engine.model.config.vocab_size)
    result = measure(engine, load, steps=6, warmup_steps=12, trace=False)
    assert result["step_runs"] == 6 and 6 <= result["calls"] <= 12 and result["compilations_during"] == 0, result
    assert result["admitting_calls"] >= 3, result
    admitting = result["median_by_kind"]["admitting"]
    assert admitting["calls"] == result["admitting_calls"] and admitting["prefill_tokens"] >= 12
    assert admitting["decode_tokens"] >= 1 and admitting["requests"] <= 8 and admitting["host_ms"] > 0
    assert result["wall_ms_per_call"] > 0 and 0 < result["host_cpu_share"] <= 1.5


@pytest.mark.slow
def test_attention_fp8_runs_tiny_on_the_cpu_within_its_bound(tmp_path):
    """The FP8 P1 script's whole path at a tiny size (PALLAS_GPU in the interpreter): layers, oracle, JSON."""
    out = tmp_path / "fp8.json"
    result = _run(ROOT / "benchmarks" / "attention_fp8.py", "--query-lens", "40,24", "--num-q-heads", "4",
                  "--num-kv-heads", "2", "--head-size", "32", "--rows", "16", "--reps", "1",
                  "--layers", "fp8_attention,bf16", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    fp8, bf16 = json.loads(out.read_text())["results"]
    assert fp8["layer"] == "fp8_attention" and fp8["within_bound"], fp8
    assert 0 < fp8["rel_l2_vs_quantized_oracle"] <= fp8["bound"] == 3e-2
    assert bf16["rel_l2_vs_unquantized_oracle"] < 1e-2, bf16


@pytest.mark.slow
def test_prefix_cache_benchmark_runs_s1_small_on_the_cpu(tmp_path):
    """benchmarks/prefix_cache.py at a tiny size, cascade thresholds lowered: the prefix is
    computed once with caching on, cascade runs, the tokens agree, and the JSON says so."""
    out = tmp_path / "s1.json"
    result = _run(
        ROOT / "benchmarks" / "prefix_cache.py", "--model", "tiny", "--requests", "4", "--prefix-len", "64",
        "--unique-len", "8", "--new-tokens", "4", "--max-num-batched-tokens", "128", "--cascade-min-prefix", "16",
        "--cascade-min-requests", "2", "--num-scheduler-steps", "1", "--modes", "off", "on+cascade", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    off, cascade = data["results"]["off"], data["results"]["on+cascade"]
    assert off["prompt_tokens_computed"] == 4 * 72 and cascade["prompt_tokens_computed"] == 64 + 4 * 8
    assert cascade["cascade_calls"] > 0 and cascade["cascade_prefix_len_max"] == 64
    assert cascade["greedy_tokens_identical_to_off"]
    assert "on+cascade" in result.stdout and "TTFT p50" in result.stdout


def test_paged_stream_ceiling_lowers_for_cuda_on_the_cpu():
    """The streaming-only kernel (the MLA decode's read ceiling) lowers at two ring depths."""
    result = _run(ROOT / "benchmarks" / "paged_stream_ceiling.py", "--lower", "--configs", "1:1,2:3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("lowered (True)") == 2, result.stdout


def test_cold_start_sums_the_step_programs_logged_compile_phases():
    """``serve_cold_start.py --log-compiles``: each phase JAX logs for ``_device_step``
    (tracing, lowering, XLA) summed over the programs; other functions are left out."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports results_io from its folder
    try:
        spec = importlib.util.spec_from_file_location(
            "serve_cold_start_under_test", ROOT / "benchmarks" / "serve_cold_start.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lines = [
        "WARNING:jax._src.pjit:Finished tracing _device_step for jit in 1.5 sec",
        "WARNING:jax._src.interpreters.pxla:Finished jaxpr to MLIR module conversion jit(_device_step) in 0.25 sec",
        "WARNING:jax._src.interpreters.pxla:Finished XLA compilation of jit(_device_step) in 4.0 sec",
        "WARNING:jax._src.interpreters.pxla:Finished XLA compilation of jit(_device_step) in 2.5 sec",
        "WARNING:jax._src.interpreters.pxla:Finished XLA compilation of jit(write_kv) in 9.0 sec",
        "attn-stack serve: warmed up 2 step shapes",
    ]
    assert module.compile_log_totals(lines) == {
        "trace": {"seconds": 1.5, "count": 1},
        "lower": {"seconds": 0.25, "count": 1},
        "xla": {"seconds": 6.5, "count": 2},
    }


def test_gc_pauses_counts_collections_by_generation_and_stamp():
    """``gc_pauses.GcPauses``: a full collection inside the recording counts once in generation
    2 with its time, under its stamp; none after the recording has stopped."""
    import gc

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gc_pauses import GcPauses
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tick = [0]
    with GcPauses(lambda: tick[0]) as pauses:
        gc.collect()
        tick[0] = 5
        gc.collect()
    gc.collect()
    everything, later = pauses.summary(), pauses.summary(since=5)
    assert everything["gen2"]["collections"] == 2 and everything["gen2"]["ms"] > 0
    assert later["gen2"]["collections"] == 1 and set(later) == {"gen0", "gen1", "gen2"}


def test_http_process_cpu_serves_the_app_over_a_stand_in_core(tmp_path):
    """``http_process_cpu.py``: the real app streams every request's tokens from the stand-in
    core (each event read), and the server's CPU per request and per token come out."""
    out = tmp_path / "http.json"
    args = ["--concurrency", "4", "--requests", "16", "--max-tokens", "5", "--tokens-per-round", "2", "--out", str(out)]
    result = _run(ROOT / "benchmarks" / "http_process_cpu.py", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    r = json.loads(out.read_text())
    # Each streamed request: one event per token (the last with its finish reason), then [DONE].
    assert r["one_token"]["events"] == 16 * (1 + 1) and r["many_tokens"]["events"] == 16 * (5 + 1)
    assert r["server_cpu_ms_per_request"] > 0 and r["many_tokens"]["server_cpu_s"] > 0


def test_graph_updates_reads_xla_command_buffer_log():
    """The measured phase's lines of XLA's ``command_buffer_thunk`` log, as they read on the
    H200 (stop 59), summarised; lines before the phase's first mark are not counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports results_io from its folder
    try:
        import graph_updates
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    line = "I1129 15:40:11.5 7182 command_buffer_thunk.cc:{}] {}"
    before = line.format(240, "Updated command buffer in 9999 μs; num_commands=420")
    during = [
        line.format(255, "Update command buffer on device #0 by recoding command buffer cmd sequence after 1 "
                         "executions since last update; num_commands=420; updated_allocs=4"),
        line.format(262, "Updated command buffer in 230 μs; num_commands=420"),
        line.format(280, "Execute command buffer on device #0; num_executions=1"),
        line.format(255, "Update command buffer on device #0 by recoding command buffer cmd sequence after 1 "
                         "executions since last update; num_commands=420; updated_allocs=5"),
        line.format(262, "Updated command buffer in 240 μs; num_commands=420"),
        line.format(280, "Execute command buffer on device #0; num_executions=1"),
        line.format(280, "Execute command buffer on device #0; num_executions=2"),
    ]  # fmt: skip
    log = "\n".join([before, f"{graph_updates.MARK} begins", *during, f"{graph_updates.MARK} ends", before])
    assert graph_updates.summarize_log(log) == {
        "graph_executions": 3, "graph_updates": 2, "graph_update_us_median": 235.0, "graph_commands": [420],
        "moved_allocations_per_update": {4: 1, 5: 1},
    }  # fmt: skip


def test_layer_layout_gives_the_engine_the_same_tokens_in_every_layout():
    """``layer_layout.py``'s stacked layouts (stop 63's measurement) keep the tiny engine's tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from layer_layout import LAYOUTS
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = (
        "import sys; sys.path.insert(0, 'benchmarks'); import layer_layout; layer_layout.patch(sys.argv[1])\n"
        "from attn_jax.serving import SamplingParams\nfrom attn_jax.testing.models import tiny_random_engine\n"
        "e = tiny_random_engine(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)\n"
        "sp = SamplingParams(max_new_tokens=6, ignore_eos=True)\n"
        "out = e.generate([list(range(10, 30)), list(range(40, 47))], sp)\n"
        "p = e.runner.params\n"
        "print('LAYERS', type(p['layers']).__name__, sorted(p), [c.output_ids for c in out])\n"
    )  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(
            lambda layout: subprocess.run([sys.executable, "-c", script, layout], cwd=ROOT, env=ENV,
                                          capture_output=True, text=True, timeout=300),
            LAYOUTS,
        ))  # fmt: skip
    lines = {}
    for layout, run in zip(LAYOUTS, runs, strict=True):
        assert run.returncode == 0, run.stderr[-2000:]
        lines[layout] = next(x for x in run.stdout.splitlines() if x.startswith("LAYERS "))
    tokens = {layout: line.split("] ", 1)[1] for layout, line in lines.items()}
    assert len(set(tokens.values())) == 1, tokens
    assert lines["per_layer"].startswith("LAYERS list") and lines["stacked_static"].startswith("LAYERS dict")
    assert "'layer_ids'" in lines["stacked_dynamic"] and "'layer_ids'" not in lines["stacked_static"]


def test_generate_gpu_times_each_engine_call_and_finds_the_busy_threads():
    """``generate_gpu.py``'s host CPU time per call is measured around ``Engine.step_runs`` (what
    ``generate`` calls; it read NaN while it wrapped ``step``), and each run lists the threads
    that were busy, the engine's main thread among them; a sampled run (``--temperature``)
    records its sampling values."""
    import argparse
    import threading

    from attn_jax.models.llama import init_params
    from attn_jax.testing.models import tiny_random_config

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from generate_gpu import busy_threads, run_engine, threads_cpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    config = tiny_random_config()
    args = argparse.Namespace(
        block_size=16, dtype="float32", max_num_batched_tokens=64, prompt_len=16, new_tokens=24, kv_cache_gib=1,
        no_prefix_caching=False, gc_freeze=False, temperature=0.8, top_p=0.9, top_k=40,
    )  # fmt: skip
    result = run_engine(config, init_params(config, seed=0), 2, args, None, repeats=2)
    assert (result["temperature"], result["top_p"], result["top_k"]) == (0.8, 0.9, 40)
    assert len(result["repeats"]) == 2
    for run in result["repeats"]:
        assert run["host_cpu_ms_per_call_median"] > 0
        main = [t for t in run["busy_threads"] if t["main"]]
        assert len(main) == 1 and 0 < main[0]["busy"] <= 1.5
    before = threads_cpu()
    assert before[threading.main_thread().native_id][0]  # a name
    after = {tid: (name, seconds + 0.5, cpu) for tid, (name, seconds, cpu) in before.items()}
    rows = busy_threads(before, after, 1.0)
    assert len(rows) == len(before) and all(r["busy"] == pytest.approx(0.5) for r in rows)
    assert busy_threads(before, after, 100.0) == []  # 0.005 of a core is below the 0.02 shown


def test_engine_host_parts_splits_each_continued_call(monkeypatch):
    """``engine_host_parts.py`` times each part of the engine's continued one-step calls: every
    part ran in them, and together they stay within the call's own CPU time."""
    import argparse

    from attn_jax.models.llama import init_params
    from attn_jax.testing.models import tiny_random_config

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import engine_host_parts

    config = tiny_random_config()
    args = argparse.Namespace(
        block_size=16, dtype="float32", attn_backend=None, prompt_len=16, new_tokens=40, kv_cache_gib=1,
        no_prefix_caching=False, repeats=2,
    )  # fmt: skip
    call: dict = {}
    engine_host_parts.patch_parts(call, monkeypatch.setattr)
    row = engine_host_parts.run_batch(config, init_params(config, seed=0), 2, 1, args, call)
    assert len(row["runs"]) == 2
    for run in row["runs"]:
        assert run["steady_calls"] > 20 and 0 < run["calls_with_page_delta"] < run["steady_calls"]
        parts = [run[f"{p}_cpu_ms"] for p in engine_host_parts.PARTS if p != "read_tokens"]  # read: inside _resolve
        assert all(x > 0 for x in parts) and sum(parts) <= run["total_cpu_ms"] * 1.2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pin_main_thread_puts_the_main_thread_alone_on_a_core(tmp_path):
    """``pin_main_thread.py``: the script it runs finds its main thread on one CPU, and jax's
    client threads (started before the move) on the others."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, threading\n"
        "main = threading.main_thread().native_id\n"
        "others = {t for t in os.listdir('/proc/self/task') if int(t) != main}\n"
        "print('MAIN', sorted(os.sched_getaffinity(0)))\n"
        "print('OTHERS', sorted({c for t in others for c in os.sched_getaffinity(int(t))}))\n"
    )  # fmt: skip
    result = _run(ROOT / "benchmarks" / "pin_main_thread.py", str(probe))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("MAIN", "OTHERS")))
    main, others = json.loads(lines["MAIN"]), json.loads(lines["OTHERS"])
    assert len(main) == 1 and others and main[0] not in others


def test_ncu_summary_sets_raw_metrics_and_sass_opcodes_side_by_side(tmp_path, capsys):
    """``ncu_summary.py``: raw pages give one row a metric, a column a kernel, and each kernel's
    stall reasons as shares; source pages give executions and stall shares by opcode
    (predicates and modifiers dropped), the opcodes that differ most between kernels first."""
    import gzip

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ncu_summary
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    stall = "smsp__pcsamp_warps_issue_stalled_"
    names = f'"ID","Kernel Name","gpu__time_duration.sum","{stall}barrier","{stall}wait"'
    for kernel, time_us, barrier in (("ours", "931.36", 30), ("peer", "850.53", 10)):
        (tmp_path / f"ncu_{kernel}_raw.csv").write_text(
            f'==PROF== a line that is not a row\n{names}\n"","","us","",""\n"0","k","{time_us}","{barrier}","10"\n'
        )
    assert ncu_summary.main([str(tmp_path / "ncu_ours_raw.csv"), str(tmp_path / "ncu_peer_raw.csv")]) == 0
    out = capsys.readouterr().out
    assert "| duration (`gpu__time_duration.sum`) | 931.36 us | 850.53 us |" in out
    assert "**ours**, warp-stall samples by reason: barrier 75.0 %, wait 25.0 %" in out
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
              '"Instructions Executed"')  # fmt: skip
    ffma = '"0x0","FFMA R1, R2, R3, R4","{}","5","1000000"'
    for kernel, rows in (
        ("ours", [ffma.format(10), '"0x10","@!P1 IMAD.U32 R1, RZ, RZ, UR6","30","5","3000000"']),
        ("peer", [ffma.format(20), '"0x10","IMAD.MOV.U32 R1, RZ, RZ, R2","20","5","500000"']),
    ):
        with gzip.open(tmp_path / f"ncu_{kernel}_sass_x.csv.gz", "wt") as f:
            f.write('"Kernel Name","k"\n' + header + "\n" + "\n".join(rows) + "\n")
    assert ncu_summary.main([str(tmp_path / "ncu_ours_sass_x.csv.gz"), str(tmp_path / "ncu_peer_sass_x.csv.gz")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| IMAD | 3.0 | 75.0 | 0.5 | 50.0 |"  # differs most: first
    assert lines[3] == "| FFMA | 1.0 | 25.0 | 1.0 | 50.0 |"
    assert lines[-1] == "| all | 4.0 | 100 | 1.5 | 100 |"
