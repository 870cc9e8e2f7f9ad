"""The caches' room: every KV cache the samplers plug into a model's `attend` seam.

* `KVCache` (`kv.py`): contiguous per-layer K/V after RoPE — prefix and dual caching;
* `PagedKVCache` (`paged.py`): the dual cache kept in pages (`use_cache="paged"`), pages from
  `remask.engine.page_manager.PageManager`, read by the paged-attention kernel;
* `RetentionKVCache`, `BlockMaskAttention` (`sparse.py`): Sparse-dLLM's retention and SparseD's
  block masks;
* `BlockKVCache`, `BlockBatch` (`block.py`): the exact cache of block-causal models (SDAR) in
  the engine's pages — finished blocks written once, read by every later block; a forward shared
  by requests at different blocks;
* `PromptCache` (`prompt.py`): an encoder's cache of a whole prompt, copied to the requests that
  send the same prompt (DiffusionGemma in the engine).

How a sampler drives them over a block (refresh, then cached steps) is `remask.diffusion.cache`;
the engine's AR page store is `remask.engine.paged_kv`.
"""
from .block import BlockBatch, BlockKVCache
from .kv import KVCache, attention
from .paged import PagedKVCache
from .prompt import PromptCache
from .sparse import BlockMaskAttention, RetentionKVCache

__all__ = ["BlockBatch", "BlockKVCache", "BlockMaskAttention", "KVCache", "PagedKVCache", "PromptCache", "RetentionKVCache", "attention"]
