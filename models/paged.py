"""Moved to `remask.caches.paged` (the caches' room); these names stay importable from here."""
from remask.caches.paged import BlockManager, PagedKVCache  # noqa: F401
