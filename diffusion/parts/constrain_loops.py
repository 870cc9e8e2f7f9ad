"""Structured output in the decoders other than LLaDA's block rule (each decoder's `constrain(structure, end_ids)`
turns it on): the calls around `parts/constrain.py`'s commit filter of the block-causal loops (SDAR, LLaDA2 with
2.1's edits, Fast-dLLM v2, their FreeDave and dInfer rules: one matcher over the canvas from the prompt's end, the
block being denoised its window; a block is finished only with no hole), APD's drafts and DiffusionGemma's canvases.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from remask.models.parallel import full_logits

from .constrain import CommitFilter, advance_best, end_ids_or_refuse


def compile_for(structured_outputs: Any, model: Any, tokenizer: Any, mask_id: int | None) -> Any:
    """`structured_outputs` (params or JSON) compiled against `tokenizer` (default: the model's); None without one."""
    if structured_outputs is None:
        return None
    from remask.structured import StructuredOutputsParams, compile_structure, model_vocab_size, tokenizer_for

    params = StructuredOutputsParams.from_json(structured_outputs)
    return compile_structure(params, tokenizer_for(model, tokenizer), model_vocab_size(model),
                             () if mask_id is None else (int(mask_id),))


def structure_for_call(structured_outputs: Any, model: Any, tokenizer: Any, mask_id: int | None,
                       max_tokens: int) -> Any:
    """The drop-in functions' one entry: `compile_for` and the budget check (as `SamplingParams`); None without one."""
    structure = compile_for(structured_outputs, model, tokenizer, mask_id)
    if structure is not None:
        structure.check_budget(max_tokens)
    return structure


class Constrainable:
    """A decoder's structured output, shared by the block loops, APD and the canvas loop: `constrain` sets the
    compiled structure and the ids that end an answer (allowed only where it is complete)."""

    structure: Any = None   # a `remask.structured.CompiledStructure`, or None
    end_ids: tuple = ()

    def _default_end_ids(self) -> tuple[Any, str]:
        """(the end ids when `constrain` is given none, why a decoder without any has none)."""
        raise NotImplementedError

    def constrain(self, structure: Any, end_ids: Any = None) -> Any:
        """Hold the answers to `structure` (None: off); `end_ids` (default: the decoder's, `_default_end_ids`) end
        an answer where it is complete. Returns the decoder."""
        self.structure = structure
        if structure is not None:
            default, missing = self._default_end_ids()
            self.end_ids = tuple(end_ids_or_refuse(default if end_ids is None else end_ids, missing))
        return self


def filter_block(constraint: CommitFilter, x: torch.Tensor, prior: torch.Tensor, x0: torch.Tensor | None,
                 logits: torch.Tensor, start: int, end: int) -> int:
    """`CommitFilter.filter` over the window `[start, end)` of `x` `[1, T]` (`prior`: the window before the step,
    `logits` `[1, end - start, V]`, `x0`: the candidates, None: the argmax)."""
    logits = full_logits(logits)
    if x0 is None:
        x0 = logits.argmax(dim=-1)
    return constraint.filter(x, prior, x0[:, :end - start], logits, start, end, 0)[0]


def next_token(constraint: CommitFilter, logits_row: torch.Tensor) -> int:
    """The frontier token a loop picks by argmax (`logits_row` `[V]`): the best the structure allows."""
    return advance_best(constraint.matchers[0], full_logits(logits_row).float())


def keep_valid_edits(constraint: CommitFilter, x: torch.Tensor, prior: torch.Tensor, start: int, end: int) -> int:
    """LLaDA2.1's token edits of consumed positions (`[start, frontier)`): each, left to right, is kept only if
    the committed run up to the frontier stays valid with it (else the old token comes back); the matcher is
    re-advanced over the run as kept. Returns the edits undone (edits beyond the frontier: `filter_block`'s)."""
    matcher = constraint.matchers[0]
    hi = min(constraint.frontier(0), end)
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
    first, n = edits[0], hi - start - edits[0]   # n: the consumed positions from the first edit on
    base = matcher.clone()
    base.rollback(n)
    kept = list(old)
    for i in edits:
        trial = kept[:i] + [now[i]] + kept[i + 1:]
        if base.accepts(trial[first:]) == n:
            kept = trial
    undone = sum(kept[i] != now[i] for i in edits)   # the edits refused (an edit kept is never undone later)
    x[0, start:hi] = torch.tensor(kept, dtype=x.dtype, device=x.device)
    if kept != old:
        matcher.rollback(n)
        matcher.advance(kept[first:])
        prior[0, :hi - start] = x[0, start:hi]   # settled: the filter sees no change to roll back
    return undone


def draft_under(matcher: Any, scores: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """APD's drafts `[N]` under a structure: draft j is the argmax of `scores[j]` (`[N, V]`) over the ids (below
    `limit`) a clone of `matcher` allows after the drafts before j."""
    clone, scores = matcher.clone(), full_logits(scores)
    return torch.tensor([advance_best(clone, row, limit) for row in scores], dtype=torch.long, device=scores.device)


def constrain_canvas(matchers: Sequence[Any], canvas: torch.Tensor, argmax: torch.Tensor, logits: torch.Tensor,
                     noise: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """DiffusionGemma under a structure, per row b in `rows` (None: all; `matchers[b]`: its answer so far): the
    committed `canvas` `[B, L]` takes `noise` from the first position a clone refuses on; the `argmax` canvas keeps
    the model's argmax while a clone accepts it, then the argmax of `logits` `[B, L, V]` masked by the clone (the
    lookahead fill). Returns (canvas, argmax, positions renoised)."""
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
            best[n:] = [advance_best(clone, logits[b, j].float()) for j in range(n, len(best))]
            argmax[b] = torch.tensor(best, dtype=argmax.dtype, device=argmax.device)
    return canvas, argmax, renoised


def open_frontiers(constraint: CommitFilter, rows: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """`(row, frontier)` for each of `rows` whose structure has not ended and whose frontier lies before `limit`
    (the rows a cached loop must forward at their frontier: dKV-Cache, d2Cache)."""
    frontiers = [(b, constraint.frontier(b)) for b in rows if not constraint.matchers[b].ended]
    return [(b, f) for b, f in frontiers if f < limit]
