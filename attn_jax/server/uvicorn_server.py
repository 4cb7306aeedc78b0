"""uvicorn with a bounded graceful shutdown (``attn-stack serve --shutdown-timeout``).

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the open ones to
close, which a long stream may not do before an orchestrator's grace period ends. Here the
in-flight requests may run on for ``shutdown_timeout`` seconds; then the engine loop stops,
which ends every one of them with finish reason "abort" and ``[DONE]`` (a stream's last
event), so the connections close and the process exits 0. uvicorn's own
``timeout_graceful_shutdown`` is a backstop a few seconds later.

``sockets`` serves on sockets already bound (``api_servers``: several HTTP processes on
one port); ``on_exit`` runs once at the exit signal (the parent passes it on to them);
``on_started`` once the server listens. An ``EarlySignals`` made before the other HTTP
processes listen keeps a SIGTERM that comes before uvicorn's handlers from killing the
process (they may answer ``/health`` first): ``serve`` then shuts down as soon as it starts.

Example::

    serve(build_app(engine, name), host="127.0.0.1", port=8000, log_level="info", shutdown_timeout=30)
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

BACKSTOP_S = 5.0
"""uvicorn cancels what is still open this long after the requests were ended."""


class EarlySignals:
    """Records SIGINT and SIGTERM from its creation until ``serve``'s uvicorn takes them over
    (and again once it gives them back), instead of their default action, death."""

    def __init__(self) -> None:
        self.received = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, sig, frame) -> None:
        self.received.set()


class _Server(uvicorn.Server):
    """A uvicorn server that ends the app's requests ``shutdown_timeout`` s after an exit signal."""

    def __init__(
        self, config: uvicorn.Config, app, shutdown_timeout: float, on_exit: Callable[[], None] | None,
        on_started: Callable[[], None] | None, early_signals: EarlySignals | None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self._app, self._shutdown_timeout = app, shutdown_timeout
        self._on_exit, self._on_started, self._early_signals = on_exit, on_started, early_signals

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._app.state.engine_loop.stop_after(self._shutdown_timeout)
            if self._on_exit is not None:
                self._on_exit()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._early_signals is not None and self._early_signals.received.is_set():
            self.handle_exit(signal.SIGTERM, None)  # it came before uvicorn's handlers: shut down now
        if self._on_started is not None and not self.should_exit:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the caught signal again once the shutdown is done: a
        shutdown that completed exits 0 (uvicorn re-raises it, and the process dies of it)."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(
    app, *, host: str, port: int, log_level: str, shutdown_timeout: float, sockets: list[socket.socket] | None = None,
    on_exit: Callable[[], None] | None = None, on_started: Callable[[], None] | None = None,
    early_signals: EarlySignals | None = None,
) -> None:  # fmt: skip
    """Runs ``app`` (``build_app``'s) until a signal, then shuts down within about
    ``shutdown_timeout`` seconds (see the module docstring)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + BACKSTOP_S
    )
    _Server(config, app, shutdown_timeout, on_exit, on_started, early_signals).run(sockets=sockets)
