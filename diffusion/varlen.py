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
