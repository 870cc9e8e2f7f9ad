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

With `varlen` (the engine's `varlen_attention=True`) a layer's attention is ONE `varlen_attention` call for
every request whose keys are its in-forward K/V or those of a cache that attends as `KVCache` does (prefix, dual,
FreeDave's drafts' tree): each request's keys (its cache written first) are gathered into one pool read through a
block table of one-slot pages, and each row's reduction order is its own whatever else is packed (the kernel's
batch invariance). The other caches (dKV, d2Cache, Elastic, paged, sparse) and float masks attend per request.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from remask.caches.kv import KVCache, attention
from remask.kernels.varlen_attention import varlen_attention_each


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


def token_groups(segments: list[Segment], rows_alone: list[bool], device: Any) -> list[tuple[int, torch.Tensor]]:
    """The GEMM problems of a packed layout, as each request's own forward poses them: one of
    rows × length per request, or one per row with `rows_alone` (`batch_invariant.token_groups`)."""
    problems: dict[int, list[torch.Tensor]] = {}
    for seg, alone in zip(segments, rows_alone):
        length = seg.length if alone else seg.rows * seg.length
        problems.setdefault(length, []).append(torch.arange(seg.start, seg.end, device=device))
    return [(length, torch.cat(rows)) for length, rows in problems.items()]


class PackedAttention(KVCache):
    """The cache seam of a packed forward `[1, N]` holding several requests: each layer's attention
    runs per request, as its own forward runs it — over its own keys, through its own cache's
    `attend` (which writes its K/V) with its own mask. Requests whose attention is the same call
    (no cache or one that attends as `KVCache` does, one query and key length, no mask) attend as one batch,
    unless `batch_calls` is False: then each request's attention is its own forward's call, of its
    own shape and strides, so a kernel whose split depends on the batch (CUDA's SDPA) splits each
    request's rows as it does alone (the runner's batch invariance on CUDA). With `varlen` the requests whose
    cache attends as `KVCache` does, with no mask or a boolean one, attend in one `varlen_attention` call per
    layer (module docstring)."""

    def __init__(self, segments: list[Segment], batch_calls: bool = True, varlen: bool = False) -> None:
        super().__init__()
        self.segments, self.batch_calls, self.varlen = segments, batch_calls, varlen
        self._plan: Any = None   # varlen_attention_each's, the same for every layer

    def get_seq_length(self, layer: int = 0) -> int:
        return 0

    @staticmethod
    def _rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
        # the request's part of the flat [1, H, N, D] (a view, `split`) → its [rows, H, length, D]
        return t if seg.rows == 1 else t[0].unflatten(1, (seg.rows, seg.length)).transpose(0, 1)

    @staticmethod
    def _flat(o: torch.Tensor, seg: Segment) -> torch.Tensor:
        # its [rows, H, length, D] output → its part of the flat [1, H, rows · length, D]
        return o if seg.rows == 1 else o.transpose(0, 1).flatten(1, 2)[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("a packed forward takes each request's mask through its segment")
        # the segments lie one after another: each request's q, k, v are views of one split each
        sizes = [seg.end - seg.start for seg in self.segments]
        parts = [t.split(sizes, dim=2) for t in (q, k, v)]
        outs: list[torch.Tensor | None] = [None] * len(self.segments)
        batched: dict[tuple, list[tuple[int, Segment, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        joined: list[tuple[int, Segment, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i, seg in enumerate(self.segments):
            q_, k_, v_ = (self._rows(t[i], seg) for t in parts)
            if seg.cache is not None and type(seg.cache).attend is not KVCache.attend:   # its own attention
                outs[i] = seg.cache.attend(layer, q_, k_, v_, seg.cache_start, seg.mask)
                continue
            if seg.cache is not None:   # (a `TreeKVCache` writes nothing: it gives each draft's keys)
                k_, v_ = seg.cache.update(layer, k_, v_, seg.cache_start)
            if self.varlen and (seg.mask is None or seg.mask.dtype == torch.bool and seg.mask.shape[1] == 1):
                joined.append((i, seg, q_, k_, v_))
                continue
            shape = None if seg.mask is None else (seg.mask.dtype, tuple(seg.mask.shape[1:]))
            key = (seg.length, k_.shape[-2], shape) if self.batch_calls else (id(seg),)
            batched.setdefault(key, []).append((i, seg, q_, k_, v_))
        for members in batched.values():
            if len(members) == 1:
                i, seg, q_, k_, v_ = members[0]
                outs[i] = attention(q_, k_, v_, seg.mask)
                continue
            masks = None if members[0][1].mask is None else \
                [m[1].mask.expand(m[1].rows, *m[1].mask.shape[1:]) for m in members]
            o = attention(*(torch.cat([m[j] for m in members]) for j in (2, 3, 4)),
                          None if masks is None else torch.cat(masks))
            for (i, *_), own in zip(members, o.split([m[1].rows for m in members])):
                outs[i] = own
        if joined:
            self._attend_joined(joined, outs)
        return torch.cat([self._flat(o, seg) for o, seg in zip(outs, self.segments)], dim=2)

    def _attend_joined(self, members: list[tuple[int, Segment, torch.Tensor, torch.Tensor, torch.Tensor]],
                       outs: list) -> None:
        """`varlen_attention_each` for `members` (i, segment, q `[rows, Hq, L, D]`, its keys and values `[rows,
        H_kv, T, D]`): each row of each member a set of queries over its own keys, under its boolean mask."""
        sets = [(q_[r].transpose(0, 1), k_[r].transpose(0, 1), v_[r].transpose(0, 1),
                 None if seg.mask is None else seg.mask[r % seg.mask.shape[0], 0])
                for _, seg, q_, k_, v_ in members for r in range(seg.rows)]
        own, self._plan = varlen_attention_each(*zip(*sets), plan=self._plan)
        first = 0
        for i, seg, *_ in members:
            outs[i] = torch.stack(own[first:first + seg.rows]).transpose(1, 2)
            first += seg.rows


class PackedLayers:
    """A packed forward whose requests do work of their own between the model's layers
    (`ForwardRequest.layers`: Elastic-Cache keeps each layer's input and may recompute the later
    layers over all its positions). Before each block every such request gets its own rows of the
    hidden state and returns the rows the block runs on (their number may change) with its RoPE
    tables; the other requests keep their rows and their tables from the model's own layout. The
    segments, the attention seam and the GEMM problems (`regroup`) follow the new layout."""

    def __init__(self, requests: list, packed: PackedAttention, regroup: Callable[[list], None] | None) -> None:
        self.requests, self.packed, self.regroup = requests, packed, regroup
        self.rope: list | None = None   # each request's RoPE tables in the model's layout

    @contextlib.contextmanager
    def installed(self, blocks: torch.nn.ModuleList) -> Iterator[None]:
        handles = []
        try:
            for layer, block in enumerate(blocks):
                handles.append(block.register_forward_pre_hook(
                    lambda module, args, layer=layer: self._before(layer, *args)))
                handles.append(block.register_forward_hook(
                    lambda module, args, output, layer=layer: self._after(layer)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, layer: int, h: torch.Tensor, pos: Any, mask: Any) -> tuple:
        segments = self.packed.segments
        if self.rope is None:
            self.rope = [(pos.cos[:, :, s.start:s.end], pos.sin[:, :, s.start:s.end]) for s in segments]
        own_rows, moved, start = [], [], 0   # each request's (rows, RoPE cos, RoPE sin) and segment in the new layout
        for r, seg, (c, s) in zip(self.requests, segments, self.rope):
            own = h[:, seg.start:seg.end]
            if r.layers is not None:   # a copy: what it keeps must not hold the whole batch's rows
                own, c, s = r.layers.before(layer, own if len(segments) == 1 else own.clone())
            own_rows.append((own, c, s))
            moved.append(replace(seg, start=start, length=own.shape[1] // seg.rows))
            start += own.shape[1]
        if any(a.length != b.length for a, b in zip(moved, segments)) and self.regroup is not None:
            self.regroup(token_groups(moved, [r.rows_alone for r in self.requests], h.device))
        self.packed.segments = moved
        rows, cos, sin = zip(*own_rows)
        h = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        return h, replace(pos, cos=torch.cat(cos, dim=2), sin=torch.cat(sin, dim=2)), mask

    def _after(self, layer: int) -> None:
        for r in self.requests:
            if r.layers is not None:
                r.layers.after(layer)
