"""The structured-output part of a masked-diffusion commit (`remask/structured.py` holds the
matcher): one `CommitFilter` per decoding state, one `Matcher` per row.

A row's answer is the canvas from `answer_start` on. The matcher sits at the row's *frontier*
`f = answer_start + matcher.position`: every position before f is committed and was consumed by
the matcher; f itself is undecided. Around a decoder's own rule (any rule: LLaDA's schedule,
Fast-dLLM's threshold / factor, dInfer's, ...) a step is:

1. `mask_frontier(logits, ...)`: f's logits get the matcher's mask before the rule scores them, so
   whatever the rule commits at f is valid (a copy: a shared forward's logits are never written).
2. The rule selects and commits as it always does.
3. `filter(...)`: a clone of the matcher walks the window from f to its last committed position;
   a hole is filled with the model's own best valid token at that position (the rule's candidate
   `x0` if the clone accepts it, else the argmax of the clone-masked logits: the lookahead), and a
   committed token the clone does not accept is taken back (set to the mask again — a commit
   beyond f is kept only if the lookahead fill up to it accepts it; a commit of an earlier step
   whose lookahead no longer holds is revoked the same way). Then the real matcher advances over
   the contiguous committed run from f. A row whose window did not fill further this step gets its
   frontier committed (the rule's masked candidate there): with the frontier fixed the filled count
   grows every step, so every window fills and every answer ends.
4. End tokens are allowed only where the structure is complete (`Matcher.allowed`); once a row's
   matcher consumed an end token, the rest of its answer is that end token (the families'
   convention) and the row is `finished`.

So every token in the canvas has been accepted on a full path from the answer's start, and the
final answer (no holes left) is consumed by the matcher token by token: it is a valid prefix,
complete when it holds an end token. A decoder calling this must keep stepping while its window
has holes (the filter may leave more than the rule's schedule planned), e.g. LLaDA's block rule
runs extra one-token steps after its schedule.

Revocations of the decoder's own (WINO's narrow-out, any rule that remasks or rewrites a position
the matcher already consumed): `filter` compares the window with `before`; at the first consumed
position that changed, the matcher rolls back to it (`Matcher.rollback`), and the walk above
re-validates everything from there. A row whose matcher had ended and rolls back before its end
token gets the end fill after the window undone (those positions are undecided again); a row still
ended gets its end fill written again (whatever the decoder put after the end token).

Any decoder that writes a canvas from logits of the positions it decodes can call it, in the same
three calls (mask, its rule, filter): LLaDA's `BlockDecoder.commit`, Dream's `DreamDecoder` (the
whole answer is the window) and `DreamBlockDecoder` (the block), dInfer's rules (`_Decoder.decode`),
WINO (its revocations roll the matcher back), FreeDave (its step function, applied to drafts
with cloned filters: `clone_rows`), and the cache methods: dKV-Cache (Decode, Greedy, Dream's: the
latter through `DreamDecoder`) and d2Cache, whose forwards cover some positions only (`mask_at`
masks the frontier among them; each keeps the frontier's scorer forwarded), and Elastic-Cache (the
window from the frontier, its own rule or a commit rule). `structure_for_call` is the drop-in functions' one entry
(the checks of `remask/structured.py`, as `SamplingParams` runs them).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from remask.models.parallel import full_logits


class CommitFilter:
    """Structured output for one decoding state of `len(matchers)` rows (see the module
    docstring). `mask_id`: the canvas's undecided id; the answer of every row spans canvas
    positions `[answer_start, answer_start + answer_len)`."""

    def __init__(self, matchers: Sequence[Any], mask_id: int, answer_start: int, answer_len: int) -> None:
        self.matchers = list(matchers)
        self.mask_id, self.answer_start, self.answer_len = int(mask_id), int(answer_start), int(answer_len)
        self.revoked = 0          # commits taken back (a beyond-frontier token the lookahead stopped accepting)
        self.rejected = 0         # commits refused in the step that made them
        self.forced = 0           # frontier commits made for progress
        self.rolled_back = 0      # matcher rollbacks (the decoder revoked a consumed position)

    @classmethod
    def start(cls, structure: Any, end_ids: Sequence[int], batch: int, mask_id: int, answer_start: int,
              answer_len: int) -> "CommitFilter | None":
        """A filter of `batch` fresh matchers of `structure` (a `CompiledStructure`), None without one."""
        if structure is None:
            return None
        end_ids = [int(i) for i in end_ids if 0 <= int(i) < structure.vocab_size]   # ids the model has
        if not end_ids:
            raise ValueError("structured_outputs needs an end token: the model spec has no eos_id; pass eos_id")
        return cls([structure.matcher(end_ids) for _ in range(batch)], mask_id, answer_start, answer_len)

    def rows(self, index: Sequence[int]) -> "CommitFilter":
        """A filter over the rows `index` of this one, sharing their matchers (a decoder that steps a
        subset of its rows: the same matchers advance)."""
        return CommitFilter([self.matchers[i] for i in index], self.mask_id, self.answer_start, self.answer_len)

    def clone_rows(self, index: Sequence[int]) -> "CommitFilter":
        """A filter over clones of the matchers of rows `index` (repeats allowed): a lookahead that
        leaves this filter unchanged (FreeDave's drafts)."""
        return CommitFilter([self.matchers[i].clone() for i in index], self.mask_id, self.answer_start,
                            self.answer_len)

    def sync(self, x: torch.Tensor) -> None:
        """Advance each row's matcher over the contiguous committed run of `x` `[B, T]` from its
        frontier, as far as it accepts (a canvas a decoder adopted whole, e.g. an accepted draft)."""
        for b, matcher in enumerate(self.matchers):
            if matcher.ended:
                continue
            row = x[b, self.frontier(b):self.answer_start + self.answer_len].tolist()
            for token in row:
                if token == self.mask_id or not matcher.try_advance(token):
                    break
            if matcher.ended:   # complete: the rest is its end token
                at = self.answer_start + matcher._ended_at
                x[b, at:self.answer_start + self.answer_len] = int(x[b, at])
                matcher.position = self.answer_len

    def unsettled(self, x: torch.Tensor, start: int, end: int) -> list[bool]:
        """Per row: whether `x[:, start:end]` still needs steps — a hole, or (never after `filter`)
        committed tokens the matcher has not consumed."""
        out = []
        for b, matcher in enumerate(self.matchers):
            f = self.frontier(b)
            out.append(not matcher.ended and f < min(end, self.answer_start + self.answer_len)
                       and (start <= f or bool((x[b, start:end] == self.mask_id).any())))
        return out

    def frontier(self, row: int) -> int:
        """The canvas position of row `row`'s first undecided answer position."""
        return self.answer_start + self.matchers[row].position

    @property
    def finished(self) -> list[bool]:
        return [m.ended or m.position >= self.answer_len for m in self.matchers]

    def mask_frontier(self, logits: torch.Tensor, start: int, end: int, local: int) -> torch.Tensor:
        """`logits` `[B, L, V]` whose row `local + (p - start)` holds canvas position p of the window
        `[start, end)`: a copy with each row's frontier (if in the window) masked to the ids its
        structure allows; `logits` itself if no frontier is in the window."""
        rows = [(b, self.frontier(b)) for b, m in enumerate(self.matchers) if not m.ended]
        rows = [(b, f) for b, f in rows if start <= f < end]
        if not rows:
            return logits
        logits = full_logits(logits).clone()
        for b, f in rows:
            r = local + f - start
            logits[b, r] = self.matchers[b].mask_logits(logits[b, r])
        return logits

    def mask_at(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`logits` `[B, n, V]` of the canvas positions `positions` `[B, n]` (a cache's forward of some
        positions only: dKV-Cache's, d2Cache's): a copy with each row's frontier, where it was
        forwarded, masked as `mask_frontier` masks it; `logits` itself if no row's was."""
        at = positions.tolist()
        rows = []
        for b, matcher in enumerate(self.matchers):
            f = self.frontier(b)
            if not matcher.ended and f in at[b]:
                rows.append((b, at[b].index(f)))
        if not rows:
            return logits
        logits = full_logits(logits).clone()
        for b, r in rows:
            logits[b, r] = self.matchers[b].mask_logits(logits[b, r])
        return logits

    def _best(self, matcher: Any, logits_row: torch.Tensor, candidate: int | None) -> int:
        """The lookahead's token at a hole: the rule's candidate if the matcher accepts it, else the
        best allowed id by the logits. The matcher advances over it."""
        if candidate is not None and candidate != self.mask_id and matcher.try_advance(candidate):
            return candidate
        masked = matcher.mask_logits(logits_row.float())
        if bool(torch.isinf(masked.max())):
            # the row's logits were masked for another path (a frontier since rolled back): the
            # first allowed id
            token = int(matcher.allowed().nonzero()[0])
        else:
            token = int(masked.argmax())
        ok = matcher.try_advance(token)
        assert ok, "structured output: the allowed mask and the matcher disagree"
        return token

    def filter(self, x: torch.Tensor, before: torch.Tensor, x0: torch.Tensor, logits: torch.Tensor,
               start: int, end: int, local: int) -> list[int]:
        """After the rule committed into `x[:, start:end]` (`before`: that window before the rule,
        `x0`: the rule's candidates `[B, end - start]`, `logits` as in `mask_frontier`, after it):
        take back what the structure does not accept, advance the matchers, finish ended rows.
        Returns each row's net new commits."""
        mask_id = self.mask_id
        logits = _Rows(logits)   # whole rows on first use (a tensor-parallel DTensor is gathered once)
        window = x[:, start:end]
        now_rows, before_rows, cand_rows = window.tolist(), before.tolist(), x0.tolist()
        answer_end = self.answer_start + self.answer_len
        gained: list[int] = []
        for b, matcher in enumerate(self.matchers):
            row, prior, cand = now_rows[b], before_rows[b], cand_rows[b]
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
            if matcher.ended:
                # the answer is complete: the rest is its end token, whatever the decoder wrote there
                at = self.answer_start + matcher._ended_at
                x[b, at:answer_end] = int(x[b, at])
                matcher.position = self.answer_len
                gained.append(sum(1 for i, t in enumerate(x[b, start:end].tolist())
                                  if t != mask_id and prior[i] == mask_id))
                continue
            changed = False
            if start <= f < end:
                committed = [i for i in range(f - start, end - start) if row[i] != mask_id]
                if committed:
                    clone = matcher.clone()
                    for i in range(f - start, committed[-1] + 1):
                        token = row[i]
                        if token != mask_id:
                            if clone.try_advance(token):
                                continue
                            row[i] = mask_id
                            changed = True
                            if prior[i] == mask_id:
                                self.rejected += 1
                            else:
                                self.revoked += 1
                        if i < committed[-1]:
                            self._best(clone, logits[b, local + i], cand[i])
                filled = sum(1 for t in row if t != mask_id)
                if filled <= sum(1 for t in prior if t != mask_id) and row[f - start] == mask_id:
                    # progress: a step that did not fill more of the window commits the frontier (the
                    # rule's candidate there was scored from masked logits; else the best allowed id),
                    # the same token the lookahead gave it, so the tail it validated stays valid
                    probe = matcher.clone()
                    row[f - start] = self._best(probe, logits[b, local + f - start], cand[f - start])
                    self.forced += 1
                    changed = True
                # the real matcher over the contiguous committed run from the frontier
                i = f - start
                while i < end - start and row[i] != mask_id:
                    ok = matcher.try_advance(row[i])
                    if not ok:   # a later commit the lookahead accepted only with other fills: revoke the rest
                        for j in range(i, end - start):
                            if row[j] != mask_id:
                                row[j] = mask_id
                                self.revoked += 1
                        changed = True
                        break
                    i += 1
                if changed:
                    window[b] = torch.tensor(row, dtype=window.dtype, device=window.device)
            gained.append(sum(1 for i in range(end - start) if row[i] != mask_id and prior[i] == mask_id))
            if matcher.ended:
                # the answer is complete: the rest is its end token (each family's EOS padding)
                at = self.answer_start + matcher._ended_at
                fill = int(x[b, at])
                x[b, at:answer_end] = fill
                matcher.position = self.answer_len
        return gained


class _Rows:
    """`logits[b, r]` of a step's logits as whole-vocabulary rows, gathered on first use."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.full = logits, None

    def __getitem__(self, index: tuple[int, int]) -> torch.Tensor:
        if self.full is None:
            self.full = full_logits(self.logits)
        return self.full[index]


def structure_for_call(structured_outputs: Any, model: torch.nn.Module, tokenizer: Any, mask_id: int | None,
                       max_tokens: int) -> Any:
    """A drop-in call's `structured_outputs` (a `StructuredOutputsParams` or its JSON form) compiled
    against the model's tokenizer, its budget checked — the checks `SamplingParams` and the engine
    run (`remask/structured.py`); None without one."""
    if structured_outputs is None:
        return None
    from remask.structured import StructuredOutputsParams, compile_structure, model_vocab_size, tokenizer_for

    params = StructuredOutputsParams.from_json(structured_outputs)
    structure = compile_structure(params, tokenizer_for(model, tokenizer), model_vocab_size(model),
                                  () if mask_id is None else (mask_id,))
    structure.check_budget(max_tokens)
    return structure


def end_ids_of(spec: Any, extra: Sequence[int] = ()) -> list[int]:
    """The ids that end a structured answer: `extra` (the engine's stop ids) or the spec's EOS / EOT."""
    return sorted({int(i) for i in extra} or {int(i) for i in (spec.eos_id, spec.eot_id) if i is not None})
