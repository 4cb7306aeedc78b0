"""Starts one program as N processes on this host, joined by ``jax.distributed``.

    python -m attn_jax.launch --num-processes 2 -- attn-stack generate --devices 2
    python -m attn_jax.launch -n 2 --devices-per-process 1 -- python my_serving_loop.py

Each process gets ``ATTN_STACK_COORDINATOR`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID``
(``attn_jax.distributed.initialize_from_env`` reads them) and its own devices:
``CUDA_VISIBLE_DEVICES`` set to its slice of the host's GPUs, and on a CPU-only host
``--devices-per-process`` forced host devices. Process 0's output is shown; the others'
only when they fail (or with ``--all-output``): they write to temporary files, never to a
pipe read after process 0 ends (a pipe fills, its writer blocks, and process 0 waits for it
in a collective or at shutdown: a hang). When one process fails the others are stopped
(they would wait for it), and a SIGTERM or SIGINT to the launcher goes to every process;
the exit code is the first nonzero one.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from attn_jax.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict[str, str], *, process_id: int, num_processes: int, port: int, devices: int) -> dict:
    """The environment of process ``process_id``: its rank, the coordinator, its devices."""
    env = dict(base)
    env[COORDINATOR] = f"127.0.0.1:{port}"
    env[NUM_PROCESSES] = str(num_processes)
    env[PROCESS_ID] = str(process_id)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(process_id * devices + i) for i in range(devices))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attn_jax.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start (>= 1)")
    parser.add_argument("--devices-per-process", type=int, default=1, help="GPUs (or CPU devices) each (default 1)")
    parser.add_argument("--all-output", action="store_true", help="show every process's output, not only process 0's")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the program to run after --, e.g. -- attn-stack generate --devices 2")
    for name in ("num_processes", "devices_per_process"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    port = _free_port()
    procs, logs = [], []

    def forward(signum, _frame):  # the launcher stopped (a scheduler's timeout, Ctrl-C): so are they
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    for rank in range(args.num_processes):
        env = process_env(
            dict(os.environ), process_id=rank, num_processes=args.num_processes, port=port,
            devices=args.devices_per_process,
        )  # fmt: skip
        log = tempfile.TemporaryFile("w+") if rank > 0 and not args.all_output else None
        logs.append(log)
        procs.append(
            subprocess.Popen(command, env=env, text=True, stdout=log, stderr=subprocess.STDOUT if log else None)
        )
    while None in (codes := [p.poll() for p in procs]):
        if any(codes):  # one failed: stop the rest (they would wait for it)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.1)
    code = 0
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        if log is not None:
            log.seek(0)
            if proc.returncode:
                sys.stderr.write(f"--- process {rank} (exit code {proc.returncode}) ---\n{log.read()}")
            log.close()
        code = code or proc.returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
