"""CUDA graphs for the engine's uncached full forwards (`LLMEngine(..., cuda_graphs=True)`,
docs/engine.md).

Only the shared forward of cache-less diffusion sequences is graphed (LLaDA's `BlockDecoder`,
Dream's `DreamDecoder`, key `("full", T, ...)`). After nano-vllm's `capture_cudagraph`: G rows run
in the smallest bucket ≥ G of 1, 2, 4, …, `max_num_seqs`, captured lazily per (bucket, T, key) into
one shared pool, padded with copies of row 0 (no mask, no cache: rows never mix). The capture runs in
`batch_invariant_linear` for `bucket` rows, as the eager forward does (bitwise equal on CPU; on CUDA
it rests on cuBLAS picking its kernel by the problem, not the batch count: unmeasured). At most
`max_graphs` (16) are kept, LRU: each holds its static logits `[bucket, T, V]` (8B LLaDA, bf16,
64 × 256 positions ≈ 4 GB).
A forward that cannot be captured (a host sync, e.g. an MoE router's `nonzero`) warns once and runs
eagerly. Any backend with `capture(body) -> (graph, output)` works: tests run it on CPU.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict, namedtuple
from typing import Any, Callable, ContextManager, Hashable, Protocol

import torch


class GraphBackend(Protocol):
    def capture(self, body: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Record `body` (which reads the static inputs it closes over) once; returns the graph (its
        `replay()` reruns it) and the static output that each replay rewrites."""


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` captures sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pool = device, torch.cuda.graph_pool_handle()

    def capture(self, body: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        with torch.cuda.device(self.device):
            # Warm-up on a side stream, as torch.cuda.graphs asks: lazy initialisation (cuBLAS
            # handles, autotuning) must not happen inside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
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
    """1, 2, 4, 8, … below `max_batch` (≥ 1), then `max_batch` itself."""
    return [1 << i for i in range((max_batch - 1).bit_length())] + [max_batch]


# a captured graph with its static input (token ids `[bucket, T]`) and output (logits)
_Entry = namedtuple("_Entry", "graph static_in static_out")


class GraphedForward:
    """Replays a captured forward per (bucket, T, key); see the module docstring."""

    def __init__(self, backend: GraphBackend, max_batch: int, max_graphs: int = 16) -> None:
        self.backend, self.buckets, self.max_graphs = backend, buckets_up_to(max_batch), max_graphs
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
        bucket, entry = self.bucket(G), None
        if bucket is not None and key not in self.uncapturable:
            entry = self.graphs.get((bucket, T, key)) or self._capture(bucket, x, forward, key, context)
        if entry is None:   # no bucket that large, or not capturable: eager
            with context(G):
                return forward(x)
        self.graphs.move_to_end((bucket, T, key))
        entry.static_in[:G].copy_(x)
        entry.static_in[G:].copy_(x[:1].expand(bucket - G, T))   # padding: valid ids, not earlier calls' leftovers
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
