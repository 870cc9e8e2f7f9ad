"""Moved to `remask.caches.paged` (the caches' room); these names stay importable from here."""
# `BlockManager`: the allocator's old name ("block" now means the semi-autoregressive block only)
from remask.caches.page_manager import PageManager as BlockManager  # noqa: F401
from remask.caches.paged import PagedKVCache  # noqa: F401
