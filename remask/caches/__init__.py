"""The caches' room: every KV cache the samplers plug into a model's `attend` seam.

`KVCache` (contiguous K/V after RoPE: prefix and dual caching), `PagedKVCache` (the dual cache in
`PageManager` pages, `use_cache="paged"`), `RetentionKVCache` / `BlockMaskAttention` (Sparse-dLLM's
retention, SparseD's block masks), `BlockKVCache` / `BlockBatch` (block-causal models' finished
blocks in the engine's pages), `PromptCache` (an encoder's cache of a whole prompt, shared by the
requests that send it), and the methods' own: `DelayedKVCache` (dKV-Cache), `D2KVCache` (d2Cache),
`ElasticKVCache` (Elastic-Cache), `TreeKVCache` (FreeDave's drafts). How a sampler drives them is
`remask.diffusion.parts.cache`; the engine's page store is `page_manager.PagedKVStore` (its AR forward:
`remask.engine.paged_kv`).
"""
from .block import BlockBatch, BlockKVCache
from .elastic import ElasticKVCache
from .kv import KVCache, attention, key_bias
from .paged import PagedKVCache
from .position import D2KVCache, DelayedKVCache
from .prompt import PromptCache
from .sparse import BlockMaskAttention, RetentionKVCache
from .tree import TreeKVCache

__all__ = ["BlockBatch", "BlockKVCache", "BlockMaskAttention", "D2KVCache", "DelayedKVCache", "ElasticKVCache",
           "KVCache", "PagedKVCache", "PromptCache", "RetentionKVCache", "TreeKVCache", "attention", "key_bias"]
