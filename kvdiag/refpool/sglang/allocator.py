"""SGLang's device KV slot allocator (L1 pool).

Mirrors ``mem_cache/allocator/token.py`` (page_size 1) and ``allocator/paged.py`` (page_size > 1)
of SGLang 0.5.23: the pool is a free list of pages; ``alloc`` takes pages from the front of the
sorted free list, ``free`` parks pages in ``release_pages`` and they are merged back and sorted
only when the free list runs short (``merge_and_sort_free``). Page 0 is reserved as padding, as
in SGLang (``free_pages = arange(1, num_pages + 1)``), so usable slots are ``page_size ..
(num_pages + 1) * page_size - 1``; with page_size 1 that is ``1..size``.

The allocator counts slots, never bytes: the KV bytes live in the ``KVStore``.
"""

from __future__ import annotations

from typing import Sequence


class TokenToKVPoolAllocator:
    """Free-page list over ``size`` token slots (``size`` = ``max_total_num_tokens``)."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size <= 0 or size % page_size:
            # pool_configurator floors max_total_num_tokens to a page multiple.
            raise ValueError(f"size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        # Kept in *descending* order so the smallest free page is popped from the list's end:
        # same allocation order as SGLang's ascending tensor sliced from the front.
        self.free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self.release_pages: list[int] = []
        self._owned = bytearray(self.num_pages + 1)  # 1 where a page is allocated

    def available_size(self) -> int:
        """Free slots, counting pages parked in ``release_pages`` (as SGLang does)."""
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def merge_and_sort_free(self) -> None:
        """Return released pages to the free list, smallest page first (``allocator/base.py``)."""
        if self.release_pages:
            self.free_pages.extend(self.release_pages)
            self.free_pages.sort(reverse=True)
            self.release_pages = []

    def alloc(self, need_size: int) -> list[int] | None:
        """``need_size`` slots (whole pages), or None when the pool cannot serve them.

        The paged allocator asserts ``need_size % page_size == 0``; callers round up to pages.
        """
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not a whole number of {self.page_size}-token pages")
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        if num_pages == 0:
            return []
        pages = self.free_pages[-num_pages:]
        del self.free_pages[-num_pages:]
        pages.reverse()
        for p in pages:
            self._owned[p] = 1
        ps = self.page_size
        if ps == 1:
            return pages
        return [p * ps + o for p in pages for o in range(ps)]

    def free(self, free_index: Sequence[int]) -> None:
        """Release the pages holding ``free_index``.

        Like SGLang's paged ``free`` (``unique(free_index // page_size)``), naming any slot of a
        page frees the whole page. Freeing a page that is not allocated raises: in SGLang that
        is silent pool corruption, here it is a bug in the model.
        """
        ps = self.page_size
        pages = sorted({i // ps for i in free_index}) if ps > 1 else list(free_index)
        for p in pages:
            if not 1 <= p <= self.num_pages:
                raise ValueError(f"slot page {p} is outside the pool (padding page 0 is never allocated)")
            if not self._owned[p]:
                raise ValueError(f"double free: page {p} is not allocated")
        if ps == 1 and len(set(pages)) != len(pages):
            raise ValueError("double free: a slot is named twice in one free()")
        for p in pages:
            self._owned[p] = 0
        self.release_pages.extend(pages)

    def is_allocated(self, slot: int) -> bool:
        """Whether the page holding ``slot`` is currently handed out (for invariant checks)."""
        page = slot // self.page_size
        return 1 <= page <= self.num_pages and bool(self._owned[page])
