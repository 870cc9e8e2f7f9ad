"""Running the app: uvicorn with a draining shutdown.

SIGTERM / SIGINT drain: new requests get 503 with `Retry-After` (and `/health` says
"unavailable") while the requests in flight finish; then the server stops and `serve` returns, so
the process exits 0. uvicorn alone would stop listening at once and re-raise the signal. A second
signal stops at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

import uvicorn

from remask.engine import EngineState

from .async_engine import AsyncEngine


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engines: dict[str, AsyncEngine], drain_timeout: float = 600.0) -> None:
        super().__init__(config)
        self.engines, self.drain_timeout = engines, drain_timeout

    def drain(self) -> None:
        """Stop admitting; exit once nothing is in flight (or after `drain_timeout` seconds)."""
        for engine in self.engines.values():
            engine.drain()
        threading.Thread(target=self._exit_when_idle, daemon=True, name="remask-drain").start()

    def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while any(e.num_requests for e in self.engines.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def on_signal(signum, frame) -> None:
            if self.should_exit or any(e.state is EngineState.DRAINING for e in self.engines.values()):
                self.should_exit = True       # a second signal: stop now
            else:
                self.drain()

        if threading.current_thread() is not threading.main_thread():
            yield                              # signals reach the main thread only (a test's server)
            return
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app, engines: dict[str, AsyncEngine], *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serve `app` until SIGTERM / SIGINT has drained it; then shut the engines down."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=60)
    try:
        DrainingServer(config, engines).run()
    finally:
        for engine in engines.values():
            engine.shutdown()
