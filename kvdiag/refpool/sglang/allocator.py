"""SGLang's device KV slot allocator (L1 pool).

Mirrors ``mem_cache/allocator/token.py`` (page_size 1) and ``allocator/paged.py`` (page_size > 1)
of SGLang 0.5.23 as the scheduler builds them outside PD disaggregation (``need_sort=False``,
``kv_cache_configurator.py``): the pool is a free list of pages; ``alloc`` takes pages from its
front; ``free`` returns slots to its back in the order given (page_size 1, ``token.py``) or pages
to its *front* (paged, ``_release_page_ids``: ``cat((page_ids, free_pages))``), each page once in
the order of the freed row (``free_segment``). Page 0 is reserved as padding, as
in SGLang (``free_pages = arange(1, num_pages + 1)``), so usable slots are ``page_size ..
(num_pages + 1) * page_size - 1``; with page_size 1 that is ``1..size``.

The allocator counts slots, never bytes: the KV bytes live in the ``KVStore``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

_VECTOR_MIN = 64  # below this many pages a Python loop beats numpy's per-call overhead


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
        # SGLang's free_pages tensor as a list read from ``_head``: slicing the front off a list
        # costs a copy of the rest, so the consumed prefix is dropped only once it is half.
        self._free: list[int] = list(range(1, self.num_pages + 1))
        self._head = 0
        self._owned = bytearray(self.num_pages + 1)  # 1 where a page is allocated
        self._owned_view = np.frombuffer(self._owned, dtype=np.uint8)  # the same bytes, for numpy
        self._group: list[int] | None = None  # pages freed inside an open free group, in order

    def available_size(self) -> int:
        """Free slots."""
        return self.num_free_pages() * self.page_size

    def num_free_pages(self) -> int:
        return len(self._free) - self._head

    def alloc(self, need_size: int) -> list[int] | None:
        """``need_size`` slots (whole pages), or None when the pool cannot serve them.

        The paged allocator asserts ``need_size % page_size == 0``; callers round up to pages.
        """
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not a whole number of {self.page_size}-token pages")
        num_pages = need_size // self.page_size
        if num_pages > self.num_free_pages():
            return None
        if num_pages == 0:
            return []
        head = self._head
        pages = self._free[head : head + num_pages]
        self._head = head = head + num_pages
        if head > len(self._free) // 2:
            del self._free[:head]
            self._head = 0
        taken = self._flip_owned(pages, 0)
        assert taken is None, f"page {taken} on the free list is allocated"
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
        pages = list(dict.fromkeys(i // ps for i in free_index)) if ps > 1 else free_index
        if not pages:
            return
        if len(pages) < _VECTOR_MIN:
            idx = None
            out_of_pool = min(pages) < 1 or max(pages) > self.num_pages
            named_twice = ps == 1 and len(set(pages)) != len(pages)
        else:  # one conversion serves the range, duplicate and ownership checks
            idx = np.fromiter(pages, np.intp, len(pages))
            out_of_pool = bool(idx.min() < 1 or idx.max() > self.num_pages)
            named_twice = ps == 1 and not out_of_pool and _has_duplicates(idx)
        if out_of_pool:
            p = next(p for p in pages if not 1 <= p <= self.num_pages)
            raise ValueError(f"slot page {p} is outside the pool (padding page 0 is never allocated)")
        if named_twice:
            raise ValueError("double free: a slot is named twice in one free()")
        not_owned = self._flip_owned(pages, 1, idx)
        if not_owned is not None:
            raise ValueError(f"double free: page {not_owned} is not allocated")
        if ps == 1:
            self._free.extend(pages)
        elif self._group is not None:
            self._group.extend(pages)
        else:
            self._free[self._head : self._head] = pages

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Hold the paged frees until the group ends, then return them to the front in one block
        (``free_group_begin`` / ``free_group_end``: ``free_page_ids_group`` concatenated in call
        order). SGLang opens a group around each batch's result processing, so the pages of
        several finishing requests come back first-released first, where separate frees would
        put the last one first. Page size 1 appends to the back either way."""
        assert self._group is None, "free groups cannot be nested"
        self._group = []
        try:
            yield
        finally:
            pages, self._group = self._group, None
            self._free[self._head : self._head] = pages

    def _flip_owned(self, pages: Sequence[int], expect: int, idx: np.ndarray | None = None) -> int | None:
        """Flip the ownership flag of every page from ``expect``; if one is not ``expect``,
        change nothing and return it. Vectorised past a few dozen pages (``idx``: the pages as
        an index array, when the caller has it): a prefill takes and an eviction frees
        thousands of slots at a time."""
        owned = self._owned
        if len(pages) < _VECTOR_MIN:
            for p in pages:
                if owned[p] != expect:
                    return p
            for p in pages:
                owned[p] = 1 - expect
            return None
        if idx is None:
            idx = np.fromiter(pages, np.intp, len(pages))
        view = self._owned_view
        wrong = view[idx] != expect
        if wrong.any():
            return pages[int(np.argmax(wrong))]
        view[idx] = 1 - expect
        return None

    def is_allocated(self, slot: int) -> bool:
        """Whether the page holding ``slot`` is currently handed out (for invariant checks)."""
        page = slot // self.page_size
        return 1 <= page <= self.num_pages and bool(self._owned[page])


def _has_duplicates(idx: np.ndarray) -> bool:
    """Whether an index array names a value twice (a sort in C beats a Python set here)."""
    s = np.sort(idx)
    return bool((s[1:] == s[:-1]).any())
