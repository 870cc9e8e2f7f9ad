"""`PromptCache`: the encoder's KV cache of a whole prompt, shared by the requests that send that
exact prompt (encoder–decoder models: DiffusionGemma). An encoder is causal, so a request whose
prompt ids equal a cached one's (the ids are the key: no hash to collide) starts from a copy that is
bitwise what its own encoder forward would write. Only whole prompts are shared: encoding the rest
of a longer one would run on other shapes, whose rounding may differ. Entries are copied in and out
(each request then appends its own canvases), LRU.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any


class PromptCache:
    def __init__(self, capacity: int = 64) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self.hits = self.misses = 0
        # prompts being encoded (not yet `put`): another request with one waits a step, not re-encoding it
        self.encoding: set[tuple[int, ...]] = set()

    def get(self, prompt_ids: tuple[int, ...]) -> Any | None:
        """A private copy of the cache written for `prompt_ids`, or None."""
        entry = self.entries.get(prompt_ids)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(prompt_ids)
        self.hits += 1
        return copy.deepcopy(entry)

    def put(self, prompt_ids: tuple[int, ...], cache: Any) -> None:
        """Keep a copy of `cache` (the encoder's after exactly `prompt_ids`)."""
        self.entries[prompt_ids] = copy.deepcopy(cache)
        self.entries.move_to_end(prompt_ids)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
