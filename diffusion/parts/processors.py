"""Logits processors: edits of a forward's logits before a decoder's commit scores them, given to a
decoder as parts (`Decoder.add_processor`) rather than as subclasses of it.

`HoldEndIds` is `min_tokens`: vLLM masks the end tokens while fewer than `min_tokens` tokens exist;
a diffusion model writes in any order, so here they are masked at the answer's first `min_tokens`
positions at every step, before the (unchanged) rule scores. The structured-output filter
(`constrain.CommitFilter`) and temperature / top-p (`scoring.filter_logits`) are the other parts
that edit logits; they live beside the scoring they belong to.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from remask.models.parallel import full_logits


@dataclass(frozen=True, eq=False)
class HoldEndIds:
    """`min_tokens`: the end `ids` held back at the answer's first `min_tokens` positions."""

    min_tokens: int
    ids: torch.Tensor

    def __call__(self, state: Any, logits: torch.Tensor, fed: int) -> torch.Tensor:
        """`logits` `[B, L, V]` of positions `fed`, `fed + 1`, … with `ids` at −inf at the answer's first
        `min_tokens` positions (no end token can be chosen there). A copy where anything changes; the caller's
        tensor (a shared forward's) is never written."""
        cut = min(state.prompt_len + self.min_tokens - fed, logits.shape[1])
        if cut <= 0:
            return logits
        logits = full_logits(logits).clone()     # whole rows: the ids are global vocabulary ids
        logits[:, :cut].index_fill_(-1, self.ids, -torch.inf)
        return logits


def logprob_entries(logits: torch.Tensor, tokens: torch.Tensor,
                    top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` `[N, V]` (raw): the log-probability of its token in `tokens` `[N]`, that token's
    rank (1: the most likely), and the ids and log-probabilities of the `top` most likely."""
    logprobs = torch.log_softmax(full_logits(logits).float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    best = logprobs.topk(top, dim=-1)
    return chosen, (logprobs > chosen[:, None]).sum(-1) + 1, best.indices, best.values


class RecordLogprobs:
    """`SamplingParams.logprobs` on a mask model: each generated token's log-probability in the forward that
    committed it, under that forward's raw distribution (the model's logits before `min_tokens`, a structure's
    mask or temperature; with `cfg_scale`, the guided logits the rule scores), with its rank and `top` most
    likely alternatives. A processor that edits nothing, given first: each forward it keeps the rows of the
    still-masked positions; the positions that hold a token at the next forward (or when asked,
    `token_logprobs`) were committed from them. `canvas(state)`: the decoder's canvas `[1, P + L]`."""

    def __init__(self, canvas: Any, mask_id: int, top: int) -> None:
        self.canvas, self.mask_id, self.top = canvas, mask_id, top
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(state): masked positions, their rows
        self.recorded: dict[int, dict[int, tuple]] = {}                     # id(state): position → entry

    def __call__(self, state: Any, logits: torch.Tensor, fed: int) -> torch.Tensor:
        self.resolve(state)
        x = self.canvas(state)[0]
        window = torch.arange(fed, fed + logits.shape[1], device=x.device)
        masked = window[x[window] == self.mask_id]
        self.pending[id(state)] = (masked, full_logits(logits)[0, masked - fed])
        return logits

    def resolve(self, state: Any) -> None:
        """Record the positions committed since the last forward (from that forward's rows)."""
        if id(state) not in self.pending:
            return
        masked, rows = self.pending.pop(id(state))
        tokens = self.canvas(state)[0, masked]
        done = tokens != self.mask_id
        chosen, ranks, ids, values = logprob_entries(rows[done], tokens[done], self.top)
        entries = zip(masked[done].tolist(), tokens[done].tolist(), chosen.tolist(), ranks.tolist(), ids.tolist(),
                      values.tolist())
        self.recorded.setdefault(id(state), {}).update(
            (position, (token, logprob, rank, list(zip(alt_ids, alt_logprobs))))
            for position, token, logprob, rank, alt_ids, alt_logprobs in entries)

    def token_logprobs(self, state: Any, start: int, count: int) -> list[tuple]:
        """The entries `(id, log-probability, rank, [(id, log-probability) of the most likely])` of positions
        `start`, …, `start + count - 1` (`ARDecoder.token_logprobs`' shape), up to the first position no forward
        committed (a loop's fill after the answer's end, e.g. `early_stop`'s EOS run)."""
        self.resolve(state)
        recorded = self.recorded.get(id(state), {})
        return list(itertools.takewhile(bool, (recorded.get(p) for p in range(start, start + count))))

    def forget(self, state: Any) -> None:
        """Drop what was kept for `state` (its sequence finished): a later state may reuse its `id`."""
        self.pending.pop(id(state), None)
        self.recorded.pop(id(state), None)
