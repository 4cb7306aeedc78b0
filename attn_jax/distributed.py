"""Several processes, one engine: JAX's multi-controller runtime (``jax.distributed``).

Each process runs the same program (the same requests, in the same order: the engine's
scheduling is deterministic) and owns some devices; ``jax.distributed.initialize``
joins them into one set of global devices, so a ``make_mesh`` over ``jax.devices()``
spans every process and ``Engine(mesh=...)`` shards over all of them. This is the path
to multi-host TPU pods and GPU clusters; there is no other transport.

``python -m attn_jax.launch`` starts the processes on one host and tells each its place
through the environment; the program calls ``initialize_from_env()`` first (the
``attn-stack`` CLI does)::

    python -m attn_jax.launch --num-processes 2 -- attn-stack generate --devices 2

On several hosts, start one process per host (or per GPU) yourself with the same three
variables, or call ``jax.distributed.initialize()`` directly where the cluster
environment (SLURM, TPU pods) already tells JAX.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

COORDINATOR = "ATTN_STACK_COORDINATOR"  # host:port of process 0's coordination service
NUM_PROCESSES = "ATTN_STACK_NUM_PROCESSES"
PROCESS_ID = "ATTN_STACK_PROCESS_ID"


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Joins the processes named by the environment (``COORDINATOR``, ``NUM_PROCESSES``,
    ``PROCESS_ID``, as ``attn_jax.launch`` sets them) with ``jax.distributed.initialize``;
    returns False, doing nothing, when they are not set. Call it before any other JAX
    work. ValueError names a malformed variable."""
    if COORDINATOR not in environ:
        return False
    values = {}
    for name in (NUM_PROCESSES, PROCESS_ID):
        raw = environ.get(name)
        if raw is None or not raw.isdigit():
            raise ValueError(f"{name}={raw!r} must be a non-negative integer (set with {COORDINATOR})")
        values[name] = int(raw)
    num_processes, process_id = values[NUM_PROCESSES], values[PROCESS_ID]
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{PROCESS_ID}={process_id} must be in [0, {NUM_PROCESSES}={num_processes})")
    import jax

    _native_stdout_to_stderr()  # the runtime's own messages are not the program's output
    # Every process must compile the same programs, byte for byte: a GPU's compiler trades
    # autotuning results between processes through the key-value store, by program, and
    # waits for the others' (a process compiling another program waits for ever: the engine
    # sizes itself from each process's own device for that reason, ``Engine``). A program's
    # source locations hold its whole Python call stack, which differs wherever the
    # processes do (the CLI runs process 0's command from another line); the innermost
    # frame alone is the same in every process.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.distributed.initialize(
        coordinator_address=environ[COORDINATOR], num_processes=num_processes, process_id=process_id
    )
    from jax.experimental.multihost_utils import sync_global_devices

    sync_global_devices("attn_jax.distributed")  # a first collective: the processes connect here
    return True


def _native_stdout_to_stderr() -> None:
    """From now on, what C++ libraries print to file descriptor 1 (the distributed runtime's
    connection messages, Gloo's for every new group of processes a collective uses) goes to
    stderr; ``sys.stdout`` keeps writing to the original stdout."""
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    line_buffering = sys.stdout.line_buffering
    sys.stdout = os.fdopen(original, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stdout.reconfigure(line_buffering=line_buffering)


def is_main_process() -> bool:
    """Whether this process prints (process 0, or the only one)."""
    import jax

    return jax.process_index() == 0
