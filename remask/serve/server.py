"""Running the app: uvicorn with a draining shutdown bounded by a grace period.

SIGTERM / SIGINT drain: new requests get 503 with `Retry-After` (and `/health` says
"unavailable") while the requests in flight finish, for at most `shutdown_grace` seconds; then
whatever is still in flight is aborted (its client gets 503, or an error event on a stream), the
server stops and `serve` returns — 0 when the drain completed, 1 when work had to be aborted.
Abandoned requests (their client gone) never hold the drain: the app aborts a request as soon as
its client disconnects, so only requests someone is waiting for are waited for. A second signal
aborts everything in flight and stops at once. uvicorn alone would stop listening at once, wait
up to its graceful timeout, then cancel the handlers (a traceback each) and re-raise the signal.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator

import uvicorn

from remask.diffusion.parts.checks import check_real

from .async_engine import AsyncEngine

# Seconds the requests in flight get to finish after SIGTERM before they are aborted: Kubernetes'
# default termination grace is 30 s too (set a smaller one there, so the drain ends before SIGKILL).
SHUTDOWN_GRACE = 30.0
# Seconds uvicorn waits for the handlers to send their last bytes once the engines are idle (they
# answer within one engine step then); past it uvicorn cancels them.
CLOSE_TIMEOUT = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engines: dict[str, AsyncEngine],
                 shutdown_grace: float = SHUTDOWN_GRACE) -> None:
        super().__init__(config)
        check_real("shutdown_grace", shutdown_grace, low=0)
        self.engines, self.shutdown_grace = engines, shutdown_grace
        self.drained = True          # False once work in flight had to be aborted
        self._lock = threading.Lock()
        self._draining = False

    def _busy(self) -> bool:
        return any(e.num_requests for e in self.engines.values())

    def drain(self) -> None:
        """Stop admitting; exit once nothing is in flight, or abort what is left after
        `shutdown_grace` seconds."""
        for engine in self.engines.values():
            engine.drain()
        threading.Thread(target=self._exit_when_idle, daemon=True, name="remask-drain").start()

    def stop_now(self) -> None:
        """Abort everything in flight and exit as soon as the handlers have answered."""
        self.drained = False
        for engine in self.engines.values():
            engine.drain()
            engine.abort_all()
        threading.Thread(target=self._exit_when_answered, daemon=True, name="remask-stop").start()

    def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.shutdown_grace
        while self._busy() and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if self._busy():
            self.drained = False
            for engine in self.engines.values():
                engine.abort_all()
            self._exit_when_answered()
        else:
            self.should_exit = True

    def _exit_when_answered(self) -> None:
        # The aborted requests' handlers answer at the next engine step; once they have, uvicorn
        # finds no handler to cancel (no traceback). Bounded: a step that never ends is not waited for.
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while self._busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def on_signal(signum, frame) -> None:
            with self._lock:
                first, self._draining = not self._draining, True
            if first and not self.should_exit:
                self.drain()
            else:
                self.stop_now()               # a second signal: stop now

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
          log_level: str = "info", shutdown_grace: float = SHUTDOWN_GRACE) -> int:
    """Serve `app` until SIGTERM / SIGINT has drained it; then shut the engines down. Returns the
    process's exit status: 0 when every request in flight at the signal was answered, 1 when the
    grace period ran out (or a second signal came) and work was aborted. `shutdown_grace`: seconds
    the requests in flight get to finish after the first signal."""
    check_real("shutdown_grace", shutdown_grace, low=0)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CLOSE_TIMEOUT)
    server = DrainingServer(config, engines, shutdown_grace=shutdown_grace)
    try:
        server.run()
    finally:
        for engine in engines.values():
            engine.shutdown()
    return 0 if server.drained else 1
