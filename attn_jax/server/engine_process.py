"""The engine core in a process of its own, so the engine and the HTTP server each have a GIL.

In one process the engine thread and the event loop take turns on one interpreter lock:
under load the server's per-token work (requests, SSE writes) delays the engine's
dispatches and the engine's delays the streams. vLLM v1 splits the two into processes
(its ``EngineCore`` behind ZMQ); here the split is the same over a ``multiprocessing``
pipe: ``EngineProcess(factory)`` spawns a process that builds the engine with
``factory()`` (a picklable callable: the model loads and warms up there), then runs an
``EngineCore`` (``engine_core``) whose commands and round messages cross the pipe,
pickled. The parent (``EngineLoop``) reads the messages on its event loop
(``add_reader``); its commands go out through a sender thread of their own, and so do
the child's round messages (pickled and written there), so a parent writing commands and a
child writing rounds can never both block on full pipes, and the engine's loop never waits
for the parent to read (a CPU profile of the 64-client load test found the engine's thread
25 % of its time in that write). Up to ``OUTBOX_ROUNDS`` rounds wait for the parent; past
that the engine waits.
Commands and messages travel on two one-way pipes: uvloop's ``add_reader`` makes the
descriptor it watches non-blocking, and on one two-way pipe that made a burst of commands
(hundreds of requests at once) fail with ``BlockingIOError`` once the pipe was full. The
watched end is set back to blocking, so a large message that arrives in pieces is read whole.

The parent never touches JAX's devices: everything that does (``check_num_devices``,
the backend's selection, the compilation cache) belongs in ``factory``. The engine
process ignores SIGINT (the parent stops it), exits once its pipe closes, and is
terminated if it does not stop in time.

Example::

    process = EngineProcess(functools.partial(build_engine, "tiny-random"))  # waits until it is ready
    app = build_app(process, "tiny-random")
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable

from attn_jax.server.engine_core import EngineCore
from attn_jax.server.gc_heap import freeze_startup_heap

OUTBOX_ROUNDS = 64
"""Round messages the engine process queues for the parent before its loop waits for it."""


class EngineStartError(RuntimeError):
    """The engine process could not build its engine; the message is the factory's error."""


def _child_main(factory: Callable[[], object], commands, messages, freeze_heap: bool = True) -> None:
    """The engine process: builds the engine, freezes its heap (``gc_heap``; unless
    ``freeze_heap`` is False), says it is ready on ``messages``, runs the core on ``commands``
    until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = factory()
    except BaseException as e:
        detail = str(e) if isinstance(e, (ValueError, OSError)) else traceback.format_exc()
        messages.send(("error", detail or type(e).__name__))
        return
    if freeze_heap:
        freeze_startup_heap()
    messages.send(("ready", {"max_model_len": engine.max_model_len}))

    def receive(timeout: float | None) -> list[tuple]:
        received = []
        try:
            commands.poll(timeout)
            while commands.poll(0):
                received.append(commands.recv())
        except (EOFError, OSError):  # the parent has gone: stop
            received.append(("stop",))
        return received

    outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_ROUNDS)

    def send_loop() -> None:
        while True:
            message = outbox.get()
            try:
                messages.send(message)
            except OSError:  # the parent has gone; the next receive stops the loop
                pass
            if message[0] == "closed":
                return

    sender = threading.Thread(target=send_loop, name="attn-stack-engine-rounds", daemon=True)
    sender.start()
    EngineCore(engine, receive, outbox.put).run()
    sender.join()  # the "closed" message leaves before the process does


class EngineProcess:
    """A spawned process running an ``EngineCore`` over ``factory()``'s engine.

    The constructor returns once the engine is built (``EngineStartError`` with the
    factory's message if it raised, or if the process died first). ``max_model_len`` is
    the engine's. ``freeze_heap``: the process freezes its startup heap out of the garbage
    collector's walks once the engine is built (``gc_heap.freeze_startup_heap``).
    """

    def __init__(self, factory: Callable[[], object], *, freeze_heap: bool = True) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)  # (reading end, writing end)
        self._messages, messages = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_child_main, args=(factory, commands, messages, freeze_heap), name="attn-stack-engine", daemon=True
        )
        self.process.start()
        commands.close()
        messages.close()
        try:
            info = self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self.max_model_len: int = info["max_model_len"]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="attn-stack-engine-commands", daemon=True)
        self._sender.start()

    def _wait_ready(self) -> dict:
        try:
            kind, payload = self._messages.recv()  # a warm-up may take minutes
        except EOFError:
            self.process.join(5)
            raise EngineStartError(
                f"the engine process exited with code {self.process.exitcode} before it was ready"
            ) from None
        if kind == "error":
            raise EngineStartError(payload)
        return payload

    def alive(self) -> bool:
        return self.process.is_alive()

    def start(self, aloop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None]) -> None:
        """Hands every message to ``on_message`` on ``aloop`` (call from ``aloop``'s thread);
        the process's exit without a ``closed`` message becomes one, naming its exit code."""
        fd = self._messages.fileno()

        def readable() -> None:
            try:
                while self._messages.poll(0):
                    message = self._messages.recv()
                    on_message(message)
                    if message[0] == "closed":
                        aloop.remove_reader(fd)
                        return
            except (EOFError, OSError):
                aloop.remove_reader(fd)
                self.process.join(5)
                on_message(("closed", [], [], None, f"the engine process exited with code {self.process.exitcode}"))

        aloop.add_reader(fd, readable)
        os.set_blocking(fd, True)  # uvloop made it non-blocking: a message arriving in pieces is read whole

    def send(self, command: tuple) -> None:
        """Queues a command for the engine process (thread-safe, never blocks)."""
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._commands.send(command)
            except OSError:  # the process has gone; its reader reports it
                return
            if command[0] == "stop":
                return

    def join(self, timeout: float) -> None:
        """Waits for the process to end; terminates it after ``timeout`` seconds."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()

    def kill(self) -> None:
        self.process.terminate()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
