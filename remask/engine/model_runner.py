"""The model runner computes one engine step for the running sequences.

Diffusion sequences whose next forward is a plain full forward (`BlockDecoder.full_forward`: no
cache, no CFG, no sparse attention; every step of Dream's sampler, `DreamDecoder`) and whose
sequences have the same length share one batched
forward — their rows are independent in a bidirectional forward of equal-length, unpadded
sequences, and with `batch_invariant` each row is computed with the shapes it has alone
(`batch_invariant.py`). Every other sequence (cached or sparse diffusion, CFG, autoregressive)
runs its own forward in the same step. Each sequence then commits its own tokens with its own
rule and generator (`BlockDecoder.commit`, `DreamDecoder.commit`, `ARDecoder.step`): no
sampling rule lives here.

A failure inside one sequence's forward or commit fails that sequence only (`failed`).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from remask.diffusion.ar import ARDecoder
from remask.models.spec import ModelSpec

from .batch_invariant import batch_invariant_linear
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, batch_invariant: bool = True) -> None:
        self.model, self.spec, self.batch_invariant = model, spec, batch_invariant
        self.device = next(model.parameters()).device
        self.forwards = 0      # model calls, for the benchmark

    def _invariant(self, batch: int):
        return batch_invariant_linear(self.batch_invariant and batch > 1, single_thread=self.device.type == "cpu")

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> dict[Sequence, str]:
        """Advance every sequence by one step; returns the failed ones with their error."""
        failed: dict[Sequence, str] = {}
        shared: dict[tuple, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            try:
                if seq.state is None:
                    self._start(seq)
                    if isinstance(seq.decoder, ARDecoder):
                        continue          # its prompt forward was this step's work
                if not isinstance(seq.decoder, ARDecoder) and seq.decoder.full_forward(seq.state):
                    # equal lengths and the same row-independent inputs (none, or Dream's "full")
                    shared[seq.state.x.shape[1], tuple(sorted(seq.state.forward_inputs.items()))].append(seq)
                else:
                    self._own_step(seq)
            except Exception as err:  # noqa: BLE001 - one request's failure must not stop the others
                failed[seq] = f"{type(err).__name__}: {err}"
        for (_, inputs), group in shared.items():
            try:
                with self._invariant(len(group)):
                    logits = self.spec.logits(self.model, torch.cat([seq.state.x for seq in group]), **dict(inputs))
                self.forwards += 1
            except Exception as err:  # noqa: BLE001
                failed.update({seq: f"{type(err).__name__}: {err}" for seq in group})
                continue
            for i, seq in enumerate(group):
                try:
                    seq.decoder.commit(seq.state, logits[i:i + 1], 0, seq.generator, seq.stats)
                except Exception as err:  # noqa: BLE001
                    failed[seq] = f"{type(err).__name__}: {err}"
        return failed

    def _start(self, seq: Sequence) -> None:
        seq.stats.start()
        if isinstance(seq.decoder, ARDecoder):
            seq.state = seq.decoder.start(seq.prompt_ids, None, seq.stats)
            self.forwards += 1
        else:
            seq.state = seq.decoder.start(self.model, seq.prompt_ids)

    def _own_step(self, seq: Sequence) -> None:
        if isinstance(seq.decoder, ARDecoder):
            seq.decoder.step(seq.state, seq.generator, seq.stats)
            self.forwards += 0 if seq.state.done else 1
        else:
            seq.decoder.step(self.model, seq.state, seq.generator, seq.stats)
            self.forwards += 1
