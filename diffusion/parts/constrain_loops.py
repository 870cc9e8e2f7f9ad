"""Structured output in the decoders that are not LLaDA's block rule: the block-causal families'
loops (SDAR, LLaDA2 with 2.1's edits, Fast-dLLM v2, their FreeDave and dInfer rules), APD and
DiffusionGemma's canvases. `parts/constrain.py` holds the commit filter they reuse; these are the
loops' own calls around it (each decoder's `constrain(structure, end_ids)` turns it on).

* **Block-causal loops**: one `CommitFilter` (one matcher) over the canvas from the prompt's end;
  the block being denoised is its window. Before the loop's rule scores a step's logits, the
  frontier's row is masked (`mask_frontier_rows`, every row of a FreeDave draft batch); after
  the rule (or a FreeDave round) wrote the block, `filter_block` keeps what a clone of the matcher
  accepts, revokes the rest and advances the matcher. A block is finished only when it has no
  hole: then the matcher has consumed it. Tokens a loop picks autoregressively (Fast-dLLM v2's
  first token of a block) are the argmax of the masked logits (`next_token`). LLaDA2.1's edits of
  tokens the matcher consumed: `keep_valid_edits` rolls the matcher back to the first edit and keeps
  each edit only if the committed prefix stays valid with it (else the token stays as it was).
* **APD** (`draft_under`): each draft is the argmax of the draft scores masked by a clone that
  walked the drafts before it, so every draft continues the structure; the accepted run is cut at
  the first token the matcher refuses (none, by construction) and the matcher advances over it.
* **Canvases** (`constrain_canvas`): checked at commit — the committed canvas is walked by a clone,
  the positions from the first one it refuses are renoised; and the canvas's output (its argmax)
  is the model's argmax where the structure accepts it, from the first refusal on the argmax of
  the masked logits (the lookahead fill): so a canvas closed at any step is valid.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from remask.models.parallel import full_logits

from .constrain import CommitFilter


def compile_for(structured_outputs: Any, model: Any, tokenizer: Any, mask_id: int | None) -> Any:
    """A drop-in call's `structured_outputs` compiled against `tokenizer` (default: the one saved
    beside the model); None without one."""
    if structured_outputs is None:
        return None
    from remask.structured import StructuredOutputsParams, compile_structure, model_vocab_size, tokenizer_for

    params = StructuredOutputsParams.from_json(structured_outputs)
    return compile_structure(params, tokenizer_for(model, tokenizer), model_vocab_size(model),
                             () if mask_id is None else (int(mask_id),))


def end_ids_or_refuse(end_ids: Sequence[int], what: str) -> list[int]:
    ids = sorted({int(i) for i in end_ids if i is not None})
    if not ids:
        raise ValueError(f"structured_outputs needs an end token: {what}")
    return ids


def block_filter(structure: Any, end_ids: Sequence[int], mask_id: int, prompt_length: int,
                 answer_len: int) -> CommitFilter:
    """The one-row commit filter of a block-causal loop's state."""
    return CommitFilter([structure.matcher(end_ids)], mask_id, prompt_length, answer_len)


def mask_frontier_rows(constraint: CommitFilter, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """`logits` `[K, L, V]` of K versions of the window `[start, end)` (row r: position start + r),
    the frontier's row of every version masked to what the structure allows (a copy)."""
    matcher = constraint.matchers[0]
    f = constraint.frontier(0)
    if matcher.ended or not start <= f < end or f - start >= logits.shape[1]:
        return logits
    logits = full_logits(logits).clone()
    logits[:, f - start] = matcher.mask_logits(logits[:, f - start])
    return logits


def filter_block(constraint: CommitFilter, x: torch.Tensor, prior: torch.Tensor, x0: torch.Tensor | None,
                 logits: torch.Tensor, start: int, end: int) -> int:
    """`CommitFilter.filter` over the window `[start, end)` of `x` `[1, T]` (`prior`: the window
    before the step, `logits` `[1, end - start, V]`, `x0` the rule's candidates or None: the
    argmax). Returns the net new commits."""
    logits = full_logits(logits)
    if x0 is None:
        x0 = logits.argmax(dim=-1)
    return constraint.filter(x, prior, x0[:, :end - start], logits, start, end, 0)[0]


def next_token(constraint: CommitFilter, logits_row: torch.Tensor) -> int:
    """A token a loop picks by argmax (`logits_row` `[V]`), at the frontier: the best the structure
    allows there; the matcher consumes it."""
    matcher = constraint.matchers[0]
    token = int(matcher.mask_logits(full_logits(logits_row).float()).argmax())
    ok = matcher.try_advance(token)
    assert ok, "structured output: the allowed mask and the matcher disagree"
    return token


def keep_valid_edits(constraint: CommitFilter, x: torch.Tensor, prior: torch.Tensor, start: int, end: int) -> int:
    """LLaDA2.1's token edits of positions the matcher already consumed (`[start, frontier)`): each
    edit, left to right, is kept only if the matcher rolled back to the first edit accepts the
    committed run up to the frontier with it; a refused one is undone (the token it replaced comes
    back). The matcher is then rolled back and advanced over the run as kept. Returns the edits
    undone. (Edits beyond the frontier are commits like any other: `filter_block` judges them.)"""
    matcher = constraint.matchers[0]
    f = constraint.frontier(0)
    hi = min(f, end)
    if hi <= start:
        return 0
    if matcher.ended:   # the answer is complete: nothing in it changes
        undone = int((x[0, start:hi] != prior[0, :hi - start]).sum())
        x[0, start:hi] = prior[0, :hi - start]
        return undone
    now, old = x[0, start:hi].tolist(), prior[0, :hi - start].tolist()
    edits = [i for i in range(hi - start) if now[i] != old[i]]
    if not edits:
        return 0
    first = edits[0]
    base = matcher.clone()
    base.rollback(hi - start - first)
    kept = list(old)
    undone = 0
    for i in edits:
        trial = list(kept)
        trial[i] = now[i]
        if base.accepts(trial[first:]) == hi - start - first:
            kept = trial
        else:
            undone += 1
    x[0, start:hi] = torch.tensor(kept, dtype=x.dtype, device=x.device)
    if kept != old:
        matcher.rollback(hi - start - first)
        matcher.advance(kept[first:])
        prior[0, :hi - start] = x[0, start:hi]   # settled: the filter sees no change to roll back
    return undone


def draft_under(matcher: Any, scores: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """APD's drafts under a structure: position j's draft is the argmax of `scores[j]` (`[N, V]`,
    the draft rule's scores: larger is drawn) over the ids a clone of `matcher` allows after the
    drafts before j (ids at or beyond `limit` never). Returns `[N]`."""
    clone = matcher.clone()
    scores = full_logits(scores)
    out = []
    for j in range(scores.shape[0]):
        row = clone.mask_logits(scores[j])
        if limit is not None and limit < row.shape[-1]:
            row = row[:limit]
        token = int(row.argmax())
        ok = clone.try_advance(token)
        assert ok, "structured output: the allowed mask and the matcher disagree"
        out.append(token)
    return torch.tensor(out, dtype=torch.long, device=scores.device)


def constrain_canvas(matchers: Sequence[Any], canvas: torch.Tensor, argmax: torch.Tensor, logits: torch.Tensor,
                     noise: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """DiffusionGemma under a structure, per row b (`matchers[b]`: its answer so far, the canvases
    closed before): the committed `canvas` `[B, L]` is checked by a clone — from the first position
    it refuses on, the canvas takes `noise` (renoised); the `argmax` canvas keeps the model's argmax
    while the clone accepts it, and from its first refusal on each position is the argmax of
    `logits` `[B, L, V]` masked to what the clone allows there. `rows`: the rows to treat (None:
    all). Returns (canvas, argmax, positions renoised)."""
    canvas, argmax = canvas.clone(), argmax.clone()
    logits = full_logits(logits)
    renoised = 0
    for b, matcher in enumerate(matchers):
        if matcher is None or (rows is not None and not bool(rows[b])):
            continue
        row = canvas[b].tolist()
        n = matcher.accepts(row)
        if n < len(row):
            canvas[b, n:] = noise[b, n:]
            renoised += len(row) - n
        best = argmax[b].tolist()
        n = matcher.accepts(best)
        if n < len(best):
            clone = matcher.clone()
            clone.advance(best[:n])
            for j in range(n, len(best)):
                token = int(clone.mask_logits(logits[b, j].float()).argmax())
                ok = clone.try_advance(token)
                assert ok, "structured output: the allowed mask and the matcher disagree"
                best[j] = token
            argmax[b] = torch.tensor(best, dtype=argmax.dtype, device=argmax.device)
    return canvas, argmax, renoised
