"""The structured-output part of a masked-diffusion commit (`remask/structured.py` holds the matcher): one
`CommitFilter` per decoding state, one `Matcher` per row.

A row's matcher sits at its *frontier* `f = answer_start + matcher.position`: every answer position before f is
committed and consumed, f is undecided. Around a decoder's own rule (any: LLaDA's schedule, Fast-dLLM's threshold,
dInfer's, ...) a step is:

1. `mask_frontier`: a copy of f's logits gets the matcher's mask, so what the rule commits at f is valid (a shared
   forward's logits are never written).
2. The rule selects and commits as it always does.
3. `filter`: a clone of the matcher walks the window from f to its last commit, filling each hole with the model's
   best valid token (the rule's candidate if accepted, else the masked argmax: the lookahead) and remasking each
   commit it refuses (an earlier step's too). The real matcher then advances over the committed run from f. A row
   whose window did not fill further gets its frontier committed, so every window fills and every answer ends.
4. End tokens are allowed only where the structure is complete; once one is consumed, the rest of the answer is
   that token (the families' convention) and the row is `finished`.

So the final answer is a valid prefix, complete with an end token. A decoder keeps stepping while its window has
holes (LLaDA's block rule adds one-token steps). A decoder's own revocations (WINO's, any rule rewriting a consumed
position) roll the matcher back to the first changed position (`before` vs the window); the walk re-validates from
there. Callers: LLaDA's, Dream's, dInfer's, WINO's, FreeDave's (`clone_rows`), dKV's, d2Cache's (`mask_at`), Elastic's.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from remask.models.parallel import full_logits


class CommitFilter:
    """Structured output for one decoding state of `len(matchers)` rows, answers at `[answer_start, +answer_len)`."""

    def __init__(self, matchers: Sequence[Any], mask_id: int, answer_start: int, answer_len: int) -> None:
        self.matchers = list(matchers)
        self.mask_id, self.answer_start, self.answer_len = int(mask_id), int(answer_start), int(answer_len)
        self.rolled_back = 0   # matcher rollbacks (the decoder revoked a consumed position)

    @classmethod
    def start(cls, structure: Any, end_ids: Sequence[int], batch: int, mask_id: int, answer_start: int,
              answer_len: int) -> "CommitFilter | None":
        """A filter of `batch` fresh matchers of `structure` (a `CompiledStructure`), None without one."""
        if structure is None:
            return None
        end_ids = end_ids_or_refuse([i for i in end_ids if 0 <= int(i) < structure.vocab_size],   # ids the model has
                                    "the model spec has no eos_id; pass eos_id")
        return cls([structure.matcher(end_ids) for _ in range(batch)], mask_id, answer_start, answer_len)

    def rows(self, index: Sequence[int]) -> "CommitFilter":
        """A filter over the rows `index` of this one, sharing their matchers (a decoder stepping some rows)."""
        return CommitFilter([self.matchers[i] for i in index], self.mask_id, self.answer_start, self.answer_len)

    def clone_rows(self, index: Sequence[int]) -> "CommitFilter":
        """A filter over clones of the matchers of rows `index` (repeats allowed): FreeDave's drafts."""
        return CommitFilter([self.matchers[i].clone() for i in index], self.mask_id, self.answer_start, self.answer_len)

    def sync(self, x: torch.Tensor) -> None:
        """Advance each row's matcher over the committed run of `x` from its frontier (a canvas adopted whole)."""
        for b, matcher in enumerate(self.matchers):
            if matcher.ended:
                continue
            for token in x[b, self.frontier(b):self.answer_start + self.answer_len].tolist():
                if token == self.mask_id or not matcher.try_advance(token):
                    break
            if matcher.ended:
                self._fill_end(x, b)

    def _fill_end(self, x: torch.Tensor, b: int) -> None:
        """Row b's matcher consumed an end token: the rest of its answer is that token (EOS padding)."""
        at = self.answer_start + self.matchers[b]._ended_at
        x[b, at:self.answer_start + self.answer_len] = int(x[b, at])
        self.matchers[b].position = self.answer_len

    def unsettled(self, x: torch.Tensor, start: int, end: int) -> list[bool]:
        """Per row: whether `x[:, start:end]` still needs steps (a hole, or unconsumed commits)."""
        last = min(end, self.answer_start + self.answer_len)
        return [not m.ended and self.frontier(b) < last
                and (start <= self.frontier(b) or bool((x[b, start:end] == self.mask_id).any()))
                for b, m in enumerate(self.matchers)]

    def frontier(self, row: int) -> int:
        """The canvas position of row `row`'s first undecided answer position."""
        return self.answer_start + self.matchers[row].position

    @property
    def finished(self) -> list[bool]:
        return [m.ended or m.position >= self.answer_len for m in self.matchers]

    def mask_frontier(self, logits: torch.Tensor, start: int, end: int, local: int) -> torch.Tensor:
        """`logits` `[B, L, V]` (row `local + p - start`: canvas position p of the window `[start, end)`) with each
        row's frontier in the window masked to what its structure allows (a copy)."""
        frontiers = [(b, self.frontier(b)) for b, m in enumerate(self.matchers) if not m.ended]
        return self._masked(logits, [(b, local + f - start) for b, f in frontiers if start <= f < end])

    def mask_at(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`mask_frontier` for `logits` `[B, n, V]` of the positions `positions` `[B, n]` (a partial forward)."""
        at = positions.tolist()
        frontiers = [(b, self.frontier(b)) for b, m in enumerate(self.matchers) if not m.ended]
        return self._masked(logits, [(b, at[b].index(f)) for b, f in frontiers if f in at[b]])

    def _masked(self, logits: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
        """`logits` with `logits[b, r]` masked by row b's matcher for each (b, r) in `rows` (a copy if any)."""
        if not rows:
            return logits
        logits = full_logits(logits).clone()
        for b, r in rows:
            logits[b, r] = self.matchers[b].mask_logits(logits[b, r])
        return logits

    def _best(self, matcher: Any, logits_row: torch.Tensor, candidate: int | None) -> int:
        """The lookahead's token at a hole (consumed): the rule's candidate if accepted, else the best allowed id."""
        if candidate is not None and candidate != self.mask_id and matcher.try_advance(candidate):
            return candidate
        return advance_best(matcher, logits_row.float(), fallback=True)

    def filter(self, x: torch.Tensor, before: torch.Tensor, x0: torch.Tensor, logits: torch.Tensor,
               start: int, end: int, local: int) -> list[int]:
        """After the rule committed into `x[:, start:end]` (`before`: the window before it, `x0`: its candidates
        `[B, end - start]`, `logits` as in `mask_frontier`): take back what the structure refuses, advance the
        matchers, finish ended rows. Returns each row's net new commits."""
        mask_id, answer_end = self.mask_id, self.answer_start + self.answer_len
        whole = functools.cache(lambda: full_logits(logits))   # on first use (a tensor-parallel DTensor gathered once)
        window = x[:, start:end]
        gained: list[int] = []
        rows = zip(self.matchers, window.tolist(), before.tolist(), x0.tolist())
        for b, (matcher, row, prior, cand) in enumerate(rows):
            f = self.frontier(b)
            # the decoder's own revocations: a consumed position it remasked or rewrote rolls the
            # matcher back to it (the walk below re-validates what follows)
            lo, hi = max(start, self.answer_start), min(end, f)
            moved = next((i for i in range(lo - start, hi - start) if row[i] != prior[i]), None)
            if moved is not None:
                was_ended = matcher.ended
                matcher.rollback(matcher.position - (start + moved - self.answer_start))
                self.rolled_back += 1
                if was_ended and not matcher.ended and end < answer_end:
                    x[b, end:answer_end] = mask_id   # the end fill after the window is undecided again
                f = self.frontier(b)
            if matcher.ended:   # the end fill again, whatever the decoder wrote there
                self._fill_end(x, b)
                gained.append(sum(t != mask_id and p == mask_id for t, p in zip(x[b, start:end].tolist(), prior)))
                continue
            if start <= f < end:
                committed = [i for i in range(f - start, end - start) if row[i] != mask_id]
                if committed:
                    clone = matcher.clone()
                    for i in range(f - start, committed[-1] + 1):
                        if row[i] != mask_id:
                            if clone.try_advance(row[i]):
                                continue
                            row[i] = mask_id
                        if i < committed[-1]:
                            self._best(clone, whole()[b, local + i], cand[i])
                if row.count(mask_id) >= prior.count(mask_id) and row[f - start] == mask_id:
                    # progress: a step that did not fill more of the window commits the frontier (the
                    # rule's candidate there was scored from masked logits; else the best allowed id),
                    # the same token the lookahead gave it, so the tail it validated stays valid
                    row[f - start] = self._best(matcher.clone(), whole()[b, local + f - start], cand[f - start])
                # the real matcher over the contiguous committed run from the frontier
                i = f - start
                while i < end - start and row[i] != mask_id:
                    if not matcher.try_advance(row[i]):
                        # a later commit the lookahead accepted only with other fills: revoke the rest
                        row[i:] = [mask_id] * (len(row) - i)
                        break
                    i += 1
                window[b] = torch.tensor(row, dtype=window.dtype, device=window.device)   # as walked
            gained.append(sum(t != mask_id and p == mask_id for t, p in zip(row, prior)))
            if matcher.ended:
                self._fill_end(x, b)
        return gained


def before_rule(constraint: CommitFilter | None, logits: torch.Tensor, window: torch.Tensor, start: int, end: int,
                local: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Before a rule commits into `window` (`x[:, start:end]`): the logits with each row's frontier masked
    (`CommitFilter.mask_frontier`), and the window as it was for `filter`; (logits, None) without a structure."""
    if constraint is None:
        return logits, None
    return constraint.mask_frontier(logits, start, end, local), window.clone()


def advance_best(matcher: Any, logits_row: torch.Tensor, limit: int | None = None, *, fallback: bool = False) -> int:
    """Advance `matcher` by the best id of `logits_row` `[V]` (below `limit`) it allows, and return that id.
    `fallback`: where the row allows none (it was masked for another path, a frontier since rolled back), the first
    allowed id."""
    masked = matcher.mask_logits(logits_row)[:limit]
    if fallback and bool(torch.isinf(masked.max())):
        token = int(matcher.allowed().nonzero()[0])
    else:
        token = int(masked.argmax())
    ok = matcher.try_advance(token)
    assert ok, "structured output: the allowed mask and the matcher disagree"
    return token


def end_ids_or_refuse(end_ids: Any, what: str) -> list[int]:
    """The sorted end ids of `end_ids` (one id, a sequence, or None); refused when there is none (`what`: why)."""
    ids = sorted({int(i) for i in ([end_ids] if isinstance(end_ids, int) else end_ids or []) if i is not None})
    if not ids:
        raise ValueError(f"structured_outputs needs an end token: {what}")
    return ids


def end_ids_of(spec: Any, extra: Sequence[int] = ()) -> list[int]:
    """The ids that end a structured answer: `extra` (the engine's stop ids) or the spec's EOS / EOT."""
    return sorted({int(i) for i in extra} or {int(i) for i in (spec.eos_id, spec.eot_id) if i is not None})
