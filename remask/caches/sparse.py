"""Sparse attention through the `attend` seam of `KVCache`, driven by `remask.diffusion.parts.sparse`:
Sparse-dLLM's token-retention cache (OpenMOSS/Sparse-dLLM `CustomCache`; per-head variant of
dLLM-Serve) and SparseD's block-mask attention hook (INV-WZQ/SparseD).

Retention: at a block's delay step, `begin_select(start, end)`: the next forward over all T positions
stores every layer's K/V (after RoPE, `[B, H_kv, T, D]`) and selects, per layer, the positions kept
outside the block (`retained_positions`); every later step feeds the block alone. With the Triton
kernel (CUDA) the block's fresh K/V overwrite its entries in place and its queries attend over the
kept positions plus the block through `remask.kernels.block_sparse_attention` (token-level index
lists), reading the kept K/V where they lie; on the torch path (CPU) the kept K/V are compacted once
at the selection (as upstream; a gather would copy them at every step) and each step attends over
`[kept ; fresh block]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from remask.kernels import block_sparse_attention
from remask.kernels.dispatch import use_triton

from .kv import KVCache, attention, repeat_kv


def retention_scores(q_block: torch.Tensor, keys: torch.Tensor, head_select: bool) -> torch.Tensor:
    """Importance of `keys` `[B, H_kv, N, D]` for the block queries `q_block` `[B, Hq, L, D]`: the mean
    over query heads of (mean block query · key), raw dot products, GQA keys repeated per group
    (`[B, 1, N]`, upstream), or with `head_select` (dLLM-Serve) scaled by 1/√D and the max over each
    KV head's query group (`[B, H_kv, N]`)."""
    # Upstream's order of operations (float32 here as there): mean query, matmul, head mean.
    keys_rep = repeat_kv(keys, q_block.shape[1])
    scores = torch.matmul(q_block.mean(dim=-2).unsqueeze(-2), keys_rep.transpose(-2, -1)).squeeze(-2)
    if not head_select:
        return scores.mean(dim=1, keepdim=True)
    scores = scores / keys.shape[-1] ** 0.5
    return scores.view(scores.shape[0], keys.shape[1], -1, scores.shape[-1]).amax(dim=2)


def retained_positions(q: torch.Tensor, k: torch.Tensor, start: int, end: int, retention_ratio: float,
                       pool_kernel: int | None, head_select: bool,
                       valid: torch.Tensor | None, topk_ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions to keep outside the block `[start, end)` after a full forward with queries `q`
    `[B, Hq, T, D]` and keys `k` `[B, H_kv, T, D]` (after RoPE); `valid` `[B, T]`: non-pad positions.
    Returns (positions `[B, S, n_max]` int64 absolute, in descending score order; counts `[B]`): row b
    keeps its first `counts[b]` (S = 1, or H_kv with `head_select`): the top ⌊N·retention_ratio⌋ of the
    non-block keys (prefix then suffix, as upstream concatenates them) by `retention_scores`, max-pooled
    (stride 1, padding `pool_kernel // 2`, across the block's gap as upstream; a kernel past 2N − 1 pools
    as 2N − 1: every key's window already covers all N). Left pads are never kept
    and count for nothing. Among equal scores (max-pooling makes ties the rule) the earlier position is
    kept (a stable sort), so padding changes nothing; `topk_ties=True`: `torch.topk`'s order (upstream's)."""
    B, _, T, _ = k.shape
    outside = torch.cat([torch.arange(start, device=k.device), torch.arange(end, T, device=k.device)])
    keys = torch.cat([k[:, :, :start], k[:, :, end:]], dim=2)
    importance = retention_scores(q[:, :, start:end], keys, head_select)   # [B, S, N]
    S, N = importance.shape[1], importance.shape[2]
    pads = None
    if valid is not None and not bool(valid.all()):
        pads = ~valid[:, outside][:, None, :]
        importance = importance.masked_fill(pads, -torch.inf)   # a pad lends no score to its neighbours
    if pool_kernel is not None:
        # a kernel of 2N − 1 already covers all N keys from every position: a wider one pools the same (at its cost)
        kernel = min(pool_kernel, max(2 * N - 1, 1))
        importance = F.max_pool1d(importance.reshape(B * S, 1, N), kernel_size=kernel, stride=1,
                                  padding=kernel // 2).view(B, S, N)
    if pads is not None:
        importance = importance.masked_fill(pads, -torch.inf)   # ... and is never kept
    n_outside = torch.full((B,), N, device=k.device) if valid is None else valid[:, outside].sum(dim=1)
    # upstream: int(N * keep_ratio) in Python floats
    counts = torch.tensor([int(n * retention_ratio) for n in n_outside.tolist()], device=k.device)
    n_max = int(counts.max()) if B else 0
    if topk_ties:   # topk over upstream's own shape ([B, N] for one shared set): its order among ties
        keep = torch.topk(importance[:, 0], k=n_max, dim=-1).indices[:, None] if S == 1 else \
            torch.topk(importance, k=n_max, dim=-1).indices
    else:
        keep = torch.sort(importance, dim=-1, descending=True, stable=True).indices[..., :n_max]
    return outside[keep], counts


class RetentionKVCache(KVCache):
    """Sparse-dLLM's retention cache (see the module docstring). `valid` `[B, T]`: non-pad
    positions of the sequence (None: no padding)."""

    def __init__(self, retention_ratio: float, pool_kernel: int | None, head_select: bool,
                 valid: torch.Tensor | None = None, topk_ties: bool = False) -> None:
        super().__init__()
        self.retention_ratio, self.pool_kernel, self.head_select = retention_ratio, pool_kernel, head_select
        self.valid, self.topk_ties = valid, topk_ties
        self.block: tuple[int, int] | None = None
        self.selecting = False
        self.kept: list[torch.Tensor] = []        # per layer: [B, S, n_max] positions
        self.kept_counts: list[torch.Tensor] = []
        self.lists: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # torch path: per layer, the kept K/V compacted at the selection `[B, H_kv, n_max, D]` and a
        # key mask `[B, 1, 1, n_max + block]` when rows keep different counts (None otherwise)
        self.compact: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.total_len = 0

    def get_seq_length(self, layer: int = 0) -> int:
        return self.total_len

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for kv in self.compact.values() for t in kv[:2])

    def begin_select(self, start: int, end: int) -> None:
        """The next forward (all T positions) stores the K/V and selects what to keep outside
        `[start, end)`; call `end_select` after it."""
        self.keys, self.values, self.kept, self.kept_counts, self.lists, self.compact = [], [], [], [], {}, {}
        self.block, self.selecting = (start, end), True

    def end_select(self) -> None:
        """From now on forwards feed the block alone and attend sparsely."""
        self.selecting = False

    @property
    def kept_fraction(self) -> float:
        """Mean fraction of the stored positions each block query attends to (kept + block)."""
        if not self.kept or self.block is None:
            return 1.0
        block = self.block[1] - self.block[0]
        return float(sum((c.float().mean() + block) / self.total_len for c in self.kept_counts) / len(self.kept_counts))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self.selecting:
            keys, values = self.update(layer, k, v, start)
            start_b, end_b = self.block
            positions, counts = retained_positions(q, keys, start_b, end_b, self.retention_ratio, self.pool_kernel,
                                                   self.head_select, self.valid, self.topk_ties)
            self.kept.append(positions)
            self.kept_counts.append(counts)
            self.total_len = keys.shape[-2]
            out = attention(q, keys, values, mask)
            if not use_triton(keys):
                self._compact(layer, keys, values, positions, counts, end_b - start_b)
            return out
        if layer in self.compact:
            kept_k, kept_v, key_mask = self.compact[layer]
            # upstream's computation: SDPA over the kept K/V followed by the block's fresh ones
            return attention(q, torch.cat([kept_k, k], dim=2), torch.cat([kept_v, v], dim=2), key_mask)
        keys, values = self.update(layer, k, v, start)
        num, idx = self._index_lists(layer, q.shape[1], start, k.shape[-2])
        return block_sparse_attention(q, keys, values, num, idx, q_block_size=q.shape[-2], kv_block_size=1)

    def _compact(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 counts: torch.Tensor, block: int) -> None:
        """Copy the kept K/V out once (torch path) and drop the layer's full K/V."""
        B, H_kv, _, D = keys.shape
        S, n_max = positions.shape[1], positions.shape[2]
        index = positions.expand(B, H_kv, n_max) if S == 1 else positions
        index = index[..., None].expand(B, H_kv, n_max, D)
        kept_k, kept_v = torch.gather(keys, 2, index), torch.gather(values, 2, index)
        key_mask = None
        if bool((counts < n_max).any()):   # padded rows keep fewer: hide the tail of their list
            live = torch.arange(n_max + block, device=keys.device) < counts[:, None]
            live[:, n_max:] = True
            key_mask = live[:, None, None, :]
        self.compact[layer] = (kept_k, kept_v, key_mask)
        self.keys[layer], self.values[layer] = keys[:, :, :0], values[:, :, :0]

    def _index_lists(self, layer: int, n_heads: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level index lists `[B, Hq, 1, n]`: the kept positions (upstream's order), then the
        block's; built once per layer and block."""
        if layer not in self.lists:
            positions, counts = self.kept[layer], self.kept_counts[layer]
            B, S, n_max = positions.shape
            block = torch.arange(start, start + length, device=positions.device).expand(B, S, length)
            # Row b's list: its first counts[b] kept positions, then the block; the rest is junk.
            lists = torch.cat([positions, block], dim=-1)
            if bool((counts < n_max).any()):
                order = torch.arange(n_max + length, device=positions.device)
                shift = (n_max - counts)[:, None, None]
                src = torch.where(order < counts[:, None, None], order, order + shift).clamp(max=n_max + length - 1)
                lists = torch.gather(lists, -1, src.expand(B, S, -1))
            group = n_heads // S
            lists = lists[:, :, None, :].expand(B, S, group, n_max + length).reshape(B, n_heads, 1, -1)
            num = (counts + length)[:, None, None].expand(B, n_heads, 1)
            self.lists[layer] = (num, lists)
        return self.lists[layer]


def block_importance(attn: torch.Tensor, block_size: int) -> torch.Tensor:
    """SparseD's tile score: attention weights `[B, H, Lq, Lk]` zero-padded to whole
    `block_size` tiles, then the mean |weight| of each tile → `[B, H, n_q_blocks, n_kv_blocks]`
    (a partial tile is averaged over block_size², pads counting as zeros, as upstream)."""
    Lq, Lk = attn.shape[-2], attn.shape[-1]
    pad_q, pad_k = (-Lq) % block_size, (-Lk) % block_size
    tiles = F.pad(attn, (0, pad_k, 0, pad_q)).unfold(2, block_size, block_size).unfold(3, block_size, block_size)
    return tiles.abs().mean(dim=(-1, -2))


def select_key_blocks(q_block: torch.Tensor, keys: torch.Tensor, block_size: int, select: float,
                      scale: float) -> torch.Tensor:
    """Key blocks kept for one query block: softmax(q·kᵀ·scale) in float32, tile scores, the top
    `int(n·select) + 1` (at least 1) per head → bool `[B, H, 1, n_kv_blocks]`."""
    weights = torch.softmax(torch.matmul(q_block, keys.transpose(2, 3)) * scale, dim=-1, dtype=torch.float32)
    importance = block_importance(weights.to(q_block.dtype), block_size)
    keep = max(1, int(importance.shape[-1] * select) + 1)
    _, top = torch.topk(importance, k=min(keep, importance.shape[-1]), dim=-1, sorted=False)
    return torch.zeros_like(importance, dtype=torch.bool).scatter_(-1, top, True)


def sparsed_block_mask(q: torch.Tensor, k: torch.Tensor, block_size: int, select: float, gen_length: int,
                       scale: float) -> torch.Tensor:
    """SparseD's head-specific block mask from one full forward's queries and keys (after RoPE,
    `[B, H, T, D]`; GQA keys repeated per group) → bool `[B, H, n_blocks, n_blocks]`. Per query block:
    the top blocks over all keys, kept before `last` (the first block within the last `gen_length`
    positions, or the final block); from `last` on, the top blocks over those generation keys alone."""
    k = repeat_kv(k, q.shape[1])
    T = q.shape[2]
    n_blocks = -(-T // block_size)
    last = next(i for i in range(n_blocks) if T - i * block_size <= gen_length or i == n_blocks - 1)
    mask = torch.zeros((q.shape[0], q.shape[1], n_blocks, n_blocks), dtype=torch.bool, device=q.device)
    for i in range(n_blocks):
        q_block = q[:, :, i * block_size:(i + 1) * block_size]
        mask[:, :, i:i + 1] = select_key_blocks(q_block, k, block_size, select, scale)
        mask[:, :, i:i + 1, last:] = select_key_blocks(q_block, k[:, :, last * block_size:], block_size, select, scale)
    return mask


class BlockMaskAttention(KVCache):
    """SparseD's attention hook for full forwards (nothing is cached): `dense` forwards attend
    densely; a `select` forward also builds each layer's block mask (`sparsed_block_mask`); every
    later forward attends through `remask.kernels.block_sparse_attention` with the layer's mask as
    FlexAttention-style lists (`kv_num_blocks`, `kv_indices`)."""

    def __init__(self, block_size: int, select: float, gen_length: int, corrected_scale: bool) -> None:
        super().__init__()
        self.block_size, self.select, self.gen_length, self.corrected_scale = (
            block_size, select, gen_length, corrected_scale)
        self.phase = "dense"
        self.lists: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self.phase == "sparse":
            num, idx = self.lists[layer]
            return block_sparse_attention(q, k, v, num, idx, q_block_size=self.block_size,
                                          kv_block_size=self.block_size)
        if self.phase == "select":
            # upstream scales the selection scores by 1/√n_heads (a quirk); corrected: 1/√head_dim
            scale = (q.shape[-1] if self.corrected_scale else q.shape[1]) ** -0.5
            block_mask = sparsed_block_mask(q, k, self.block_size, self.select, self.gen_length, scale)
            # lists: each row's kept block ids first (ascending), then junk past the count
            order = torch.argsort((~block_mask).to(torch.int8), dim=-1, stable=True)
            self.lists.append((block_mask.sum(dim=-1).to(torch.int32), order.to(torch.int32)))
        return attention(q, k, v, mask)
