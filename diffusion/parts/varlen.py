"""Several requests in one model forward, each as alone (`stepper.run_forwards`).

The engine packs the forwards of every running request of one step into one flat forward `[1, N]`,
as the autoregressive path does: every token-wise layer (embedding, norms, MLPs, the LM head)
sees its rows as they are, each request's RoPE positions are its own (`position_ids`), and
attention runs per request over its own keys — through its own cache's `attend`, with the mask its
own forward would build (`PackedAttention`, through the model's KV-cache seam, so nothing of the
model changes). With the engine's `batch_invariant` the linear layers compute each request's rows
as the GEMM problems its own forward poses (`token_groups`), so a request's logits are bit for bit
its own forward's (`tests/test_varlen.py`). Only models whose spec says `segmented` (their attention
goes through `cache.attend` and they take `position_ids`) are run this way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.caches.kv import KVCache, attention


@dataclass(eq=False)
class Segment:
    """One request in a packed forward: its `rows` sequences of `length` tokens from flat row
    `start`; its own cache (None: none), where its forward writes (`cache_start`), and the mask
    its own forward would attend with."""

    start: int
    rows: int
    length: int
    cache: Any = None
    cache_start: int = 0
    mask: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.rows * self.length


class PackedAttention(KVCache):
    """The cache seam of a packed forward `[1, N]` holding several requests: each layer's attention
    runs per request, as its own forward runs it — over its own keys, through its own cache's
    `attend` (which writes its K/V) with its own mask. Requests whose attention is the same call
    (no cache or a contiguous `KVCache`, one query and key length, no mask) attend as one batch."""

    def __init__(self, segments: list[Segment]) -> None:
        super().__init__()
        self.segments = segments

    def get_seq_length(self, layer: int = 0) -> int:
        return 0

    @staticmethod
    def _rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
        # flat [1, H, N, D] → the request's [rows, H, length, D]
        return t[0, :, seg.start:seg.end].unflatten(1, (seg.rows, seg.length)).transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("a packed forward takes each request's mask through its segment")
        out = torch.empty_like(q)
        batched: dict[tuple, list[tuple[Segment, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for seg in self.segments:
            q_, k_, v_ = (self._rows(t, seg) for t in (q, k, v))
            if seg.cache is not None and type(seg.cache) is not KVCache:   # its own attention
                self._put(out, seg, seg.cache.attend(layer, q_, k_, v_, seg.cache_start, seg.mask))
                continue
            if seg.cache is not None:
                k_, v_ = seg.cache.update(layer, k_, v_, seg.cache_start)
            shape = None if seg.mask is None else (seg.mask.dtype, tuple(seg.mask.shape[1:]))
            batched.setdefault((seg.length, k_.shape[-2], shape), []).append((seg, q_, k_, v_))
        for members in batched.values():
            masks = None if members[0][0].mask is None else \
                [m[0].mask.expand(m[0].rows, *m[0].mask.shape[1:]) for m in members]
            if len(members) == 1:
                seg, q_, k_, v_ = members[0]
                self._put(out, seg, attention(q_, k_, v_, seg.mask))
                continue
            o = attention(*(torch.cat([m[i] for m in members]) for i in (1, 2, 3)),
                          None if masks is None else torch.cat(masks))
            row = 0
            for seg, *_ in members:
                self._put(out, seg, o[row:row + seg.rows])
                row += seg.rows
        return out

    @staticmethod
    def _put(out: torch.Tensor, seg: Segment, o: torch.Tensor) -> None:
        out[0, :, seg.start:seg.end] = o.transpose(0, 1).flatten(1, 2)
