"""Several diffusion sequences of different lengths in one model forward, each as alone.

The engine shares a forward between sequences whose next forwards are the whole canvas with no
cache (LLaDA's `BlockDecoder`, Dream's `DreamDecoder` without a cache). Of one length they stack
into a batch `[G, T]`; of different lengths they go **flat**, `[1, ΣT]`, as the autoregressive path
does: every token-wise layer (embedding, norms, MLPs, the LM head) sees its rows as they are, each
sequence's RoPE positions restart at 0 (`position_ids`), and attention runs per sequence over its
own keys only (`SegmentedAttention`, through the model's KV-cache seam, so nothing of the model
changes). With the engine's `batch_invariant` the linear layers compute each sequence's rows with
the shapes they have alone (`token_groups`), so a sequence's logits are bit for bit its own
forward's (`tests/test_varlen.py`). Only models whose spec says `segmented` (their attention goes
through `cache.attend` and they take `position_ids`) are run this way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.caches.kv import KVCache, attention
from remask.models.spec import ModelSpec


class SegmentedAttention(KVCache):
    """A stand-in cache for a flat forward of sequences of `lengths`: it keeps nothing, and each
    layer's attention runs per sequence over that sequence's own keys (`attention` on its slice,
    the call its own forward makes)."""

    def __init__(self, lengths: list[int]) -> None:
        super().__init__()
        self.spans, start = [], 0
        for length in lengths:
            self.spans.append((start, start + length))
            start += length
        # sequences of one length attend as one batch (the stacked shared forward's call)
        self.by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            self.by_length.setdefault(length, []).append(i)

    def get_seq_length(self, layer: int = 0) -> int:
        return 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("a segmented forward has no attention mask (unpadded sequences only)")
        out = torch.empty_like(q)
        for members in self.by_length.values():
            spans = [self.spans[i] for i in members]
            if len(spans) == 1:
                (a, b), = spans
                out[:, :, a:b] = attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None)
                continue
            q_, k_, v_ = (torch.cat([t[:, :, a:b] for a, b in spans]) for t in (q, k, v))
            o = attention(q_, k_, v_, None)
            for j, (a, b) in enumerate(spans):
                out[:, :, a:b] = o[j:j + 1]
        return out


@dataclass(eq=False)
class Segment:
    """One request in a packed forward: its `rows` sequences of `length` tokens from flat row
    `start`; its own cache (None: none), where its forward writes (`cache_start`), the mask its
    own forward would attend with, and whether its rows' linears are separate problems."""

    start: int
    rows: int
    length: int
    cache: Any = None
    cache_start: int = 0
    mask: torch.Tensor | None = None
    rows_alone: bool = False

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


def token_groups(lengths: list[int], device: torch.device | str) -> list[tuple[int, torch.Tensor]]:
    """The flat layout's rows grouped by sequence length: `(length, row indices)` per length (the
    engine's `batch_invariant_linear(token_groups=...)`)."""
    rows: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        rows.setdefault(length, []).extend(range(start, start + length))
        start += length
    return [(length, torch.tensor(r, dtype=torch.long, device=device)) for length, r in rows.items()]


def segmented_logits(spec: ModelSpec, model: torch.nn.Module, xs: list[torch.Tensor],
                     **forward_inputs: Any) -> tuple[torch.Tensor, list[int]]:
    """Logits of the canvases `xs` (each `[1, T_i]`, no padding) from one forward: (`[1, ΣT, V]`,
    each sequence's first row). Row `offsets[i] + j` is what `spec.logits(model, xs[i])` gives at
    position j (the logit shift, where the model has one, is applied per sequence)."""
    if not spec.segmented:
        raise ValueError(f"the {spec.kind!r} model does not run segmented forwards (spec.segmented is False)")
    if any(x.dim() != 2 or x.shape[0] != 1 for x in xs):
        raise ValueError("segmented_logits takes canvases of one row each, [1, T]")
    lengths = [x.shape[1] for x in xs]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    flat = torch.cat(xs, dim=1)
    positions = torch.cat([torch.arange(n, device=flat.device) for n in lengths])[None]
    logits = model(flat, past_key_values=SegmentedAttention(lengths), position_ids=positions,
                   **forward_inputs).logits
    if spec.logit_shift:   # position i scores from hidden state i − 1, within each sequence
        shifted = torch.empty_like(logits)
        for a, n in zip(offsets, lengths):
            shifted[:, a:a + 1] = logits[:, a:a + 1]
            shifted[:, a + 1:a + n] = logits[:, a:a + n - 1]
        logits = shifted
    return logits, offsets
