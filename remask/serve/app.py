"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncEngine` per served model.

    app = build_app({"tiny-llada": AsyncEngine(remask.LLM("tiny-llada"))}, api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: `GET /` (the playground page), `POST /v1/completions`, `POST /v1/chat/completions` (JSON,
or SSE with `stream=true`, ended by `data: [DONE]`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), `POST /admin/models` (admin key: load, swap, unload). Errors have
OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}` (docs/serving.md lists
every status).

Streaming sends text only when it is final — a diffusion block once it is decoded, an AR token
at once — so a delta never holds a mask and is never taken back; text that could still be the
start of a `stop` string is held until it is decided.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import Any, AsyncIterator, Callable, Literal, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.routing import Match

from remask.diffusion.parts.checks import MAX_N, check_int, check_real
from remask.engine import EngineState, RequestOutput, SamplingParams

from .async_engine import AsyncEngine, QueueFull
from .protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter

MAX_BODY_BYTES = 1 << 20
# Seconds a request's whole body may take to arrive (a client that announces more than it sends is
# answered 408 then, not held open): 1 MiB in 10 s is ~100 KB/s.
BODY_TIMEOUT = 10.0
# A text prompt longer than context x this many characters cannot fit the context in any tokenizer
# remask serves (tokens average ~4 characters; the longest are runs of ~16-32), so it is refused
# before the tokenizer spends time and memory on it; the token count is checked after.
MAX_CHARS_PER_TOKEN = 32
# One JSON line per request (request id, route, status, milliseconds); the streamed body may go on after.
access_log = logging.getLogger("remask.serve.access")
# The playground: one static page (no build step) that streams drafts from the routes below.
PLAYGROUND = (importlib.resources.files("remask.serve") / "static" / "playground.html").read_text(encoding="utf-8")


# The engine aborts a request at its deadline, between steps; the HTTP layer answers 504 itself only
# this many seconds later (one step that runs long), so the engine's abort is what normally ends it.
DEADLINE_SLACK = 0.5


class ClientGone(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


async def client_gone(request: Request) -> None:
    """Returns once the client has closed the connection. Once the body is read, the ASGI server's
    next message is `http.disconnect` (uvicorn sends it when the connection closes), so this
    notices a client that leaves while the engine has nothing to report (one long block), not
    only when an output arrives."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)       # not expected after the body; never a busy loop


async def next_or_gone(awaitable: Any, gone: asyncio.Task, timeout: float | None) -> Any:
    """`await awaitable` unless the client goes first (`ClientGone`) or `timeout` seconds pass
    (`asyncio.TimeoutError`); either way the awaitable is cancelled (an engine stream's
    cancellation aborts its request)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone if gone in done else asyncio.TimeoutError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})    # its cleanup (the abort) runs before the caller answers


# OpenAI's error `code` is a string or null (the `openai` client types it `str | None`), never the
# HTTP status: OpenAI's own codes where OpenAI has the case (invalid_api_key, model_not_found,
# rate_limit_exceeded, unknown_parameter, unsupported_parameter, invalid_type,
# missing_required_parameter, invalid_value), otherwise a name for the status.
ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
               408: "request_timeout", 413: "request_too_large", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_unavailable",
               504: "timeout"}


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers
        self.code = code


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body; `code` defaults to the status's name in `ERROR_CODES`."""
    code = code if code is not None else ERROR_CODES.get(status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self, engines: dict[str, AsyncEngine]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("remask_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.latency = Histogram("remask_request_latency_seconds", "Time to the last token", ["model"], registry=r)
        self.ttft = Histogram("remask_time_to_first_token_seconds", "Time to the first final text", ["model"],
                              registry=r)
        self.generated = Counter("remask_generated_tokens", "Generated tokens", ["model"], registry=r)
        self.nfe = Counter("remask_model_forwards", "Forwards counted per request (NFE)", ["model"], registry=r)
        self.cache = Counter("remask_response_cache", "Response cache lookups", ["result"], registry=r)
        self.queue = Gauge("remask_queue_depth", "Requests waiting for admission", ["model"], registry=r)
        self.running = Gauge("remask_running_requests", "Requests being decoded", ["model"], registry=r)
        self.pages = Gauge("remask_kv_pages_in_use", "KV pages in use (autoregressive page store)", ["model"],
                           registry=r)
        self.hits = Gauge("remask_prefix_cache_hit_rate", "Full prompt pages found stored / looked up", ["model"],
                          registry=r)
        for name, engine in engines.items():
            self.watch(name, engine)

    def watch(self, name: str, engine: AsyncEngine) -> None:
        """Report `engine`'s gauges under `name` (again after a swap: the new engine's)."""
        inner = engine.engine
        self.queue.labels(name).set_function(lambda: inner.scheduler.num_waiting)
        self.running.labels(name).set_function(lambda: len(inner.scheduler.running))
        self.pages.labels(name).set_function(lambda: inner.kv_stats()["pages_in_use"])
        self.hits.labels(name).set_function(
            lambda: inner.kv_stats()["prefix_hits"] / max(1, inner.kv_stats()["prefix_lookups"]))

    def forget(self, name: str) -> None:
        for gauge in (self.queue, self.running, self.pages, self.hits):
            gauge.remove(name)


class ResponseCache:
    """Complete responses of deterministic requests (temperature 0, or an explicit seed), keyed by
    model, prompt and every setting; least recently used out beyond `size`, stale after `ttl`
    seconds. A hit returns exactly what a miss computed."""

    def __init__(self, size: int, ttl: float) -> None:
        if not isinstance(size, int) or size < 1 or not ttl > 0:
            raise ValueError(f"response_cache: size must be an int >= 1 and ttl > 0 seconds, got {size!r}, {ttl!r}")
        self.size, self.ttl = size, ttl
        self.entries: OrderedDict[tuple[str, str], tuple[float, dict]] = OrderedDict()
        self.lock = threading.Lock()

    @staticmethod
    def key(body: Any, params: Any) -> tuple[str, str] | None:
        if (params.temperature > 0 and params.seed is None) or params.way == "apd":
            return None          # sampled without a seed (a new answer each time), or another model's verdict
        settings = body.model_dump(exclude={"stream", "stream_options", "user", "timeout"})
        return body.model, json.dumps([type(body).__name__, settings, repr(params)], sort_keys=True, default=str)

    def forget(self, model: str) -> None:
        """Drop a model's entries (it was swapped to other weights, or unloaded)."""
        with self.lock:
            for key in [k for k in self.entries if k[0] == model]:
                del self.entries[key]

    def get(self, key: tuple[str, str]) -> dict | None:
        with self.lock:
            hit = self.entries.get(key)
            if hit is None or time.monotonic() - hit[0] > self.ttl:
                self.entries.pop(key, None)
                return None
            self.entries.move_to_end(key)
            return hit[1]

    def put(self, key: tuple[str, str], response: dict) -> None:
        with self.lock:
            self.entries[key] = (time.monotonic(), response)
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)


class RateLimiter:
    """At most `per_minute` requests per API key (or client address) in any 60 s window."""

    def __init__(self, per_minute: int) -> None:
        if not isinstance(per_minute, int) or per_minute < 1:
            raise ValueError(f"rate_limit must be an int >= 1 (requests per minute), got {per_minute!r}")
        self.per_minute = per_minute
        self.seen: dict[str, deque] = {}

    def retry_after(self, who: str) -> float:
        """0 when the request may go now (and it is counted), else the seconds to wait."""
        now = time.monotonic()
        window = self.seen.setdefault(who, deque())
        while window and now - window[0] >= 60:
            window.popleft()
        if len(window) >= self.per_minute:
            return 60 - (now - window[0])
        window.append(now)
        return 0.0


class AdminModelRequest(BaseModel):
    """`POST /admin/models`: load a model under a name (or swap the name to new weights), or
    unload a name."""

    model_config = ConfigDict(extra="forbid")
    action: Literal["load", "unload"]
    name: str
    path: str | None = None
    max_queue: int = 256


def retire(engine: AsyncEngine) -> None:
    """Drain `engine` (its requests in flight finish on it), then shut it down, in the background."""
    def wait_and_stop() -> None:
        engine.drain()
        while engine.num_requests:
            time.sleep(0.05)
        engine.shutdown()

    threading.Thread(target=wait_and_stop, daemon=True, name="remask-retire").start()


def owner_of(api_key: str) -> str:
    """The scheduler's owner tag of an API key: a digest, so the key itself never leaves the gate
    (logs, engine state)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def build_app(engines: dict[str, AsyncEngine], *, api_key: str | Sequence[str] | None = None,
              request_timeout: float | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, rate_limit: int | None = None,
              response_cache: tuple[int, float] | None = None, cors_origins: list[str] | None = None,
              admin_key: str | None = None, load_model: Callable[[str], Any] | None = None,
              defaults: dict[str, dict[str, Any]] | None = None, max_n: int = MAX_N,
              body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The app for `engines` (served name → engine). `api_key`: a key, or several, one of which is
    required as `Authorization: Bearer <key>` on `/v1/*` when set; the engine schedules fairly
    across keys (docs/engine.md, "Fairness"). `request_timeout`: seconds after which a request is aborted
    (504). `rate_limit`: requests per minute per key (429 beyond). `response_cache`: (size, ttl
    seconds) of the cache of deterministic responses. `cors_origins`: origins allowed by CORS
    (none by default). `admin_key`: enables `POST /admin/models` for requests bearing it;
    `load_model(path)` builds the `remask.LLM` it loads (default: `remask.LLM(path)`).
    `defaults`: per served name, `SamplingParams` fields used where a request sets nothing (checked
    here: a bad default fails at start, not on the first request). `max_n`: the most samples one
    request may ask for (`n`; OpenAI's 128 by default): one request's samples share the engine with
    everyone's. `max_body_bytes`: the largest request body, counted as it streams (chunked bodies
    too), 413 beyond. `body_timeout`: seconds a request's body may take to arrive, 408 beyond."""
    if not engines:
        raise ValueError("engines: serve at least one model")
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not all(isinstance(key, str) and key for key in api_keys):
        raise ValueError("api_key must be a non-empty string or a list of them")
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds or None, got {request_timeout!r}")
    check_int("max_n", max_n, minimum=1)
    check_int("max_body_bytes", max_body_bytes, minimum=1)
    check_real("body_timeout", body_timeout, low=0, low_open=True)
    app = FastAPI(title="remask", docs_url=None, redoc_url=None)
    engines = dict(engines)   # this app's own table: swaps replace entries, requests in flight keep theirs
    defaults = {name: dict(values) for name, values in (defaults or {}).items()}
    for name, values in defaults.items():
        if name not in engines:
            raise ValueError(f"defaults: {name!r} is not a served model ({sorted(engines)})")
        try:
            SamplingParams(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"defaults for {name!r}: {err}") from None
    metrics = Metrics(engines)
    limiter = RateLimiter(rate_limit) if rate_limit is not None else None
    cache = ResponseCache(*response_cache) if response_cache is not None else None
    app.state.engines, app.state.metrics = engines, metrics
    created = int(time.time())

    def rejection(request: Request) -> JSONResponse | None:
        """What the gate answers itself: an oversized body, a missing key, a rate limit."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return error_response(413, f"the request body is {length} bytes, more than {max_body_bytes}")
        path, auth = request.url.path, request.headers.get("authorization", "")
        if path.startswith("/admin/") and (admin_key is None or not secrets.compare_digest(auth,
                                                                                          f"Bearer {admin_key}")):
            if admin_key is None:
                return error_response(403, "admin routes are off: start the server with an admin key",
                                      kind="permission_error")
            return error_response(401, "the admin key is needed: Authorization: Bearer <admin key>",
                                  kind="authentication_error")
        if path.startswith("/v1/") and api_keys:
            # every key compared (constant time each), so the time does not tell which key was close
            matches = [secrets.compare_digest(auth, f"Bearer {key}") for key in api_keys]
            if not any(matches):
                return error_response(401, "a valid API key is needed: Authorization: Bearer <key>",
                                      kind="authentication_error")
            request.state.owner = owner_of(api_keys[matches.index(True)]) if len(api_keys) > 1 else None
        if limiter is not None and request.method == "POST" and path.startswith("/v1/"):
            wait = limiter.retry_after(auth or (request.client.host if request.client else "?"))
            if wait:
                return error_response(429, f"rate limit: {limiter.per_minute} requests per minute",
                                      kind="rate_limit_error", headers={"Retry-After": str(max(1, round(wait)))})
        return None

    def route_of(scope) -> str:
        """The route a request is for, also when the gate answers before routing (401, 403, 413),
        so /metrics counts those under their route."""
        for route in app.router.routes:
            if route.matches(scope)[0] is Match.FULL:
                return getattr(route, "path", "unmatched")
        return "unmatched"

    class Gate:
        """Pure ASGI (so a handler still sees its client disconnect): request IDs, the checks of
        `rejection`, the body-read deadline, security headers, the requests metric and the access log.

        Request IDs are the server's own (a fresh uuid): a client's `X-Request-ID` is echoed in the
        response header and logged beside it, never used to name the request in the engine, where a
        reused or guessed id could collide with (and abort) another client's request."""

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return
            started = time.perf_counter()
            request = Request(scope)
            request_id = uuid.uuid4().hex
            client_id = request.headers.get("x-request-id")
            if client_id is not None:
                client_id = client_id[:200]        # echoed and logged: bounded
            scope.setdefault("state", {})["request_id"] = request_id
            extra = [(b"x-request-id", (client_id or request_id).encode("latin-1", "replace")),
                     (b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                     (b"referrer-policy", b"no-referrer")]
            status = 500
            deadline = time.monotonic() + body_timeout
            body_done = False

            async def receive_body_in_time():
                """The body must arrive by the deadline (a client that announces more than it sends
                gets 408, not a connection held open); after the body, waiting (for a disconnect)
                is not bounded."""
                nonlocal body_done
                if body_done:
                    return await receive()
                try:
                    message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    body_done = True
                    raise StarletteHTTPException(408, f"the request body did not arrive within {body_timeout} s") \
                        from None
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message

            async def send_with_headers(message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            try:
                refused = rejection(request)
                if refused is not None:
                    await refused(scope, receive, send_with_headers)
                else:
                    await self.inner(scope, receive_body_in_time, send_with_headers)
            finally:
                route = getattr(scope.get("route"), "path", None) or route_of(scope)
                metrics.requests.labels(route, str(status)).inc()
                access_log.info(json.dumps({"request_id": request_id, "client_request_id": client_id,
                                            "method": request.method, "path": request.url.path, "route": route,
                                            "status": status, "ms": round((time.perf_counter() - started) * 1e3, 2),
                                            "client": request.client.host if request.client else None}))

    # Starlette's RequestBodyLimitMiddleware, inside the gate: it counts a body's bytes as they are
    # received and stops reading at the limit, raising a 413 HTTPException the handlers below answer in
    # OpenAI's shape, so a chunked body (no Content-Length for the gate to refuse) is bounded too, and
    # never buffered or tokenized past the limit. (FastAPI's own max_body_size sits outside the gate
    # and would turn the gate's 413 into plain text.)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_bytes)
    app.add_middleware(Gate)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return error_response(err.status, err.message, err.kind, err.param, err.headers, err.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        kind = first.get("type", "")
        if kind == "json_invalid":    # its loc holds the byte offset, not a field: no param
            position = next((part for part in first.get("loc", ()) if isinstance(part, int)), None)
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return error_response(400, f"the body is not valid JSON: {reason}"
                                  + (f" (at character {position})" if position is not None else ""), param=None,
                                  code="invalid_value")
        # pydantic names the member of a union it tried ("str", "list[int]", "function-after[...]"): not a field
        loc = [str(part) for part in first.get("loc", ()) if part != "body" and not (isinstance(part, str) and (
            part in ("str", "int", "float", "bool", "none", "dict", "list") or "[" in part))]
        param = ".".join(loc) or None
        code = ("unknown_parameter" if kind == "extra_forbidden" else "missing_required_parameter" if kind == "missing"
                else "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        message = str(err.detail)
        if err.status_code == 413:   # Starlette's body limit, on a body without (or with a false) Content-Length
            message = f"the request body is more than {max_body_bytes} bytes"
        return error_response(err.status_code, message, kind="not_found_error" if err.status_code == 404
                              else "timeout_error" if err.status_code == 408 else "invalid_request_error")

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(PLAYGROUND)

    @app.get("/health")
    async def health():
        states = {name: engine.state.value for name, engine in engines.items()}
        ready = all(engine.state is EngineState.READY for engine in engines.values())
        return JSONResponse({"status": "ready" if ready else "unavailable", "models": states},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "remask"}
                                           for name in engines]}

    swap_lock = asyncio.Lock()

    @app.post("/admin/models")
    async def admin_models(body: AdminModelRequest):
        """Load (or atomically swap) / unload a served model. A swap builds the new engine first,
        then replaces the name's entry in one assignment: requests already running finish on the
        old weights (which are then freed), new ones go to the new; none fails in between."""
        async with swap_lock:
            if body.action == "unload":
                if body.name not in engines:
                    raise APIError(404, f"model {body.name!r} is not served", kind="not_found_error", param="name",
                                   code="model_not_found")
                if len(engines) == 1:
                    raise APIError(400, "the last model cannot be unloaded", param="name")
                old = engines.pop(body.name)
                metrics.forget(body.name)
                if cache is not None:
                    cache.forget(body.name)
                retire(old)
                return {"unloaded": body.name, "models": sorted(engines)}
            if not body.path:
                raise APIError(400, "path: a shipped model name or a checkpoint folder is needed to load", param="path")
            build = load_model or _default_loader
            try:
                llm = await asyncio.to_thread(build, body.path)
                new = AsyncEngine(llm, max_queue=body.max_queue)
            except (ValueError, OSError, TypeError) as err:
                raise APIError(400, f"cannot load {body.path!r}: {err}", param="path") from None
            old = engines.get(body.name)
            engines[body.name] = new                      # the swap: one assignment
            metrics.watch(body.name, new)
            if cache is not None:
                cache.forget(body.name)                   # cached answers came from the old weights
            if old is not None:
                retire(old)
            return {"loaded": body.name, "path": body.path, "swapped": old is not None, "models": sorted(engines)}

    def engine_for(name: str) -> AsyncEngine:
        if name not in engines:
            raise APIError(404, f"model {name!r} is not served here; /v1/models lists {sorted(engines)}",
                           kind="not_found_error", param="model", code="model_not_found")
        return engines[name]

    def verifier(name: str) -> Any:
        if not isinstance(name, str) or name not in engines:
            raise ValueError(f"decoder.verifier: {name!r} is not a served model ({sorted(engines)})")
        return engines[name].llm.engine.model

    def params_for(body: CompletionRequest | ChatCompletionRequest):
        if body.n > max_n:       # one request's samples share the engine with everyone's requests
            raise APIError(400, f"n must be <= {max_n} (this server's maximum samples per request), got {body.n}",
                           param="n")
        try:
            return body.sampling_params(defaults.get(body.model), verifier)
        except UnsupportedParameter as err:
            raise APIError(400, str(err), param=err.names[0], code="unsupported_parameter") from None
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param=_param_named(str(err), body)) from None

    def check_text(engine: AsyncEngine, texts: list[tuple[str, str]], param: str) -> None:
        """Prompt text before the tokenizer sees it: valid Unicode (a lone surrogate, which JSON's
        \\ud800 escapes can carry, makes tokenizers raise), and no more characters than the model's
        context could hold at `MAX_CHARS_PER_TOKEN` (the token count is checked after tokenizing)."""
        for where, text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise APIError(400, f"{where} is not valid Unicode: a lone surrogate {text[err.start]!r} at character "
                                    f"{err.start} (send UTF-8 text)", param=param) from None
        context = engine.llm.engine.spec.max_length
        total = sum(len(text) for _, text in texts)
        if context is not None and total > context * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"{param} has {total} characters, more than the model's context ({context} tokens) "
                                f"can hold (at most {context * MAX_CHARS_PER_TOKEN} characters are tokenized)",
                           param=param)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = engine_for(body.model)
        params = params_for(body)
        if isinstance(body.prompt, str):
            check_text(engine, [("prompt", body.prompt)], "prompt")
        return await _respond(engine, body, body.prompt, params, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = engine_for(body.model)
        params = params_for(body)
        try:
            texts = [(f"messages[{i}].content", m.text(f"messages[{i}]")) for i, m in enumerate(body.messages)]
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        check_text(engine, texts, "messages")
        messages = [{**m.model_dump(exclude_none=True), "content": text} for m, (_, text) in zip(body.messages, texts)]
        spec = body.tools_spec
        tools = None if spec is None else [{"type": "function", "function": t["function"]} for t in body.tools]
        response_format = body.template_response_format()
        try:
            prompt = engine.llm.chat_ids(messages, tools=tools, response_format=response_format)
        except Exception as err:  # noqa: BLE001 - the messages are all that varies here: the template or the
            # tokenizer refusing them (jinja's raise_exception, a tokenizer's TypeError) is the client's 400
            raise APIError(400, f"messages: the chat template or tokenizer refused them: {type(err).__name__}: {err}",
                           param="messages") from None
        return await _respond(engine, body, prompt, params, request, chat=True)

    def timeout_for(body: CompletionRequest | ChatCompletionRequest) -> tuple[float | None, str]:
        """The request's time limit in seconds (its `timeout` field, or the server's
        request_timeout) and the name to report it under."""
        if body.timeout is None:
            return request_timeout, "request_timeout"
        if not math.isfinite(body.timeout) or not body.timeout > 0:
            raise APIError(400, f"timeout must be a finite number of seconds > 0, got {body.timeout!r}",
                           param="timeout")
        if request_timeout is not None and body.timeout > request_timeout:
            raise APIError(400, f"timeout must be <= {request_timeout} (this server's request_timeout), got "
                                f"{body.timeout!r}", param="timeout")
        return body.timeout, "timeout"

    def timed_out(timeout: float | None, name: str, where: str) -> APIError:
        return APIError(504, f"the request took longer than {name}={timeout} s and was aborted{where}",
                        kind="timeout_error", param="timeout" if name == "timeout" else None)

    def ended_early(out: RequestOutput, timeout: float | None, name: str) -> APIError | None:
        """The error for a request the engine ended before its answer: its deadline passed (504),
        or everything in flight was aborted because the server is shutting down (503)."""
        reasons = {o.finish_reason for o in out.outputs}
        if "timeout" in reasons:
            return timed_out(timeout, name, " in the engine")
        if "abort" in reasons:
            return APIError(503, "the request was aborted: the server is shutting down", kind="server_unavailable",
                            headers={"Retry-After": "1"})
        return None

    async def _respond(engine: AsyncEngine, body, prompt, params, request: Request, chat: bool):
        tools = body.tools_spec if chat else None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{request.state.request_id}"
        start = time.perf_counter()
        timeout, timeout_name = timeout_for(body)
        cache_key = cache.key(body, params) if cache is not None and not body.stream else None
        if cache_key is not None:
            hit = cache.get(cache_key)
            metrics.cache.labels("hit" if hit is not None else "miss").inc()
            if hit is not None:
                return {**hit, "id": request_id, "created": int(time.time())}
        drafts = bool(body.stream and body.stream_options is not None and body.stream_options.include_drafts)
        # The deadline goes into the engine, which aborts the request between steps once it has
        # passed; waiting here ends DEADLINE_SLACK later, for a step that runs long.
        deadline = None if timeout is None else start + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline + DEADLINE_SLACK - time.perf_counter())

        stream = engine.generate(request_id, prompt, params, drafts=drafts, deadline=deadline,
                                 owner=getattr(request.state, "owner", None))
        # Watched from the start, apart from outputs: a request with one long block reports nothing
        # until it is done, and its client may leave before (streaming or not).
        gone = asyncio.create_task(client_gone(request))
        streaming = False
        try:
            try:                                   # a bad request or a full queue surfaces here
                first = await next_or_gone(anext(stream), gone, left())
            except asyncio.TimeoutError:
                raise timed_out(timeout, timeout_name, "") from None
            except ClientGone:
                return Response(status_code=499)  # nobody to answer; the request was aborted, its pages freed
            except QueueFull as err:
                raise APIError(503, str(err), kind="server_unavailable", headers={"Retry-After": "1"}) from None
            except (ValueError, TypeError) as err:
                raise APIError(400, str(err), param=_param_named(str(err), body)) from None
            except Exception as err:  # noqa: BLE001 - a JSON 500 keeps the connection (an escaping error drops it)
                raise APIError(500, f"the request failed: {type(err).__name__}: {err}", kind="server_error") from None
            model = body.model
            if body.stream:
                early = ended_early(first, timeout, timeout_name) if first.finished else None
                if early is not None:
                    raise early
                # sse-starlette watches for the disconnect from here on (it cancels the generator,
                # whose `finally` aborts the request)
                gone.cancel()
                await asyncio.wait({gone})
                streaming = True                   # the stream is the response's now
                return EventSourceResponse(_sse(first, stream, body, params, request_id, model, chat, start,
                                                engine.llm.tokenizer if drafts else None, left, timeout, timeout_name,
                                                tools),
                                           ping=15, sep="\n")
            out = first

            async def rest() -> RequestOutput:
                last = first
                async for last in stream:
                    pass
                return last

            if not first.finished:
                try:
                    out = await next_or_gone(rest(), gone, left())
                except asyncio.TimeoutError:
                    raise timed_out(timeout, timeout_name, "") from None
                except ClientGone:
                    return Response(status_code=499)   # nobody to answer: aborted, its pages freed
        finally:
            if not gone.done():
                gone.cancel()
            if not streaming:
                await stream.aclose()              # left early (an error): abort it in the engine
        early = ended_early(out, timeout, timeout_name)
        if early is not None:
            raise early
        _observe(metrics, model, out, start, None)
        if any(o.finish_reason == "error" for o in out.outputs):
            message = next(o.error for o in out.outputs if o.finish_reason == "error")
            raise APIError(500, f"the request failed: {message}", kind="server_error")
        response = _full_response(out, request_id, model, chat, created=int(time.time()), tools=tools,
                                  top=params.logprobs or 0)
        if cache_key is not None:
            cache.put(cache_key, response)
        return response

    async def _sse(first: RequestOutput, stream: AsyncIterator[RequestOutput], body, params, request_id: str,
                   model: str, chat: bool, start: float, draft_tokenizer: Any, left: Callable[[], float | None],
                   timeout: float | None, timeout_name: str, tools: Any = None):
        sent = {i: "" for i in range(params.n)}
        tokens_sent = {i: 0 for i in range(params.n)}     # tokens whose logprobs went out
        chars_sent = {i: 0 for i in range(params.n)}      # completions' text_offset
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

        def with_logprobs(choice: dict[str, Any], o) -> dict[str, Any]:
            """The logprobs of the tokens generated since this choice's previous chunk."""
            if o.logprobs is None:
                return choice
            new = o.logprobs[tokens_sent[o.index]:]
            tokens_sent[o.index] = len(o.logprobs)
            lps = _logprobs(new, params.logprobs, chat, chars_sent[o.index])
            if not chat:
                chars_sent[o.index] += sum(len(t) for t in lps["tokens"])
            return {**choice, "logprobs": lps}
        calls = {i: _CallStream(tools, i) for i in range(params.n)} if tools is not None and tools.mode != "none" \
            else None
        hold = max((len(s) for s in params.stop), default=1) - 1
        now = int(time.time())
        ttft = None
        last = first

        def error_event(err: APIError) -> str:
            return json.dumps({"error": {"message": err.message, "type": err.kind, "param": err.param,
                                         "code": err.code or ERROR_CODES.get(err.status)}})

        try:
            if chat:
                yield json.dumps(_chunk(request_id, model, now, chat, [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    for i in range(params.n)]))
            out: RequestOutput | None = first
            while out is not None:
                last = out
                early = ended_early(out, timeout, timeout_name) if out.finished else None
                if early is not None:              # the engine ended it: its deadline, or a shutdown
                    yield error_event(early)
                    return
                if draft_tokenizer is not None:
                    for o in out.outputs:
                        if o.draft is not None:
                            yield json.dumps({**_chunk(request_id, model, now, chat, []),
                                              "draft": _draft(o, draft_tokenizer)})
                choices = []
                for o in out.outputs:
                    text = o.text
                    if o.finish_reason is None and hold:
                        text = text[:max(len(sent[o.index]), len(text) - hold)]
                    if calls is not None:           # a tool request: text or a call (`_CallStream`)
                        choice = calls[o.index].update(text, o.finish_reason)
                        if choice is not None:
                            choices.append(with_logprobs(choice, o))
                        continue
                    if not text.startswith(sent[o.index]):
                        continue        # never take back text already sent
                    delta = text[len(sent[o.index]):]
                    if delta or o.finish_reason is not None:
                        sent[o.index] = text
                        choices.append(with_logprobs(_choice(o.index, delta, o.finish_reason, chat), o))
                if choices:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    chunk = _chunk(request_id, model, now, chat, choices)
                    if continuous:              # vLLM's continuous_usage_stats: usage so far in every chunk
                        chunk["usage"] = _usage(out)
                    yield json.dumps(chunk)
                try:
                    out = await asyncio.wait_for(anext(stream, None), timeout=left())
                except asyncio.TimeoutError:
                    yield error_event(timed_out(timeout, timeout_name, ""))
                    return
            if body.stream_options is not None and body.stream_options.include_usage:
                yield json.dumps({**_chunk(request_id, model, now, chat, []), "usage": _usage(last)})
            yield "[DONE]"
            _observe(metrics, model, last, start, ttft)
        finally:
            await stream.aclose()                  # a disconnect aborts the request and frees its pages

    if cors_origins:     # outermost (added last): preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"])
    return app


def _param_named(message: str, body: Any) -> str | None:
    """The body field an error message names first (SamplingParams' messages start with it)."""
    fields = type(body).model_fields
    head = message.split(" ", 1)[0].rstrip(":,")
    if head == "prompt" and "messages" in fields:    # the engine's word for a chat's tokenized messages
        return "messages"
    # "use_cache.track_num": a field's key; "tools[1].function.name": an element's
    return head if head.split(".", 1)[0].split("[", 1)[0] in fields else None


def _default_loader(path: str) -> Any:
    import remask

    return remask.LLM(path)


def _draft(o, tokenizer) -> dict[str, Any]:
    """A provisional canvas: each generated position's text, or None while it is masked."""
    return {"index": o.index, "nfe": o.nfe, "final": o.finish_reason is not None, "token_ids": o.draft,
            "canvas": [None if t is None else tokenizer.decode([t]) for t in o.draft]}


def _choice(index: int, text: str, finish_reason: str | None, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chunk(request_id: str, model: str, created: int, chat: bool, choices: list) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}


def _usage(out: RequestOutput) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def _is_call(tools: Any, text: str, finish_reason: str | None) -> bool:
    """Whether a finished answer of a tool request is a call: it finished with `stop` (a complete
    structure) and it is one (`ToolCallSpec.is_call`). An answer cut at `length` is text."""
    return tools is not None and tools.mode != "none" and finish_reason == "stop" and bool(tools.is_call(text))


def _message(o: Any, tools: Any) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message and finish reason: calls (`tool_calls`, each with its own id;
    content null; finish reason `tool_calls`) or text."""
    if _is_call(tools, o.text, o.finish_reason):
        return ({"role": "assistant", "content": None,
                 "tool_calls": [_tool_call(call, _call_id()) for call in tools.calls_of(o.text)]}, "tool_calls")
    return {"role": "assistant", "content": o.text}, o.finish_reason


class _CallStream:
    """What one choice of a streamed tool request has sent. Text streams as `content` once it is
    known to be text (`auto`: the first characters are not the start of `<tool_call>`; held while
    they could be). Calls stream as OpenAI's `tool_calls` deltas, whatever the `tool_choice`
    (named, `required`, `auto`): per call (`index` 0, 1, … in the answer), a first delta with its
    `id`, `type` and `function.name` (once the name is complete) and the arguments so far, then
    `function.arguments` fragments as the answer is committed (`ToolCallSpec.scan`); the last chunk
    has finish reason `tool_calls`. An answer cut at `length` ends with finish reason `length`:
    a text answer with what was held as `content`, a call with what of it was sent."""

    def __init__(self, tools: Any, index: int) -> None:
        self.tools, self.index = tools, index
        self.sent = ""
        self.calls: list[tuple[str, int]] = []   # per call sent: its id and how much of its arguments
        self.kind: str | None = None      # "text" / "call", once known
        self.done = False

    def _out(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any] | None:
        if not delta and finish_reason is None:
            return None
        self.done = finish_reason is not None
        return {"index": self.index, "delta": delta, "finish_reason": finish_reason}

    def update(self, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        if self.done:              # a finished choice is reported again while its siblings run
            return None
        if self.kind is None:
            decided = self.tools.is_call(text)
            if decided is None and finish_reason is not None:
                decided = False
            if decided is not None:
                self.kind = "call" if decided else "text"
        if self.kind is None:
            return None
        if self.kind == "call":
            deltas = []
            for j, (name, arguments, _) in enumerate(self.tools.scan(text)):
                if name is None:           # not known yet: this call (and any after it) waits
                    break
                if j == len(self.calls):
                    self.calls.append((_call_id(), len(arguments)))
                    deltas.append({"index": j, "id": self.calls[j][0], "type": "function",
                                   "function": {"name": name, "arguments": arguments}})
                elif len(arguments) > self.calls[j][1]:
                    deltas.append({"index": j, "function": {"arguments": arguments[self.calls[j][1]:]}})
                    self.calls[j] = (self.calls[j][0], len(arguments))
            return self._out({"tool_calls": deltas} if deltas else {},
                             "tool_calls" if finish_reason == "stop" else finish_reason)
        delta_text = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return self._out({"content": delta_text} if delta_text else {}, finish_reason)


def _logprobs(entries: list[dict] | None, top: int, chat: bool, offset: int = 0) -> dict[str, Any] | None:
    """Tokens' logprobs (`CompletionOutput.logprobs`: per token, the sampled id first, then its
    alternatives) in OpenAI's shape: chat `{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [the `top` most likely]}]}`; completions `{"tokens", "token_logprobs",
    "top_logprobs": [{token: logprob}], "text_offset"}` (offsets from `offset`, in characters)."""
    if entries is None:
        return None

    def most_likely(entry: dict) -> list:
        return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top),
                      key=lambda lp: lp.rank)[:top]

    sampled = [next(iter(entry.values())) for entry in entries]
    if chat:
        def item(lp) -> dict[str, Any]:
            token = lp.decoded_token or ""
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}

        return {"content": [{**item(lp), "top_logprobs": [item(alt) for alt in most_likely(entry)]}
                            for lp, entry in zip(sampled, entries)]}
    offsets = []
    for lp in sampled:
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": [lp.decoded_token or "" for lp in sampled], "token_logprobs": [lp.logprob for lp in sampled],
            "top_logprobs": [{alt.decoded_token or "": alt.logprob for alt in [lp, *most_likely(entry)]}
                             for lp, entry in zip(sampled, entries)],
            "text_offset": offsets}


def _full_response(out: RequestOutput, request_id: str, model: str, chat: bool, created: int,
                   tools: Any = None, top: int = 0) -> dict[str, Any]:
    if chat:
        choices = []
        for o in out.outputs:
            message, finish_reason = _message(o, tools)
            choices.append({"index": o.index, "message": message, "finish_reason": finish_reason,
                            "logprobs": _logprobs(o.logprobs, top, chat)})
    else:
        choices = [{"index": o.index, "text": o.text, "finish_reason": o.finish_reason,
                    "logprobs": _logprobs(o.logprobs, top, chat)} for o in out.outputs]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(out)}


def _observe(metrics: Metrics, model: str, out: RequestOutput, start: float, ttft: float | None) -> None:
    metrics.latency.labels(model).observe(time.perf_counter() - start)
    first = out.metrics.get("time_to_first_token") if ttft is None else ttft
    if first is not None:
        metrics.ttft.labels(model).observe(first)
    metrics.generated.labels(model).inc(sum(len(o.token_ids) for o in out.outputs))
    metrics.nfe.labels(model).inc(sum(o.nfe for o in out.outputs))
