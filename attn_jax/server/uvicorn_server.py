"""uvicorn with a bounded graceful shutdown (``attn-stack serve --shutdown-timeout``).

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the open ones to
close, which a long stream may not do before an orchestrator's grace period ends. Here the
in-flight requests may run on for ``shutdown_timeout`` seconds; then the engine loop stops,
which ends every one of them with finish reason "abort" and ``[DONE]`` (a stream's last
event), so the connections close and the process exits 0. uvicorn's own
``timeout_graceful_shutdown`` is a backstop a few seconds later.

Example::

    serve(build_app(engine, name), host="127.0.0.1", port=8000, log_level="info", shutdown_timeout=30)
"""

from __future__ import annotations

import contextlib

import uvicorn

BACKSTOP_S = 5.0
"""uvicorn cancels what is still open this long after the requests were ended."""


class _Server(uvicorn.Server):
    """A uvicorn server that ends the app's requests ``shutdown_timeout`` s after an exit signal."""

    def __init__(self, config: uvicorn.Config, app, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._app, self._shutdown_timeout = app, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._app.state.engine_loop.stop_after(self._shutdown_timeout)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the caught signal again once the shutdown is done: a
        shutdown that completed exits 0 (uvicorn re-raises it, and the process dies of it)."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(app, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Runs ``app`` (``build_app``'s) until a signal, then shuts down within about
    ``shutdown_timeout`` seconds (see the module docstring)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + BACKSTOP_S
    )
    _Server(config, app, shutdown_timeout).run()
