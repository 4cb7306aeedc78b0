"""Several processes, one engine: two CPU processes joined by jax.distributed (started by
``python -m attn_jax.launch``) serve over a 2-way data axis and give one process's tokens."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from attn_jax.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID, initialize_from_env
from attn_jax.launch import process_env
from tests.multiprocess_case import generate
from tests.subprocess_env import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_two_processes_serve_like_one():
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "attn_jax.launch", "-n", "2", "--", sys.executable, "-m", "tests.multiprocess_worker"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["processes"] == 2 and result["mesh"] == {"data": 2, "model": 1}
    assert result["tokens"] == generate()
    # Offered 20 and 28 pages' bytes, both processes built 20 pages, with the same limits.
    assert result["limits"][0] == result["limits"][1] and result["limits"][0][0] == 20


def test_process_env_gives_each_process_its_rank_and_devices():
    env = process_env({"XLA_FLAGS": "--xla_foo --xla_force_host_platform_device_count=8"}, process_id=1,
                      num_processes=2, port=1234, devices=2)  # fmt: skip
    assert env[COORDINATOR] == "127.0.0.1:1234" and env[NUM_PROCESSES] == "2" and env[PROCESS_ID] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["XLA_FLAGS"] == "--xla_foo --xla_force_host_platform_device_count=2"


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({COORDINATOR: "h:1", NUM_PROCESSES: "two", PROCESS_ID: "0"}, "ATTN_STACK_NUM_PROCESSES='two' must be"),
        ({COORDINATOR: "h:1", NUM_PROCESSES: "2"}, "ATTN_STACK_PROCESS_ID=None must be"),
        ({COORDINATOR: "h:1", NUM_PROCESSES: "2", PROCESS_ID: "2"}, r"ATTN_STACK_PROCESS_ID=2 must be in \[0, "),
    ],
)
def test_bad_environment(environ, match):
    with pytest.raises(ValueError, match=match):
        initialize_from_env(environ)
    assert initialize_from_env({}) is False


def test_launch_needs_a_command():
    proc = subprocess.run([sys.executable, "-m", "attn_jax.launch", "-n", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "give the program to run after --" in proc.stderr


def _cli(*args: str, processes: int = 1) -> subprocess.CompletedProcess:
    env = subprocess_env()
    launch = [sys.executable, "-m", "attn_jax.launch", "-n", str(processes), "--"] if processes > 1 else []
    proc = subprocess.run(
        [*launch, sys.executable, "-m", "attn_jax", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_cli_joins_and_only_process_0_prints():
    out = _cli("info", processes=2).stdout
    assert out.count("platform: cpu, device kind 'cpu', 2 device(s)") == 1, out


def test_generate_on_two_processes_gives_one_process_tokens():
    """The README's command (on the tiny model; SmolLM2's tokens through the same command on
    one process are tests/serving/test_cli_generate.py's): its --json output is the
    program's alone (the runtime's own connection messages go to stderr), and the tokens are
    one process's."""
    from attn_jax.serving import SamplingParams
    from attn_jax.testing.models import TINY_RANDOM, tiny_random_engine

    prompts = ["The capital of France is", "Hi"]
    args = ("generate", "--model", TINY_RANDOM, "--max-new-tokens", "6", "--json", "--prompt", prompts[0],
            "--prompt", prompts[1])  # fmt: skip
    two = json.loads(_cli(*args, "--devices", "2", processes=2).stdout)
    assert two["devices"] == 2
    one = tiny_random_engine()
    expected = one.generate([one.encode(p) for p in prompts], SamplingParams(max_new_tokens=6))
    assert [r["token_ids"] for r in two["results"]] == [c.output_ids for c in expected]


def test_launch_neither_blocks_on_a_quiet_process_output_nor_waits_for_a_failed_one(tmp_path):
    """Process 1 writes more than a pipe holds before process 0 may finish (process 0 waits
    for its mark): the launcher must not leave that output in an unread pipe. Then a process
    that fails stops the others, which would wait for it forever."""
    mark = tmp_path / "mark"
    chatty = (f"import os, pathlib, time\nif os.environ['{PROCESS_ID}'] == '1':\n    print('x' * 1_000_000)\n"
              f"    pathlib.Path({str(mark)!r}).touch()\nelse:\n    deadline = time.time() + 60\n"
              f"    while not pathlib.Path({str(mark)!r}).exists():\n        assert time.time() < deadline\n"
              f"        time.sleep(0.05)\n")  # fmt: skip
    launch = [sys.executable, "-m", "attn_jax.launch", "-n", "2", "--", sys.executable, "-c"]
    proc = subprocess.run([*launch, chatty], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    failing = f"import os, time\nif os.environ['{PROCESS_ID}'] == '1':\n    raise SystemExit(3)\ntime.sleep(300)\n"
    proc = subprocess.run([*launch, failing], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--- process 1 (exit code 3) ---" in proc.stderr, proc.stderr[-2000:]


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_launch_passes_sigterm_on_to_its_processes(tmp_path):
    """A scheduler's timeout stops the launcher: its processes must not outlive it (they would
    hold their devices)."""
    pids = tmp_path / "pids"
    sleeper = f"import os, time\nwith open({str(pids)!r}, 'a') as f:\n    print(os.getpid(), file=f)\ntime.sleep(300)\n"
    command = [sys.executable, "-m", "attn_jax.launch", "-n", "2", "--", sys.executable, "-c", sleeper]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.time() < deadline and launcher.poll() is None
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) != 0
    deadline = time.time() + 30
    while any(_alive(pid) for pid in map(int, pids.read_text().split())):
        assert time.time() < deadline, "a process outlived its launcher"
        time.sleep(0.05)


def test_processes_that_call_from_different_lines_compile_the_same_program(tmp_path):
    """Two processes lower one function through one helper called from different lines (as
    the CLI runs the same command from one line in process 0, which prints, and another in
    the others): the programs, source locations included, must be the same text, which a
    GPU's compiler needs to trade autotuning results between processes."""
    program = (
        "import pathlib, jax, jax.numpy as jnp\n"
        "from attn_jax.distributed import initialize_from_env\n"
        "initialize_from_env()\n"
        "f = jax.jit(lambda x: x * 2)\n"
        "def lowered():\n"
        "    return f.lower(jnp.ones(4)).as_text(debug_info=True)\n"
        "if jax.process_index() == 0:\n"
        "    text = lowered()\n"
        "else:\n"
        "    text = lowered()  # another line: another call stack\n"
        f"pathlib.Path({str(tmp_path)!r}, str(jax.process_index())).write_text(text)\n"
    )
    launch = [sys.executable, "-m", "attn_jax.launch", "-n", "2", "--", sys.executable, "-c", program]
    proc = subprocess.run(launch, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = ((tmp_path / str(i)).read_text() for i in range(2))
    assert "loc(" in first and first == second
