"""The cache FreeDave's drafts attend through (its loop: `remask.diffusion.methods.freedave`)."""
from __future__ import annotations

import torch

from .kv import KVCache


class TreeKVCache(KVCache):
    """FreeDave's drafts' view of their block's cache, never copied nor written
    (`remask.diffusion.methods.freedave`, "Exactness"): row a·K + k is draft k of `rows[a]`, whose queries attend [cached prefix | own
    keys | cached suffix] of its row's cache."""

    def __init__(self, base: KVCache, rows: torch.Tensor | None, prefix: int, suffix_start: int,
                 total: int, drafts: int) -> None:
        super().__init__()
        self.base, self.rows, self.prefix, self.suffix_start = base, rows, prefix, suffix_start
        self.total, self.drafts = total, drafts

    def get_seq_length(self, layer: int = 0) -> int:
        return self.total

    def _side(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        part = t[:, :, lo:hi]
        if self.rows is not None:
            part = part.index_select(0, self.rows)
        return part.repeat_interleave(self.drafts, dim=0)

    def _keys(self, held: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """[`held`'s prefix | `own` | `held`'s suffix] along the positions (an empty side left out)."""
        # an empty side is neither gathered nor copied: with none, the draft's own keys as they are
        parts = ([self._side(held, 0, self.prefix)] if self.prefix > 0 else []) + [own] + (
            [self._side(held, self.suffix_start, self.total)] if self.suffix_start < self.total else [])
        return torch.cat(parts, dim=2) if len(parts) > 1 else own

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values each draft row attends (`k`, `v` `[A·K, H, L, D]`: each draft's own), nothing
        written; `attend` (KVCache's) attends over them with the drafts' mask, broadcast over their rows."""
        return self._keys(self.base.keys[layer], k), self._keys(self.base.values[layer], v)
