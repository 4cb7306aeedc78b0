"""``benchmarks/serve_load.py`` at CPU scale: a real server process, load processes with the
openai client and the offline engine, end to end; and its summary of request records."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def serve_load():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports results_io from its folder
    try:
        spec = importlib.util.spec_from_file_location("serve_load_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("serve_load_under_test", None)
        sys.path.remove(str(SCRIPT.parent))


def _record(start: float, chunks: list[float], tokens: int, error: str | None = None) -> dict:
    return dict(start=start, end=chunks[-1] + 0.001, chunk_times=chunks, completion_tokens=tokens, error=error,
                finish_reason="length")  # fmt: skip


def test_device_timeline_counts_overlaps_once_and_splits_gaps_by_length(serve_load):
    from cupti_timing import DeviceEvent, device_timeline  # benchmarks/, on the path the fixture set

    us = 1e3  # events in nanoseconds
    events = [
        DeviceEvent("a", 0 * us, 10 * us),
        DeviceEvent("b", 5 * us, 10 * us),  # overlaps a: busy 0-15
        DeviceEvent("c", 17 * us, 3 * us),  # a 2 us launch gap: busy 17-20
        DeviceEvent("d", 120 * us, 30 * us),  # 100 us idle: the host between calls
        DeviceEvent("e", 125 * us, 5 * us),  # inside d
    ]
    t = device_timeline(events, min_gap_us=20.0)
    assert t["window_ms"] == pytest.approx(0.150) and t["busy_ms"] == pytest.approx(0.048)
    assert t["idle_share"] == pytest.approx(1 - 48 / 150)
    assert (t["long_gaps"], t["long_gaps_ms"], t["long_gap_us_max"]) == (1, pytest.approx(0.1), pytest.approx(100.0))
    assert t["short_gaps_ms"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match="at least one event"):
        device_timeline([])


def test_a_trace_without_a_gpu_says_so(serve_load):
    """``--trace``'s engine side on a CPU: the trace runs, is summarised and removed, and
    the answer names the missing GPU events instead of figures."""
    state = {}
    assert serve_load.probe_answer(None, ("trace", "start"), state=state) == ("trace", {"tracing": True})
    folder = state["dir"]
    kind, answer = serve_load.probe_answer(None, ("trace", "stop"), state=state)
    assert kind == "trace" and "no GPU stream event" in answer["error"]
    assert state == {} and not os.path.exists(folder)


def test_summary_of_records(serve_load):
    records = [
        _record(0.0, [0.010, 0.012, 0.015, 0.019], 4),
        _record(0.5, [0.520, 0.530, 0.540, 0.550], 4),
        _record(1.0, [1.2], 1, error="1 completion tokens, not max_tokens=4"),
    ]
    s = serve_load.summarize(records, 4)
    assert (s["requests"], s["completed"], s["failed"], s["output_tokens"]) == (3, 2, 1, 8)
    assert s["errors"] == ["1 completion tokens, not max_tokens=4"]
    span = records[2]["end"] - 0.0
    assert s["seconds"] == pytest.approx(span) and s["output_tokens_per_s"] == pytest.approx(8 / span)
    ttfts = sorted([0.010, 0.020])
    assert s["ttft_ms"]["p50"] == pytest.approx(1e3 * ttfts[round(0.5 * (len(ttfts) - 1))])
    assert s["ttft_ms"]["mean"] == pytest.approx(15.0)
    gaps = sorted([0.002, 0.003, 0.004, 0.010, 0.010, 0.010])
    assert s["itl_ms"]["p99"] == pytest.approx(1e3 * gaps[-1]) and s["itl_ms"]["mean"] == pytest.approx(
        1e3 * sum(gaps) / len(gaps)
    )
    assert s["tpot_ms"]["mean"] == pytest.approx(1e3 * ((0.019 - 0.010) / 3 + (0.550 - 0.520) / 3) / 2)
    assert s["tokens_per_chunk"] == 1.0
    assert serve_load.percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_streamed_chunks_and_their_checks(serve_load):
    """The aiohttp client's parsing: text chunks timed, the finish reason and usage taken, an
    error event raised; a request short of its max_tokens fails, a guided one may end early."""
    record = serve_load.RequestRecord(start=0.0)
    serve_load._take_chunk(record, {"choices": [{"text": " a", "finish_reason": None}]}, 1.0)
    serve_load._take_chunk(record, {"choices": [{"text": "", "finish_reason": "length"}]}, 2.0)
    serve_load._take_chunk(record, {"choices": [], "usage": {"completion_tokens": 2}}, 3.0)
    assert (record.chunk_times, record.finish_reason, record.completion_tokens) == ([1.0], "length", 2)
    serve_load._check_tokens(record, 2)
    assert record.error is None
    serve_load._check_tokens(record, 3)
    assert record.error == "2 completion tokens, not max_tokens=3"
    guided = serve_load.RequestRecord(start=0.0, guided=True, completion_tokens=2)
    serve_load._check_tokens(guided, 3)
    assert guided.error is None
    with pytest.raises(RuntimeError, match="error event"):
        serve_load._take_chunk(record, {"error": {"message": "boom"}}, 4.0)
    request = {"max_tokens": 5, "max_tokens_range_ratio": 0.0, "logprobs": 2, "json_schema_fraction": 1.0,
               "temperature": 0.7}  # fmt: skip
    body, max_tokens, is_guided = serve_load._completion_body([7, 8, 9], request)
    assert (max_tokens, is_guided, body["max_tokens"], body["logprobs"], body["ignore_eos"]) == (5, True, 5, 2, True)
    assert body["temperature"] == 0.7
    assert body["response_format"]["type"] == "json_schema" and body["stream_options"] == {"include_usage": True}


def test_max_tokens_per_request_spread_and_repeatable(serve_load):
    prompts = serve_load.prompts_for(49152, 200, 8, seed=3)
    assert {serve_load.max_tokens_for(p, 64, 0.0) for p in prompts} == {64}
    spread = [serve_load.max_tokens_for(p, 64, 0.5) for p in prompts]
    assert spread == [serve_load.max_tokens_for(p, 64, 0.5) for p in prompts]  # the same in every process
    assert 32 <= min(spread) < 48 < 80 < max(spread) <= serve_load.longest_max_tokens(64, 0.5) == 96
    assert serve_load.max_tokens_for(prompts[0], 1, 0.9) >= 1


def test_histogram_totals_sum_every_label_set(serve_load):
    text = "\n".join([
        "# HELP attn_stack_time_to_first_token_seconds Seconds from a request's arrival to its first token.",
        'attn_stack_time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0',
        'attn_stack_time_to_first_token_seconds_sum{model_name="m"} 0.25',
        'attn_stack_time_to_first_token_seconds_count{model_name="m"} 4.0',
        'attn_stack_time_to_first_token_seconds_sum{model_name="n"} 0.5',
        'attn_stack_time_to_first_token_seconds_count{model_name="n"} 1.0',
        'attn_stack_inter_token_latency_seconds_sum{model_name="m"} 9.0',
    ])  # fmt: skip
    name = "attn_stack_time_to_first_token_seconds"
    assert serve_load.histogram_totals(text, name) == (pytest.approx(0.75), 5.0)
    assert serve_load.histogram_totals("", name) == (0, 0)


def test_queue_sampler_summarises_from_a_call_on(serve_load):
    """Samples before the phase's first call are left out; means and p90 of the rest."""

    class Engine:  # no schedulers: the sampler's thread reads zeros, which the test replaces
        stats = ()

    sampler = serve_load.QueueSampler(Engine(), interval_s=60.0)
    sampler.samples = [(0, 50, 9), (3, 10, 0), (4, 20, 2), (5, 30, 4)]
    q = sampler.summary(3)
    assert q["samples"] == 3 and q["running_mean"] == pytest.approx(20) and q["waiting_mean"] == pytest.approx(2)
    assert (q["running_p90"], q["waiting_p90"]) == (20, 2)
    assert sampler.summary(9) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread CPU time comes from Linux's /proc")
def test_cpu_marks_count_a_busy_thread_and_not_an_idle_one(serve_load):
    """A thread spinning throughout shows a core busy (a share of one when the suite's other
    worker holds the CPU too: 0.41 was seen on 2 cores); the main thread, asleep, none."""
    import threading
    import time

    spinning, done, ids = threading.Event(), threading.Event(), {}

    def spin():
        ids["spin"] = threading.get_native_id()
        spinning.set()
        while not done.is_set():
            pass

    def marks():
        both = serve_load.cpu_marks("spin", ids["spin"]) | serve_load.cpu_marks("idle", threading.get_native_id())
        return both | {"time": time.monotonic()}

    worker = threading.Thread(target=spin)
    worker.start()
    spinning.wait()
    before = marks()
    time.sleep(0.4)
    after = marks()
    done.set()
    worker.join()
    f = serve_load.cpu_fractions(before, after)
    assert set(f) == {"spin_process", "spin_thread", "idle_process", "idle_thread"}
    assert 0.2 < f["spin_thread"] <= 1.1 and f["idle_thread"] < 0.1  # clock ticks: 10 ms
    assert f["spin_process"] >= f["spin_thread"] - 0.05
    assert serve_load.thread_cpu_seconds(None) is None and serve_load.thread_cpu_seconds(2**31 - 1) is None


@pytest.mark.slow
def test_the_benchmark_runs_on_the_tiny_model(tmp_path):
    """Every request completes with exactly max_tokens tokens in both phases, the offline
    run generated the same count, and each figure the report needs is there; sampled (as an
    OpenAI client's default temperature 1 runs), with nothing compiled in traffic."""
    out = tmp_path / "serve_load.json"
    concurrency, per_client, max_tokens, poisson = 4, 2, 6, 4
    args = [
        "--model", "tiny-random", "--concurrency", str(concurrency), "--requests-per-client", str(per_client),
        "--prompt-len", "12", "--max-tokens", str(max_tokens), "--rate", "20", "--poisson-requests", str(poisson),
        "--poisson-warmup-requests", "2", "--client-procs", "1", "--max-num-batched-tokens", "64",
        "--warmup-rounds", "1", "--temperature", "1.0", "--out", str(out),
    ]  # fmt: skip
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "server / offline throughput" in result.stdout
    r = json.loads(out.read_text())
    assert r["error"] is None and r["skipped"] == []
    assert (r["workload"]["temperature"], r["workload"]["greedy"]) == (1.0, False)
    assert r["offline"]["generated_tokens"] == concurrency * max_tokens and r["offline"]["tokens_per_s"] > 0
    runs = r["offline"]["tokens_per_s_runs"]  # --offline-repeats' default: 3 timed runs, the median reported
    assert len(runs) == 3 and r["offline"]["tokens_per_s"] == sorted(runs)[1]
    for phase, requests in (("closed_loop", concurrency * per_client), ("poisson", poisson)):
        s = r[phase]
        assert (s["requests"], s["completed"], s["failed"]) == (requests, requests, 0), s["errors"]
        assert s["output_tokens"] == requests * max_tokens
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and 0 < s["e2e_ms"]["p50"]
        assert s["itl_ms"]["p50"] is not None and s["tokens_per_chunk"] >= 1
        assert s["engine_steps"]["steps"] > 0 and s["compilations_during"] == 0  # all compiled by Engine.warmup
        assert set(s["engine_steps"]["gc_pauses"]) == {"gen0", "gen1", "gen2"}  # the engine process's collections
        # where a request's time went: its headers come after its admission, the server's TTFT
        # (from the engine loop's submit) within the clients'
        assert 0 < s["time_to_headers_ms"]["mean"] <= s["ttft_ms"]["mean"]
        assert 0 < s["server_ttft_ms_mean"] <= s["ttft_ms"]["mean"] and s["server_round_delay_ms_mean"] >= 0
        kinds = s["engine_steps"]["calls_by_kind"]
        assert (
            set(kinds) <= {"decode", "mixed", "prefill"}
            and sum(k["calls"] for k in kinds.values()) == s["engine_steps"]["steps"]
        )
        assert s["engine_steps"]["queues"]["samples"] > 0
        assert 0 <= s["engine_steps"]["queues"]["running_mean"] <= concurrency
        cpu = s["server_cpu_fraction"]  # the engine's and the HTTP server's processes and main threads
        assert set(cpu) == {"engine_process", "engine_thread", "http_process", "http_thread"}
        assert cpu["engine_process"] > 0 and all(v >= 0 for v in cpu.values())
    ratio = r["closed_loop"]["output_tokens_per_s"] / r["offline"]["tokens_per_s"]
    assert r["targets"]["throughput_ratio"] == pytest.approx(ratio)
    assert r["targets"]["poisson_ttft_p50_ms"] == r["poisson"]["ttft_ms"]["p50"]
    warmup = r["offline"]["engine_warmup"]
    assert warmup["num_shapes"] == warmup["num_compilations"] == r["server"]["final"]["num_compilations"] > 0
    assert r["offline"]["compilations_during"] == 0 and r["workload"]["engine_warmup"] is True
