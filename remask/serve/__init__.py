"""`remask serve`: an OpenAI-compatible HTTP server over the engine (FastAPI, SSE, Prometheus).
Needs the `serve` extra: `pip install remask[serve]`."""
from .app import build_app
from .async_engine import AsyncEngine, QueueFull
from .server import DrainingServer, serve

__all__ = ["AsyncEngine", "DrainingServer", "QueueFull", "build_app", "serve"]
