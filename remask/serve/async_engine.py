"""`AsyncEngine`: an `LLM`'s engine driven by one background thread, for an asyncio server.

Every call into `LLMEngine` happens on that thread (it is not thread-safe): the event loop sends
commands (add a request, abort one, drain) through a queue, and the thread runs `step()` while
there is work, handing each `RequestOutput` back to the waiting coroutine's `asyncio.Queue`
through `loop.call_soon_threadsafe`. A request's settings are validated by `add_request` on the
thread and a `ValueError` comes back to the caller, who answers 400.

A request's deadline travels with it into the engine (`LLMEngine.set_deadline`), which aborts it
between steps once it has passed (finish reason "timeout"), whether or not anyone is still
waiting on it; `abort_all` ends everything in flight (a shutdown's grace period ran out).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from remask.engine import LLM, EngineState, RequestOutput, SamplingParams


class QueueFull(RuntimeError):
    """The engine holds `max_queue` requests already (or is draining): answer 503."""


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():       # the caller may have gone (cancelled) meanwhile
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class AsyncEngine:
    """`max_queue`: requests the engine may hold at once (waiting + running); more get `QueueFull`."""

    def __init__(self, llm: LLM, max_queue: int = 256) -> None:
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        self.llm, self.engine, self.max_queue = llm, llm.engine, max_queue
        self._commands: queue.Queue = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="remask-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side ----

    @property
    def state(self) -> EngineState:
        return self.engine.state

    @property
    def num_requests(self) -> int:
        return len(self._pending)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       drafts: bool = False, deadline: float | None = None,
                       owner: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the engine reports them (the last one is
        finished; with `drafts`, one after every step). Leaving the iteration early (a
        disconnect, a timeout) aborts the request. `deadline`: a `time.perf_counter()` value
        after which the engine aborts the request between steps (its last output is finished
        with reason "timeout"). `owner`: the scheduler's fairness tag (an API key's digest)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.engine.state is not EngineState.READY:
                raise QueueFull(f"the engine is {self.engine.state.value}")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests)")
            pending = self._pending[request_id] = _Pending(loop)
        added: asyncio.Future = loop.create_future()
        self._commands.put(("add", request_id, prompt, params, drafts, deadline, owner, added))
        done = False
        try:
            await added                                  # a bad request raises here (ValueError)
            while True:
                out = await pending.outputs.get()
                if isinstance(out, BaseException):       # the engine thread failed
                    raise out
                done = out.finished
                yield out
                if done:
                    return
        finally:
            self._pending.pop(request_id, None)
            if not done:                                 # left early: free its place and pages
                self._commands.put(("abort", request_id))

    def drain(self) -> None:
        """No new requests (503); the ones in flight finish."""
        self._commands.put(("drain",))

    def abort_all(self) -> None:
        """Abort every request in flight (waiting or running) at the next step boundary; each
        caller gets a last output with finish reason "abort"."""
        self._commands.put(("abort_all",))

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(("stop",))
        self._thread.join(timeout=30)

    # ---- the engine thread ----

    def _deliver(self, request_id: str, item: Any) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.loop.call_soon_threadsafe(pending.outputs.put_nowait, item)

    def _command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, drafts, deadline, owner, added = command
            loop = added.get_loop()
            if self.engine.state is not EngineState.READY:     # it began draining after the caller checked
                loop.call_soon_threadsafe(_settle, added, QueueFull(f"the engine is {self.engine.state.value}"))
                return
            try:
                self.engine.add_request(request_id, prompt, params, drafts=drafts, owner=owner)
                if deadline is not None:
                    self.engine.set_deadline(request_id, deadline)
            except Exception as err:  # noqa: BLE001 - the caller answers it (400 for a ValueError)
                loop.call_soon_threadsafe(_settle, added, err)
                return
            loop.call_soon_threadsafe(_settle, added, None)
        elif kind == "abort":
            self.engine.abort_request(command[1])
        elif kind == "abort_all":
            for request_id in list(self.engine.requests):
                out = self.engine.abort_request(request_id)
                if out is not None:
                    self._deliver(request_id, out)
        elif kind == "drain":
            self.engine.drain()

    def _run(self) -> None:
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy, timeout=None if not busy else 0)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self.engine.shutdown()
                    return
                self._command(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as err:  # noqa: BLE001 - the engine itself broke: fail what is in flight
                    self.engine.state = EngineState.ERROR
                    for request_id in list(self._pending):
                        self._deliver(request_id, RuntimeError(f"engine error: {type(err).__name__}: {err}"))
                    return
                for out in outputs:
                    self._deliver(out.request_id, out)
