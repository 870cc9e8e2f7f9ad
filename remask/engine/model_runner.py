"""The model runner computes one engine step for the running sequences.

Diffusion sequences whose next forwards have the same `shared_forward_key` share one batched
forward (`forward_shared`): unpadded sequences of one length — full forwards, and the prefix /
dual caches' block-start and block steps at the same block, each sequence's own cache updated as
its own call would (`StackedKVCache`). Their rows are independent in a bidirectional forward, and
with `batch_invariant` each row is computed with the shapes it has alone (`batch_invariant.py`). Autoregressive sequences admitted
in the same step with prompts of the same length decode in lockstep (`ARGroup`): one prefill,
then one forward per step for the group. Every other sequence (CFG, sparse attention, the paged
cache) runs its own forward in the same step. Each sequence commits its own tokens with its own rule
and generator (`BlockDecoder.commit`, `DreamDecoder.commit`, `ARDecoder.sample`): no sampling
rule lives here.

A failure inside one sequence's forward or commit fails that sequence only (`failed`); a failed
shared forward fails the sequences that shared it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from remask.diffusion.ar import ARDecoder
from remask.models.spec import ModelSpec

from .batch_invariant import batch_invariant_linear
from .sequence import Sequence


@dataclass(eq=False)
class ARGroup:
    """Autoregressive sequences decoding in lockstep: admitted in the same step with prompts of
    the same length, so their caches always have the same length and one forward serves them
    all. A member that finishes leaves the group (its rows are dropped from the cache)."""

    members: list[Sequence]
    cache: Any
    logits: torch.Tensor          # [G, V] next-position logits
    mask: torch.Tensor            # [G, positions so far]
    position_ids: torch.Tensor    # [G, 1]

    def keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.members):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.logits.device)
        self.cache.batch_select_indices(index)
        self.members = [self.members[i] for i in rows]
        self.logits, self.mask, self.position_ids = self.logits[index], self.mask[index], self.position_ids[index]


@dataclass(eq=False)
class ARRow:
    """A sequence's own part of its `ARGroup`: its tokens so far, and whether it is done."""

    group: ARGroup
    tokens: list[int] = field(default_factory=list)
    step: int = 0
    done: bool = False


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, batch_invariant: bool = True) -> None:
        self.model, self.spec, self.batch_invariant = model, spec, batch_invariant
        self.device = next(model.parameters()).device
        self.forwards = 0      # model calls, for the benchmark
        self.ar_groups: list[ARGroup] = []

    def _invariant(self, batch: int):
        return batch_invariant_linear(self.batch_invariant and batch > 1, single_thread=self.device.type == "cpu")

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> dict[Sequence, str]:
        """Advance every sequence by one step; returns the failed ones with their error."""
        failed: dict[Sequence, str] = {}
        shared: dict[tuple, list[Sequence]] = defaultdict(list)
        ar_groups = list(self.ar_groups)      # the groups started this step only ran their prompts
        self._start_ar([seq for seq in seqs if seq.state is None and isinstance(seq.decoder, ARDecoder)], failed)
        for group in ar_groups:
            self._ar_step(group, failed)
        for seq in seqs:
            if isinstance(seq.decoder, ARDecoder):
                continue
            try:
                if seq.state is None:
                    seq.stats.start()
                    seq.state = seq.decoder.start(self.model, seq.prompt_ids)
                key = seq.decoder.shared_forward_key(seq.state)
                if key is not None:
                    shared[type(seq.decoder), key].append(seq)
                else:
                    self._own_step(seq)
            except Exception as err:  # noqa: BLE001 - one request's failure must not stop the others
                failed[seq] = f"{type(err).__name__}: {err}"
        for group in shared.values():
            try:
                with self._invariant(len(group)):
                    logits, fed = group[0].decoder.forward_shared(self.model, [seq.state for seq in group])
                self.forwards += 1
            except Exception as err:  # noqa: BLE001
                failed.update({seq: f"{type(err).__name__}: {err}" for seq in group})
                continue
            for i, seq in enumerate(group):
                try:
                    seq.decoder.commit(seq.state, logits[i:i + 1], fed, seq.generator, seq.stats)
                except Exception as err:  # noqa: BLE001
                    failed[seq] = f"{type(err).__name__}: {err}"
        return failed

    def _own_step(self, seq: Sequence) -> None:
        seq.decoder.step(self.model, seq.state, seq.generator, seq.stats)
        self.forwards += 1

    # ---- autoregressive groups: `ARDecoder`'s prefill / sample / decode, one forward per group ----

    def prune(self) -> None:
        """Drop the cache rows of sequences that left their group (aborted between steps)."""
        for group in list(self.ar_groups):
            group.keep([i for i, seq in enumerate(group.members) if seq.state is not None and not seq.state.done])
            if not group.members:
                self.ar_groups.remove(group)

    def _start_ar(self, seqs: list[Sequence], failed: dict[Sequence, str]) -> None:
        by_length: dict[int, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            by_length[seq.prompt_len].append(seq)
        for members in by_length.values():
            try:
                ids = torch.cat([seq.prompt_ids for seq in members])
                with self._invariant(len(members)):
                    cache, logits, position_ids = members[0].decoder.prefill(ids, torch.ones_like(ids))
                self.forwards += 1
            except Exception as err:  # noqa: BLE001
                failed.update({seq: f"{type(err).__name__}: {err}" for seq in members})
                continue
            group = ARGroup(members=members, cache=cache, logits=logits, mask=torch.ones_like(ids),
                            position_ids=position_ids)
            for seq in members:
                seq.stats.start()
                seq.stats.forward(1, seq.prompt_len)
                seq.state = ARRow(group)
            self.ar_groups.append(group)

    def _ar_step(self, group: ARGroup, failed: dict[Sequence, str]) -> None:
        """Each member samples its token with its own settings and generator (what
        `ARDecoder.step` does for one row); the members that go on share the next forward."""
        group.keep([i for i, seq in enumerate(group.members) if seq.state is not None and not seq.state.done])
        tokens = []
        for i, seq in enumerate(group.members):
            try:
                token = int(seq.decoder.sample(group.logits[i:i + 1], seq.generator)[0])
            except Exception as err:  # noqa: BLE001
                failed[seq] = f"{type(err).__name__}: {err}"
                seq.state.done = True
                tokens.append(None)
                continue
            row = seq.state
            row.tokens.append(token)
            row.step += 1
            seq.stats.step(1)
            row.done = token in seq.decoder.eos_ids or row.step == seq.decoder.max_new_tokens
            tokens.append(token)
        going = [i for i, seq in enumerate(group.members) if not seq.state.done]
        next_tokens = [tokens[i] for i in going]
        group.keep(going)
        if not group.members:
            self.ar_groups.remove(group)
            return
        try:
            mask = torch.cat([group.mask, torch.ones_like(group.mask[:, :1])], dim=-1)
            position_ids = group.position_ids + 1
            token_tensor = torch.tensor(next_tokens, dtype=torch.long, device=group.logits.device)
            with self._invariant(len(group.members)):
                group.cache, group.logits = group.members[0].decoder.decode(group.cache, token_tensor, mask,
                                                                            position_ids)
            group.mask, group.position_ids = mask, position_ids
            self.forwards += 1
            for seq in group.members:
                seq.stats.forward(1, 1)
        except Exception as err:  # noqa: BLE001
            failed.update({seq: f"{type(err).__name__}: {err}" for seq in group.members})
            self.ar_groups.remove(group)
