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

Several HTTP processes can share one engine process (``EngineProcess(factory,
num_clients=N)``, what ``attn-stack serve --api-server-count N`` runs; vLLM's
``--api-server-count``): each has a pair of pipes of its own (``EngineProcess.client(i)``, an
``EngineClient`` to pass to the process that serves with it; the ``EngineProcess`` itself is
client 0). The engine process routes every request's admission and tokens to the client that
submitted it, and hands every client each round's metric report whole, so each HTTP
process's ``/metrics`` shows the whole engine. Client 0's stop (or its pipe's end) stops the
engine; another client's aborts that client's requests and closes its channel alone.

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
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any

from attn_jax.server.engine_core import EngineCore
from attn_jax.server.gc_heap import freeze_startup_heap

OUTBOX_ROUNDS = 64
"""Round messages the engine process queues for the parent before its loop waits for it."""


class EngineStartError(RuntimeError):
    """The engine process could not build its engine; the message is the factory's error."""


def _child_main(
    factory: Callable[[], object], commands: list[Connection], messages: list[Connection], freeze_heap: bool = True
) -> None:
    """The engine process: builds the engine, freezes its heap (``gc_heap``; unless
    ``freeze_heap`` is False), says it is ready on every client's ``messages`` pipe, runs the
    core on the clients' ``commands`` until client 0 stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = factory()
    except BaseException as e:
        detail = str(e) if isinstance(e, (ValueError, OSError)) else traceback.format_exc()
        messages[0].send(("error", detail or type(e).__name__))
        return
    if freeze_heap:
        freeze_startup_heap()
    import jax  # here, where the engine has initialised its backend (the parent never does)

    for pipe in messages:
        pipe.send(("ready", {"max_model_len": engine.max_model_len, "platform": jax.default_backend()}))
    outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_ROUNDS)  # (client, message)

    def send_loop() -> None:
        while True:
            client, message = outbox.get()
            if client is None:
                return
            try:
                messages[client].send(message)
            except OSError:  # that client has gone; its command pipe's end drops it
                pass

    sender = threading.Thread(target=send_loop, name="attn-stack-engine-rounds", daemon=True)
    sender.start()
    if len(commands) == 1:
        receive, emit = _single_client(commands[0], outbox)
    else:
        router = _Router(commands, outbox)
        receive, emit = router.receive, router.emit
    EngineCore(engine, receive, emit).run()
    outbox.put((None, None))
    sender.join()  # the "closed" messages leave before the process does


def _single_client(commands: Connection, outbox: queue.Queue) -> tuple[Callable, Callable]:
    """``EngineCore``'s receive and emit over one client's pipes."""

    def receive(timeout: float | None) -> list[tuple]:
        received = []
        try:
            commands.poll(timeout)
            while commands.poll(0):
                received.append(commands.recv())
        except (EOFError, OSError):  # the parent has gone: stop
            received.append(("stop",))
        return received

    def emit(message: tuple) -> None:
        outbox.put((0, message))

    return receive, emit


class _Router:
    """``EngineCore``'s receive and emit over several clients' pipes: commands from every
    client, each round's admissions and outputs split by the client that submitted the
    request (the report goes to every client whole)."""

    def __init__(self, commands: list[Connection], outbox: queue.Queue) -> None:
        self._commands = dict(enumerate(commands))  # the clients still sending, by index
        self._outbox = outbox
        self._clients = set(self._commands)  # the clients still sent rounds
        self._client_of: dict[str, int] = {}  # live (submitted, not ended) request -> its client
        self._closing: set[int] = set()  # dropped clients: sent "closed" after the round that ends their requests

    def receive(self, timeout: float | None) -> list[tuple]:
        received: list[tuple] = []
        for pipe in wait_any(list(self._commands.values()), timeout):
            client = next(i for i, c in self._commands.items() if c is pipe)
            try:
                while pipe.poll(0):
                    self._take(client, pipe.recv(), received)
            except (EOFError, OSError):  # that client's process has gone
                self._drop(client, received)
        return received

    def _take(self, client: int, command: tuple, received: list[tuple]) -> None:
        kind = command[0]
        if kind == "submit":
            request_id = command[1]
            if request_id in self._client_of:  # the engine would mix the two up: refuse the second
                refusal = (f"request id {request_id!r} is in use by another request", None, None)
                self._outbox.put((client, ("round", [(request_id, 0, refusal)], [], None)))
                return
            self._client_of[request_id] = client
        elif kind == "abort" and self._client_of.get(command[1]) != client:
            return  # not this client's (ended already, or never its own)
        elif kind == "stop" and client != 0:
            self._drop(client, received)
            return
        received.append(command)

    def _drop(self, client: int, received: list[tuple]) -> None:
        """Stops listening to ``client``; stops the engine for client 0, else aborts the
        client's requests (their ends go out with the next round, then ``closed``)."""
        if self._commands.pop(client, None) is None:
            return
        if client == 0:
            received.append(("stop",))
            return
        mine = [request_id for request_id, c in self._client_of.items() if c == client]
        received += [("abort", request_id) for request_id in mine]
        if mine:
            self._closing.add(client)
        else:
            self._close(client)

    def _close(self, client: int) -> None:
        self._clients.discard(client)
        self._outbox.put((client, ("closed", [], [], None, None)))

    def emit(self, message: tuple) -> None:
        kind, admitted, outputs, report, *rest = message
        parts = {client: ([], []) for client in self._clients}
        client_of = self._client_of
        for entry in admitted:
            client = client_of.get(entry[0]) if entry[2] is None else client_of.pop(entry[0], None)
            if client in parts:
                parts[client][0].append(entry)
        for entry in outputs:
            client = client_of.get(entry[0]) if entry[2] is None else client_of.pop(entry[0], None)
            if client in parts:
                parts[client][1].append(entry)
        for client, (mine_admitted, mine_outputs) in parts.items():
            self._outbox.put((client, (kind, mine_admitted, mine_outputs, report, *rest)))
        if kind == "closed":
            self._clients.clear()
        for client in self._closing:
            self._close(client)
        self._closing.clear()


class EngineClient:
    """One HTTP process's channel to an engine process (``EngineProcess.client(i)``), an
    ``engine_loop.CoreHandle``: picklable, so it goes to the process that serves with it as
    a ``multiprocessing`` argument. Commands go out through a sender thread of its own."""

    def __init__(self, commands: Connection, messages: Connection, max_model_len: int) -> None:
        self._commands, self._messages = commands, messages  # (writing end, reading end)
        self.max_model_len = max_model_len
        self._closed = threading.Event()  # the core's "closed" message arrived (or the pipe ended)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None  # started by the first ``send``
        self._sender_lock = threading.Lock()

    def close(self) -> None:
        """Closes this process's ends of the pipes (the parent's copies, once the client's own
        process has its: the engine then sees that process's end as the pipes' end)."""
        self._commands.close()
        self._messages.close()

    def __getstate__(self) -> dict:
        return {"commands": self._commands, "messages": self._messages, "max_model_len": self.max_model_len}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["commands"], state["messages"], state["max_model_len"])

    def alive(self) -> bool:
        return not self._closed.is_set()

    def _gone(self) -> str:
        """Why the pipe ended without a ``closed`` message."""
        return "the engine process has exited"

    def start(self, aloop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None]) -> None:
        """Hands every message to ``on_message`` on ``aloop`` (call from ``aloop``'s thread);
        the pipe's end without a ``closed`` message becomes one, saying why (``_gone``)."""
        fd = self._messages.fileno()

        def readable() -> None:
            try:
                while self._messages.poll(0):
                    message = self._messages.recv()
                    if message[0] == "closed":
                        aloop.remove_reader(fd)
                        self._closed.set()
                    on_message(message)
                    if message[0] == "closed":
                        return
            except (EOFError, OSError):
                aloop.remove_reader(fd)
                self._closed.set()
                on_message(("closed", [], [], None, self._gone()))

        aloop.add_reader(fd, readable)
        os.set_blocking(fd, True)  # uvloop made it non-blocking: a message arriving in pieces is read whole

    def send(self, command: tuple) -> None:
        """Queues a command for the engine process (thread-safe, never blocks)."""
        self._outbox.put(command)
        if self._sender is None:
            with self._sender_lock:
                if self._sender is None:
                    self._sender = threading.Thread(
                        target=self._send_loop, name="attn-stack-engine-commands", daemon=True
                    )
                    self._sender.start()

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
        """Waits up to ``timeout`` seconds for the core's ``closed`` message."""
        self._closed.wait(timeout)


class EngineProcess(EngineClient):
    """A spawned process running an ``EngineCore`` over ``factory()``'s engine; itself the
    channel of client 0 (the HTTP process that started it).

    The constructor returns once the engine is built (``EngineStartError`` with the
    factory's message if it raised, or if the process died first). ``max_model_len`` is
    the engine's, ``platform`` its JAX platform. ``freeze_heap``: the process freezes its
    startup heap out of the garbage collector's walks once the engine is built
    (``gc_heap.freeze_startup_heap``).
    ``num_clients``: HTTP processes the engine serves (``client(i)`` for the others).
    """

    def __init__(self, factory: Callable[[], object], *, freeze_heap: bool = True, num_clients: int = 1) -> None:
        if not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(f"num_clients={num_clients!r}: give an integer of at least 1")
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = [], []
        for _ in range(num_clients):
            commands_in, commands_out = ctx.Pipe(duplex=False)  # (reading end, writing end)
            messages_in, messages_out = ctx.Pipe(duplex=False)
            ours.append((commands_out, messages_in))
            theirs.append((commands_in, messages_out))
        self.process = ctx.Process(
            target=_child_main, args=(factory, [c for c, _ in theirs], [m for _, m in theirs], freeze_heap),
            name="attn-stack-engine", daemon=True,
        )  # fmt: skip
        self.process.start()
        for commands_in, messages_out in theirs:
            commands_in.close()
            messages_out.close()
        commands, messages = ours[0]
        try:
            info = self._wait_ready(messages)
            for _, other in ours[1:]:
                self._wait_ready(other)
        except BaseException:
            self.kill()
            raise
        super().__init__(commands, messages, info["max_model_len"])
        self.platform: str = info["platform"]  # the engine's JAX platform: "cpu", "gpu", "tpu"
        self._others = ours[1:]

    def client(self, i: int) -> EngineClient:
        """The channel of HTTP process ``i`` (1 to ``num_clients - 1``), to pass to that process;
        ``close`` it here once that process has started (or at once, to leave client ``i``
        unused: the engine drops it)."""
        if not 1 <= i <= len(self._others):
            raise ValueError(f"client {i!r}: this engine process has clients 1 to {len(self._others)} besides its own")
        commands, messages = self._others[i - 1]
        return EngineClient(commands, messages, self.max_model_len)

    def _wait_ready(self, messages: Connection) -> dict:
        try:
            kind, payload = messages.recv()  # a warm-up may take minutes
        except EOFError:
            self.process.join(5)
            raise EngineStartError(
                f"the engine process exited with code {self.process.exitcode} before it was ready"
            ) from None
        if kind == "error":
            raise EngineStartError(payload)
        return payload

    def __getstate__(self) -> dict:
        raise TypeError("an EngineProcess stays in the process that started it: pass client(i) to another")

    def alive(self) -> bool:
        return self.process.is_alive()

    def _gone(self) -> str:
        self.process.join(5)
        return f"the engine process exited with code {self.process.exitcode}"

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
