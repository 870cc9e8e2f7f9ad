"""The scheduler decides which sequences run in the next engine step.

WAITING → RUNNING when admitted (first come, first served, within `max_num_seqs` sequences,
`max_num_batched_tokens` positions — a diffusion sequence's forward covers its prompt and its
whole generation window — and, for sequences in the page store, free KV pages for the prompt
and its first token), → FINISHED when its decoder is done, → ABORTED on `abort`. Admission
happens at every step, so a request added while others run joins at the next step; a finished
sequence leaves at once and its pages go back.

Preemption: before each step the pages the running sequences need for this step's tokens are
reserved; when too few are free, the most recently admitted paged sequence gives its pages back
and returns to the head of the queue (`Sequence.restart`: it decodes again from its seed, so its
tokens are the same; vLLM's recompute preemption).
"""
from __future__ import annotations

from collections import deque

from .page_manager import PageManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pages: PageManager | None = None) -> None:
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"the request needs {seq.num_tokens} positions (prompt {seq.prompt_len} + max_tokens "
                             f"{seq.params.max_tokens}), more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        if seq.paged and self.pages is not None and self.pages.pages_for(seq.num_tokens) > self.pages.num_pages:
            raise ValueError(f"the request needs {self.pages.pages_for(seq.num_tokens)} KV pages of "
                             f"{self.pages.page_size} positions (prompt {seq.prompt_len} + max_tokens "
                             f"{seq.params.max_tokens}), more than the whole store (kv_cache_pages="
                             f"{self.pages.num_pages})")
        need = self._block_pages(seq)
        if need is not None and need > self.pages.num_pages:
            raise ValueError(f"the request needs {need} KV pages of {self.pages.page_size} positions (its "
                             f"whole blocks: prompt {seq.prompt_len} + max_tokens {seq.params.max_tokens}), more "
                             f"than the whole store (kv_cache_pages={self.pages.num_pages})")
        self.waiting.append(seq)

    def _block_pages(self, seq: Sequence) -> int | None:
        """Pages a block-causal request takes at its start (its decoder allocates them all then:
        it never waits for a page while running), or None for other requests."""
        pages_needed = getattr(seq.decoder, "pages_needed", None)
        if self.pages is None or pages_needed is None or getattr(seq.decoder, "block_store", None) is None:
            return None
        return pages_needed(self.pages, seq.prompt_ids)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _growth(self, seq: Sequence) -> int:
        """Fresh pages a running paged sequence needs for the token it stores this step."""
        row = seq.state
        if not seq.paged or row is None or row.done:
            return 0
        return max(0, self.pages.pages_for(seq.prompt_len + row.step + 1) - len(row.table))

    def schedule(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """Reserve this step's pages (preempting if needed), admit what fits; returns (newly
        admitted, all running, preempted)."""
        preempted: list[Sequence] = []
        reserved = 0
        if self.pages is not None:
            reserved = sum(self._growth(seq) for seq in self.running)
            while reserved > self.pages.num_free:
                victim = next((s for s in reversed(self.running) if s.paged and s.state is not None), None)
                if victim is None:
                    break
                reserved -= self._growth(victim)
                self.running.remove(victim)
                self.pages.free(victim.state.table)
                victim.restart()
                preempted.append(victim)
            for victim in preempted:   # oldest first at the head of the queue
                self.waiting.appendleft(victim)
        admitted = []
        tokens = sum(seq.num_tokens for seq in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs \
                and tokens + self.waiting[0].num_tokens <= self.max_num_batched_tokens:
            seq = self.waiting[0]
            if seq.paged and self.pages is not None:
                need = self.pages.pages_needed(seq.prompt_ids[0].tolist(), extra_positions=1)
                if reserved + need > self.pages.num_free:
                    break
                reserved += need
            elif (need := self._block_pages(seq)) is not None:
                if reserved + need > self.pages.num_free:
                    break
                reserved += need
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            tokens += seq.num_tokens
            self.running.append(seq)
            admitted.append(seq)
        return admitted, list(self.running), preempted

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        seq.status = status
        if seq.paged and seq.state is not None and self.pages is not None:
            self.pages.free(seq.state.table)
        release = getattr(seq.decoder, "release", None)
        if release is not None and seq.state is not None:
            release(seq.state)    # a block-causal request's pages
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
