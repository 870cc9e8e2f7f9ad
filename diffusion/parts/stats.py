"""Opt-in generation statistics: pass `stats=GenerationStats()` to any remask generate call."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode


@dataclass
class GenerationStats:
    """Filled in by a generate call. nfe: model forward passes (a CFG step's doubled batch counts once).
    forward_positions: positions the model computed, over forwards and rows (what a cache saves). tokens_per_step:
    positions committed at each step, over the batch. kv_cache_bytes: the most K/V bytes a cache held after a
    forward (paged: the pages in use, shared ones once). generated_tokens: new tokens, over the batch."""

    nfe: int = 0
    forward_positions: int = 0
    _tokens_per_step: list = field(default_factory=list, repr=False)
    generated_tokens: int = 0
    kv_cache_bytes: int = 0
    wall_time: float = 0.0
    _start: float = field(default=0.0, repr=False)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time (prompt tokens excluded)."""
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_step(self) -> list[int]:
        """Positions committed at each step (read from the device here, once, not at every step)."""
        read_counts([self])
        return self._tokens_per_step

    @property
    def mean_tokens_per_step(self) -> float:
        return sum(self.tokens_per_step) / len(self.tokens_per_step) if self.tokens_per_step else 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, generated_tokens: int) -> None:
        self.wall_time += time.perf_counter() - self._start
        self.generated_tokens += generated_tokens

    def forward(self, batch: int, length: int, kv_cache_bytes: int = 0) -> None:
        self.nfe += 1
        self.forward_positions += batch * length
        self.kv_cache_bytes = max(self.kv_cache_bytes, kv_cache_bytes)

    @property
    def num_steps(self) -> int:
        """Steps counted so far (without reading any count from the device)."""
        return len(self._tokens_per_step)

    def add_steps(self, other: "GenerationStats", since: int = 0) -> None:
        """Append `other`'s step counts from its step `since` on (device counts stay unread)."""
        self._tokens_per_step.extend(other._tokens_per_step[since:])

    def step(self, committed: int | torch.Tensor) -> None:
        """Count one step's commits: an int, or a tensor left on its device until `tokens_per_step` is read."""
        self._tokens_per_step.append(committed.detach() if isinstance(committed, torch.Tensor) else int(committed))


def read_counts(stats: Iterable[GenerationStats]) -> None:
    """Read the step counts that `stats` still hold on the device, all of them in one host read."""
    pending = [(one._tokens_per_step, i) for one in stats
               for i, c in enumerate(one._tokens_per_step) if isinstance(c, torch.Tensor)]
    if pending:
        values = torch.stack([counts[i].reshape(()) for counts, i in pending]).tolist()
        for (counts, i), value in zip(pending, values):
            counts[i] = int(value)


# The calls that make the host wait for the device, by kind (a round trip each; a step making one is no CUDA graph).
SYNCING = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
           torch.Tensor.__bool__: "bool", torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
           torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index"}


class SyncCounter(TorchFunctionMode):
    """Counts the calls in `SYNCING` while active (`with SyncCounter() as c:`): `c.counts` by kind, `c.total`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = SYNCING.get(func)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
