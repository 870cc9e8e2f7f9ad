"""`PromptCache`: the encoder's KV cache of a whole prompt, shared by the requests that send that
exact prompt (encoder–decoder models: DiffusionGemma).

An encoder is causal, so the cache it writes for a prompt depends only on the prompt's tokens: a
request whose prompt ids equal a cached one's (the key is the ids themselves, not a hash that
could collide) starts from a copy of that cache instead of running the encoder, and the copy is
bitwise what its own encoder forward would write — the same computation on the same shapes. Only
whole prompts are shared: continuing a cached prefix with the rest of a longer prompt would run
the encoder on other shapes, whose rounding may differ. Entries are copied in and out (each
request then appends its own canvases), least recently used first out.
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
        self.hits = 0
        self.misses = 0
        # prompts whose encoder forward a request has asked for and not yet stored (`put`): another
        # request with the prompt waits for it one engine step instead of encoding it again
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

    def clear(self) -> None:
        self.entries.clear()
        self.encoding.clear()
