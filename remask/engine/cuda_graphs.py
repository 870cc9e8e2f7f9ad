"""CUDA graphs for the engine's uncached full forwards (`LLMEngine(..., cuda_graphs=True)`).

What is graphed: only the shared forward of diffusion sequences with no cache — LLaDA's
`BlockDecoder` and Dream's `DreamDecoder` under the key `("full", T, ...)`, whose forward is
`spec.logits(model, x)` on the stacked canvases `x` `[G, T]` → logits `[G, T, V]` (a lone such
sequence takes the same path, as a group of one). Its shapes are static within a bucket, so it can
be captured once and replayed. Everything else runs eagerly as before: the prefix / dual / paged
caches, CFG, sparse attention, padded prompts, block-causal models, autoregressive paged forwards,
and the decoders' commits (sampling), which stay in Python after the replay.

How (after nano-vllm's `capture_cudagraph`): a group of G rows runs in the bucket = the smallest
of 1, 2, 4, 8, … (up to `max_num_seqs`, which is a bucket too) that is ≥ G. Each (bucket, T, inputs)
is captured lazily on its first use — warm-up forwards on a side stream, then one capture into a
memory pool all graphs share (replays are serial on one stream, so they never overlap) — with a
static input buffer `[bucket, T]`. A call copies its G rows in, fills the padding rows with copies of
row 0, replays, and returns a clone of the first G rows of the static logits (the next replay
overwrites them). At most `max_graphs` (16) graphs are kept, least recently used evicted: each holds its
static logits `[bucket, T, V]` (for an 8B LLaDA, V = 126464 in bfloat16: 64 × 256 positions is
about 4 GB), which stay reserved in the pool as long as the graph is kept, and every new canvas length T
captures new graphs: the cap bounds that memory, not the number of lengths served.

Why the padding rows cannot change the real rows: the forward is bidirectional with no attention
mask and no cache, and nothing mixes rows (attention, norms and MLPs work per row), so row i's
logits are a function of row i alone — as they already are when G different requests share one
eager forward. Bit for bit, though, a GEMM's result may depend on how many rows share it: the
capture runs inside the engine's `batch_invariant_linear` context for `bucket` rows (the one the
eager forward enters for G rows), so with `batch_invariant=True` every linear layer is a batched
GEMM of per-row problems either way (bitwise equal on CPU; on CUDA this rests on cuBLAS picking
its kernel by the problem, not the batch count — unmeasured); with `batch_invariant=False` the
padded graph may round otherwise than an unpadded eager batch, as batch composition already may.
A group of one is bucket 1: never padded, the eager forward's very kernels.

A forward that cannot be captured (one that syncs with the host, e.g. an MoE router's `nonzero`)
is warned about once and runs eagerly from then on. The CUDA specifics sit in `CudaGraphBackend`;
`GraphedForward` takes any backend with `capture(body) -> (graph, output)` and `graph.replay()`, so
its logic is tested on CPU (`tests/test_cuda_graphs.py`).
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Hashable, Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, body: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """Record `body` (which reads the static inputs it closes over) once; returns the graph
        and the static output that each `replay()` rewrites."""
        ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` captures sharing one memory pool."""

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        with torch.cuda.device(self.device):
            # Warm-up on a side stream, as torch.cuda.graphs asks: lazy initialisation (cuBLAS
            # handles, autotuning) must not happen inside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other engines' threads in the process (a server with several models)
            # may go on using CUDA while this thread captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = body()
        return graph, out


def make_backend(device: torch.device) -> GraphBackend:
    """The backend for `cuda_graphs=True`; refuses a model that is not on a CUDA device.
    (Tests replace this function to run the engine's graph path on CPU with a stand-in graph.)"""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; this model is on {device.type}"
                         + ("" if torch.cuda.is_available() else " and torch.cuda is not available")
                         + ": use cuda_graphs=False")
    return CudaGraphBackend(device)


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, 8, … below `max_batch`, then `max_batch` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class _Entry:
    def __init__(self, graph: Graph, static_in: torch.Tensor, static_out: torch.Tensor) -> None:
        self.graph, self.static_in, self.static_out = graph, static_in, static_out


class GraphedForward:
    """Replays a captured forward per (bucket, T, key); see the module docstring."""

    def __init__(self, backend: GraphBackend, max_batch: int, max_graphs: int = 16) -> None:
        self.backend = backend
        self.buckets = buckets_up_to(max_batch)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Entry] = OrderedDict()   # LRU: most recently used last
        self.uncapturable: set[Hashable] = set()
        self.captures = self.replays = 0   # for tests and the curious

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket ≥ rows; None when no bucket is that large (then: eager)."""
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(self, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], key: Hashable = (),
                 context: Callable[[int], ContextManager[Any]] = lambda rows: contextlib.nullcontext()
                 ) -> torch.Tensor:
        """`forward(x)` for token ids `x` `[G, T]`, its rows independent of each other, by replay.
        `key` names what `forward` computes besides the shape (it is only called to capture);
        `context(rows)` is entered around the forward of `rows` rows (the eager path's context)."""
        G, T = x.shape
        bucket = self.bucket(G)
        if bucket is None or key in self.uncapturable:
            with context(G):
                return forward(x)
        entry = self.graphs.get((bucket, T, key))
        if entry is None:
            entry = self._capture(bucket, x, forward, key, context)
            if entry is None:
                with context(G):
                    return forward(x)
        self.graphs.move_to_end((bucket, T, key))
        entry.static_in[:G].copy_(x)
        if bucket > G:   # valid token ids, independent of earlier calls' leftovers
            entry.static_in[G:].copy_(x[:1].expand(bucket - G, T))
        entry.graph.replay()
        self.replays += 1
        return entry.static_out[:G].clone()   # the next replay rewrites static_out

    def _capture(self, bucket: int, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
                 key: Hashable, context: Callable[[int], ContextManager[Any]]) -> _Entry | None:
        static_in = x[:1].expand(bucket, x.shape[1]).clone()   # real token ids for the warm-up

        def body() -> torch.Tensor:
            with context(bucket):   # the same per-row linear layers as the eager forward
                return forward(static_in)

        while len(self.graphs) >= self.max_graphs:   # first, so the capture may reuse their pool memory
            self.graphs.popitem(last=False)
        try:
            graph, static_out = self.backend.capture(body)
        except Exception as err:  # noqa: BLE001 - a forward that cannot be captured still runs eagerly
            self.uncapturable.add(key)
            warnings.warn(f"cuda_graphs: this forward cannot be captured ({type(err).__name__}: {err}); "
                          f"it runs eagerly", RuntimeWarning, stacklevel=3)
            return None
        self.captures += 1
        entry = self.graphs[bucket, x.shape[1], key] = _Entry(graph, static_in, static_out)
        return entry
