"""Several HTTP processes over one engine process: ``attn-stack serve --api-server-count N``.

One HTTP process parses every request and writes every token's event: at a few hundred
streaming clients it tops out before the engine does (``benchmarks/http_process_cpu.py``).
vLLM's answer is ``--api-server-count``, several API server processes over one engine
core; so is this one's:

- the parent (``attn-stack serve``'s process) starts ``EngineProcess(factory,
  num_clients=N)`` and is HTTP process 0;
- ``listening_sockets`` binds N sockets to the one port with ``SO_REUSEPORT`` (Linux spreads
  new connections over them by a hash of their addresses) and ``ApiServers`` spawns HTTP
  processes 1 to N-1, each serving ``build_app(engine.client(i))`` on its socket with its
  heap frozen, and returns once each listens;
- each HTTP process records the engine's whole report every round, so any ``/metrics``
  shows the whole engine (``engine_round_delay_seconds`` is each process's own);
- the parent's exit signal goes on to the others (``stop``), each ends its streams within
  ``shutdown_timeout``; a process whose parent has gone exits; a process that dies while
  serving takes the server down (the parent gets SIGTERM), as vLLM's does, rather than
  leaving a port whose share of connections nobody answers.

Example::

    engine = EngineProcess(factory, num_clients=2)
    sockets = listening_sockets("127.0.0.1", 8000, 2)
    servers = ApiServers(engine, sockets, served_model_name="m", log_level="info", shutdown_timeout=30)
    serve(build_app(engine, "m"), host="127.0.0.1", port=8000, log_level="info", shutdown_timeout=30,
          sockets=sockets[:1], on_exit=servers.stop)
    servers.join(40)
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait as wait_any

from attn_jax.platforms import host_cpus
from attn_jax.server.engine_process import EngineClient, EngineProcess

logger = logging.getLogger(__name__)

BACKLOG = 2048
"""Connections each socket queues before its process accepts them (uvicorn's default)."""

START_TIMEOUT_S = 300.0
"""How long an HTTP process may take to import the app and listen."""

MAX_AUTO_COUNT = 4
"""The most HTTP processes ``default_count`` gives."""


def default_count(platform: str, cpus: int | None = None) -> int:
    """HTTP processes for an engine on ``platform`` (``attn-stack serve``'s default): 1 on
    the CPU, whose engine needs the cores; on an accelerator a process per 4 of the host's
    cores, at most ``MAX_AUTO_COUNT`` (4 on a 16-core H200 host, where 4 served 256 clients
    30-37 % more tokens/s than 1: BENCHMARKS.md, stop 58)."""
    if platform == "cpu":
        return 1
    if cpus is None:
        cpus = host_cpus()
    return max(1, min(MAX_AUTO_COUNT, cpus // 4))


def start_engine(factory, count: int | None, *, freeze_heap: bool = True) -> tuple[EngineProcess, int]:
    """``EngineProcess(factory)`` for ``count`` HTTP processes, and the count; None: the
    engine's platform picks it (``default_count``; the clients it leaves unused are closed)."""
    engine = EngineProcess(factory, freeze_heap=freeze_heap, num_clients=count or MAX_AUTO_COUNT)
    if count is None:
        count = default_count(engine.platform)
        for unused in range(count, MAX_AUTO_COUNT):
            engine.client(unused).close()
    return engine, count


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP sockets bound to ``(host, port)`` with ``SO_REUSEPORT``, listening
    (port 0: one free port for all). OSError when the port is taken; ValueError where the
    platform has no ``SO_REUSEPORT``."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError(f"--api-server-count {count} needs SO_REUSEPORT, which this platform lacks: give 1")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            address = sock.getsockname()  # port 0 became a port: the others take the same
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


@dataclasses.dataclass(frozen=True)
class _Options:
    served_model_name: str
    max_request_bytes: int | None
    log_level: str
    shutdown_timeout: float
    freeze_heap: bool


def _name_process(name: str) -> None:
    """Names this process for ``ps`` and ``top`` (Linux's ``prctl(PR_SET_NAME)``, 15 bytes at most)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is only cosmetic
        pass


def _api_server_main(client: EngineClient, sock: socket.socket, options: _Options, ready) -> None:
    """An HTTP process: ``build_app`` over its engine client on ``sock``, until a signal or
    its parent's end. Named ``attn-stack-http`` for ``ps``."""
    _name_process("attn-stack-http")
    from attn_jax.server.app import build_app
    from attn_jax.server.gc_heap import freeze_startup_heap
    from attn_jax.server.uvicorn_server import serve

    parent = multiprocessing.parent_process()

    def exit_with_parent() -> None:
        parent.join()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=exit_with_parent, name="attn-stack-parent-watch", daemon=True).start()
    app = build_app(client, options.served_model_name, max_request_bytes=options.max_request_bytes)
    if options.freeze_heap:
        freeze_startup_heap()
    host, port = sock.getsockname()[:2]
    serve(
        app, host=host, port=port, log_level=options.log_level, shutdown_timeout=options.shutdown_timeout,
        sockets=[sock], on_started=lambda: ready.send(True),
    )  # fmt: skip


class ApiServers:
    """HTTP processes 1 to ``len(sockets) - 1`` over ``engine``'s clients, process ``i`` on
    ``sockets[i]`` (``sockets[0]`` is the caller's); returns once each listens.
    RuntimeError, naming its exit code, for one that exits first.

    ``freeze_heap``: each process freezes its startup heap (``gc_heap``) before it listens.
    """

    def __init__(
        self, engine: EngineProcess, sockets: list[socket.socket], *, served_model_name: str,
        max_request_bytes: int | None = None, log_level: str = "info", shutdown_timeout: float = 30.0,
        freeze_heap: bool = True,
    ) -> None:  # fmt: skip
        ctx = multiprocessing.get_context("spawn")
        options = _Options(served_model_name, max_request_bytes, log_level, shutdown_timeout, freeze_heap)
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._stopping = False
        waiting = []
        try:
            for i, sock in enumerate(sockets[1:], start=1):
                ready, ready_out = ctx.Pipe(duplex=False)
                client = engine.client(i)
                process = ctx.Process(
                    target=_api_server_main, args=(client, sock, options, ready_out),
                    name=f"attn-stack-http-{i}", daemon=True,
                )  # fmt: skip
                process.start()
                client.close()  # the process has its own ends: its exit is the pipes' end for the engine
                ready_out.close()
                self.processes.append(process)
                waiting.append((process, ready))
            deadline = time.monotonic() + START_TIMEOUT_S
            for process, ready in waiting:
                wait_any([ready, process.sentinel], max(0.0, deadline - time.monotonic()))
                if not ready.poll(0):
                    raise RuntimeError(
                        f"HTTP process {process.name} exited with code {process.exitcode} before it listened"
                        if not process.is_alive()
                        else f"HTTP process {process.name} did not listen within {START_TIMEOUT_S:.0f} s"
                    )
        except BaseException:
            self.stop()
            self.join(5.0)
            raise
        threading.Thread(target=self._watch, name="attn-stack-http-watch", daemon=True).start()

    def _watch(self) -> None:
        """Takes the server down (SIGTERM to this process) when an HTTP process dies while serving."""
        sentinels = {process.sentinel: process for process in self.processes}
        while sentinels and not self._stopping:
            for sentinel in wait_any(list(sentinels)):
                process = sentinels.pop(sentinel)
                process.join(5.0)  # reaps it: its exit code
                if not self._stopping:
                    logger.error(
                        "HTTP process %s exited with code %s while serving: stopping the server",
                        process.name, process.exitcode,
                    )  # fmt: skip
                    self._stopping = True
                    os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        """Passes the exit signal on: each process ends its streams within its shutdown timeout."""
        self._stopping = True
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def join(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the processes to end; kills those left."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
