"""The scheduler decides which sequences run in the next engine step (docs/engine.md: A request's
life, Fairness). Each step's batch (at most `max_num_seqs`) is filled round-robin over owners, then
their requests (resident sequences first), least recently served first; a resident sequence not
picked is paused with its state. Preemption (vLLM's recompute): when the pages resident paged
sequences need for their next token are not free, the most recently admitted one gives its pages
back and returns to the head of its queue (`Sequence.restart`: same seed, same tokens).
"""
from __future__ import annotations

from collections import defaultdict, deque
from itertools import count

from remask.caches.page_manager import PageManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pages: PageManager | None = None,
                 cost_stride: bool = True) -> None:
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.pages, self.cost_stride = pages, cost_stride
        self.running: list[Sequence] = []          # admitted (resident: holding state), in admission order
        self.steps = 0                             # schedule() calls: the clock of "last served"
        self._waiting: defaultdict[str, deque[Sequence]] = defaultdict(deque)   # request id → its waiting sequences
        self._arrival: dict[str, tuple[int, str | None]] = {}   # request id → (its arrival number, its owner)
        self._arrivals = count()
        self._served: dict[str, int] = {}          # request id → the last step it was in the batch
        self._owner_served: dict[str | None, int] = {}
        self._seq_served: dict[Sequence, tuple[int, int]] = {}   # resident sequence → (last step served, steps run)

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"the request needs {seq.num_tokens} positions (prompt {seq.prompt_len} + max_tokens "
                             f"{seq.params.max_tokens}), more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        need = self.pages.pages_for(seq.num_tokens) if seq.paged else self._admission_pages(seq)
        if need and need > self.pages.num_pages:   # need: 0 without a page store
            whole = "" if seq.paged else "its whole blocks: "
            raise ValueError(f"the request needs {need} KV pages of {self.pages.page_size} positions ({whole}prompt "
                             f"{seq.prompt_len} + max_tokens {seq.params.max_tokens}), more than the whole store "
                             f"(kv_cache_pages={self.pages.num_pages})")
        # a request's first sequence sets its place (numbers only order: a skipped one changes nothing)
        self._arrival.setdefault(seq.request_id, (next(self._arrivals), seq.owner))
        self._waiting[seq.request_id].append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def _growth(self, seq: Sequence) -> int:
        """Fresh pages a running paged sequence needs for the token it stores this step."""
        if seq.block_table is None or seq.state.done:
            return 0
        return max(0, self.pages.pages_for(seq.kv_len + 1) - len(seq.block_table))

    def schedule(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """Reserve this step's pages (preempting if needed), then pick the batch (module docstring);
        returns (newly admitted, this step's batch in admission order, preempted)."""
        self.steps += 1
        preempted: list[Sequence] = []
        # Every resident sequence's growth is reserved, scheduled this step or not: a paused one
        # can always go on, and preemption stays the only way a sequence loses its pages.
        reserved = sum(self._growth(seq) for seq in self.running)   # 0 without a page store
        while reserved and reserved > self.pages.num_free:   # so some running sequence holds pages, to grow
            victim = next(s for s in reversed(self.running) if s.block_table is not None)
            reserved -= self._growth(victim)
            self.running.remove(victim)
            victim.restart(self.pages)
            self._seq_served.pop(victim, None)
            preempted.append(victim)
            # newest first: the oldest ends at the head of its queue
            self._waiting[victim.request_id].appendleft(victim)
        resident: defaultdict[str, deque[Sequence]] = defaultdict(deque)
        resting = self._resting() if self.cost_stride else set()
        # A request's paused sequences go first: its samples progress evenly and finish together,
        # so its next waiting ones are admitted in whole waves (no straggler decoding alone).
        for seq in sorted(self.running, key=lambda s: self._seq_served.get(s, (-1,))[0]):
            if seq not in resting:
                resident[seq.request_id].append(seq)
        active = {seq.request_id for seq in self.running} | {rid for rid, queue in self._waiting.items() if queue}
        for rid in [rid for rid in self._arrival if rid not in active]:
            self._forget(rid)
        owners: defaultdict[str | None, deque[str]] = defaultdict(deque)
        for rid in sorted(active, key=self._turn):
            owners[self._arrival[rid][1]].append(rid)
        # Owners in the order they were last served (never served first), each owner's requests too;
        # each turn takes one sequence from the owner at the head, which then goes to the back.
        self._owner_served = {owner: step for owner, step in self._owner_served.items() if owner in owners}
        order = deque(sorted(owners, key=lambda o: (self._owner_served.get(o, -1), self._turn(owners[o][0]))))
        tokens, resident_count = sum(seq.num_tokens for seq in self.running), len(self.running)
        picked: set[Sequence] = set()
        while len(picked) < self.max_num_seqs and order:
            owner = order.popleft()
            rids, seq = owners[owner], None   # the owner's requests, the next one to serve first
            while rids and seq is None:
                rid = rids.popleft()
                if resident.get(rid):
                    seq = resident[rid].popleft()
                elif self._waiting.get(rid):   # admitted if it fits; else the request is done this step
                    candidate = self._waiting[rid][0]
                    need = self._admission_pages(candidate)
                    if tokens + candidate.num_tokens <= self.max_num_batched_tokens and \
                            not (need and reserved + need > self.pages.num_free):
                        seq = self._waiting[rid].popleft()
                        reserved, tokens = reserved + need, tokens + seq.num_tokens
                        seq.status = SequenceStatus.RUNNING
                        self.running.append(seq)   # admitted: after the resident ones
                if seq is not None:   # back of the owner's round (else nothing more from this request this step)
                    rids.append(rid)
            if seq is None:
                continue    # nothing more from this owner this step
            order.append(owner)
            picked.add(seq)
            self._seq_served[seq] = (self.steps, self._seq_served.get(seq, (0, 0))[1] + 1)
            self._served[seq.request_id] = self.steps
            self._owner_served[owner] = self.steps
        return self.running[resident_count:], [seq for seq in self.running if seq in picked], preempted

    def _resting(self) -> set[Sequence]:
        """Cost stride: the resident sequences that sit this step out. One whose forwards computed
        r ≥ 2 times the positions per step of the cheapest runs once every ⌊r⌋ steps, so a cheap
        request is not slowed by an expensive one beside it. Paged sequences are never held."""
        costs = {seq: seq.stats.forward_positions / self._seq_served[seq][1] for seq in self.running
                 if not seq.paged and seq in self._seq_served and seq.stats.forward_positions > 0}
        if len(costs) < 2:
            return set()
        base = min(costs.values())
        return {seq for seq, cost in costs.items()
                if self.steps - self._seq_served[seq][0] < int(cost // base)}

    def _admission_pages(self, seq: Sequence) -> int:
        """Pages a waiting sequence takes when admitted: an AR sequence's prompt and first token, a
        block-causal request's whole table (its decoder allocates it at its start: it never waits for a
        page while running); 0 for the others."""
        if seq.paged:
            return self.pages.pages_needed(seq.prompt_ids[0].tolist(), extra_positions=1)
        return 0 if self.pages is None else seq.decoder.pages_needed(self.pages, seq.prompt_ids) or 0

    def _turn(self, request_id: str) -> tuple[int, int]:
        """A request's place in its owner's round: least recently served first, then arrival."""
        return self._served.get(request_id, -1), self._arrival[request_id][0]

    def _forget(self, request_id: str) -> None:
        """Drop a request's bookkeeping once none of its sequences waits or runs."""
        for table in (self._waiting, self._served, self._arrival):
            table.pop(request_id, None)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        seq.status = status
        if seq.block_table is not None:
            self.pages.free(seq.block_table)   # an autoregressive sequence's pages
            seq.block_table = None
        if seq.state is not None:
            seq.decoder.release(seq.state)    # a block-causal request's pages
            if seq.recorder is not None:      # its logprobs were read when it finished
                seq.recorder.forget(seq.state)
        seq.state = None          # drops its cache
        self._seq_served.pop(seq, None)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> None:
        """Remove every sequence of the request, waiting or running (the engine sets their finish reason)."""
        hit = [*self._waiting.pop(request_id, ()), *(s for s in self.running if s.request_id == request_id)]
        self._forget(request_id)
        for seq in hit:
            self.finish(seq, SequenceStatus.ABORTED)
