"""The scheduler decides which sequences run in the next engine step.

WAITING → RUNNING when admitted (first come, first served, within `max_num_seqs` sequences and
`max_num_batched_tokens` positions — a diffusion sequence's forward covers its prompt and its
whole generation window), → FINISHED when its decoder is done, → ABORTED on `abort`. Admission
happens at every step, so a request added while others run joins at the next step; a finished
sequence leaves at once.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"the request needs {seq.num_tokens} positions (prompt {seq.prompt_len} + max_tokens "
                             f"{seq.params.max_tokens}), more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """Admit what fits; returns (newly admitted, all running)."""
        admitted = []
        tokens = sum(seq.num_tokens for seq in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs \
                and tokens + self.waiting[0].num_tokens <= self.max_num_batched_tokens:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            tokens += seq.num_tokens
            self.running.append(seq)
            admitted.append(seq)
        return admitted, list(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        seq.status = status
        seq.state = None          # drops its cache
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of the request, waiting or running; returns them."""
        hit = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for seq in hit:
            self.finish(seq, SequenceStatus.ABORTED)
            seq.finish_reason = "abort"
        return hit
