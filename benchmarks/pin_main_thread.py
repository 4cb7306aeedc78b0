"""Runs another benchmark script with its main thread alone on one physical core (issue 46:
the host's speed differs up to 1.8x between processes of one machine, BENCHMARKS.md stop 63).

Before jax starts, the process's affinity is set to every allowed CPU but one core's hardware
threads, so the threads jax's client starts (and any that spin while they wait for the
device) stay off that core. Once the client exists, the main thread, which runs the engine's
loop, moves onto the core alone. Threads the main thread starts later inherit its one CPU.
Linux only::

    python benchmarks/pin_main_thread.py benchmarks/generate_gpu.py --batch 1 64 256 --num-scheduler-steps 1
"""

from __future__ import annotations

import argparse
import os
import pathlib

from wrapped_script import add_script_args, checked_script, run_script  # benchmarks/, the script's folder


def core_cpus(cpu: int) -> set[int]:
    """The CPUs of ``cpu``'s physical core (its hardware threads, ``cpu`` among them)."""
    path = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def pin(cpus: list[int]) -> tuple[int, set[int], list[int]]:
    """Sets the process's affinity to ``cpus`` but one core (the middle CPU's), starts jax's
    client there, then moves the main thread onto that CPU alone; returns (the main thread's
    CPU, its core's CPUs, the other threads' CPUs)."""
    main = cpus[len(cpus) // 2]
    core = core_cpus(main)
    others = [c for c in cpus if c not in core]
    if not others:
        raise SystemExit(f"CPUs {cpus} are one core: nowhere to put the other threads")
    os.sched_setaffinity(0, others)
    import jax.numpy as jnp

    (jnp.ones(4) + 1).block_until_ready()  # the client and its threads exist now, on ``others``
    os.sched_setaffinity(0, {main})
    return main, core, others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_script_args(parser)
    args = parser.parse_args()
    script = checked_script(parser, args)
    if not hasattr(os, "sched_setaffinity"):
        parser.error("pinning needs Linux's sched_setaffinity")
    cpu, core, others = pin(sorted(os.sched_getaffinity(0)))
    print(f"main thread alone on CPU {cpu} (its core: {sorted(core)}); other threads on {others}", flush=True)
    run_script(script, args.args)


if __name__ == "__main__":
    main()
