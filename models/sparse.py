"""Moved to `remask.caches.sparse` (the caches' room); these names stay importable from here."""
from remask.caches.sparse import (BlockMaskAttention, RetentionKVCache, block_importance,  # noqa: F401
                                  retained_positions, retention_scores, select_key_blocks, sparsed_block_mask)
