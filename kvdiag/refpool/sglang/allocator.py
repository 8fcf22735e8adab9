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

Ownership is checked without touching the pages an ``alloc`` hands out (a decode step takes a
slot per running request, a prefill thousands): the free list is numbered in order, its front
page's number is ``_front``, and every page carries the number it had when it went on the list.
A page is free iff its number is at least ``_front``: ``alloc`` only moves ``_front`` past the
pages it takes. With page size 1 pages only join at the back, so numbers below ``_front`` stay
below it; paged frees join at the front, numbered downwards from ``_front``, so a paged
``alloc`` stamps the pages it takes below any number (``_TAKEN``).

The checks are SGLang's ``debug_mode`` (``SGLANG_DEBUG_MEMORY_POOL``), here on unless turned off:
an accounting-only run that the tests hold equal to a checked one step by step turns them off
(``stop_checking``), because numbering every freed page costs a sixth of its time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NoReturn, Sequence

import numpy as np

_VECTOR_MIN = 64  # below this many pages a Python loop beats numpy's per-call overhead
_TAKEN = -(1 << 62)  # the number of a page a paged alloc took: below every free-list number
_HELD = 1 << 62  # ... of a page freed inside an open free group: not allocated, not listed yet


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
        # Page p's free-list number (the module's docstring): page p starts as number p - 1;
        # the padding page 0 is never free.
        self._numbers = np.arange(-1, self.num_pages, dtype=np.int64)
        self._numbers[0] = _TAKEN
        self._number = self._numbers.data  # the same, read page by page as Python ints
        self._front = 0  # number of the free list's front page
        self._group: list[int] | None = None  # pages freed inside an open free group, in order
        self._checking = True  # the ownership and range checks (the module's docstring)

    @property
    def checking(self) -> bool:
        """Whether frees are checked (and pages numbered); ``stop_checking`` turns it off."""
        return self._checking

    def stop_checking(self) -> None:
        """Free and allocate without the checks from now on (SGLang's default). One way only:
        the page numbers are no longer kept, so they could not be trusted again, and
        ``is_allocated`` cannot answer."""
        self._checking = False

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
        self._front += num_pages
        ps = self.page_size
        if ps == 1:
            return pages
        if self._checking:
            self._stamp(pages, _TAKEN, 0)
        return [p * ps + o for p in pages for o in range(ps)]

    def free(self, free_index: Sequence[int]) -> None:
        """Release the pages holding ``free_index``.

        Like SGLang's paged ``free`` (``unique(free_index // page_size)``), naming any slot of a
        page frees the whole page. While checking, freeing a page that is not allocated raises:
        in SGLang that is silent pool corruption, here it is a bug in the model. A refused free
        changes nothing.
        """
        ps = self.page_size
        pages = list(dict.fromkeys(i // ps for i in free_index)) if ps > 1 else free_index
        if not pages:
            return
        n, front = len(pages), self._front
        if ps == 1:
            first = front + self.num_free_pages()  # to the back
        elif self._group is None:
            first = front - n  # to the front
        else:
            first = _HELD  # listed when the group ends
        if self._checking:
            self._check_and_number(pages, front, first)
        if ps == 1:
            self._free.extend(pages)
        elif self._group is not None:
            self._group.extend(pages)
        else:
            self._free[self._head : self._head] = pages
            self._front = first

    def _check_and_number(self, pages: Sequence[int], front: int, first: int) -> None:
        """Refuse (changing nothing) pages outside the pool, named twice or not allocated, and
        give the rest their free-list numbers from ``first``."""
        ps, n = self.page_size, len(pages)
        if n < _VECTOR_MIN:
            if min(pages) < 1 or max(pages) > self.num_pages:
                self._outside(pages)
            if ps == 1 and len(set(pages)) != n:
                raise ValueError("double free: a slot is named twice in one free()")
            number = self._number
            for p in pages:
                if number[p] >= front:
                    raise ValueError(f"double free: page {p} is not allocated")
            self._stamp(pages, first, 0 if first == _HELD else 1)
        else:  # one index array serves the range, duplicate and ownership checks
            idx = np.fromiter(pages, np.intp, n)
            if idx.min() < 1 or idx.max() > self.num_pages:
                self._outside(pages)
            numbers = self._numbers
            old = numbers[idx]
            if ps == 1:
                new = np.arange(first, first + n, dtype=np.int64)
                numbers[idx] = new
                if (numbers[idx] != new).any():  # a page named twice kept only its last number
                    numbers[idx] = old
                    raise ValueError("double free: a slot is named twice in one free()")
            not_allocated = old >= front
            if not_allocated.any():
                numbers[idx] = old
                raise ValueError(f"double free: page {pages[int(np.argmax(not_allocated))]} is not allocated")
            if ps > 1:
                numbers[idx] = first if first == _HELD else np.arange(first, first + n, dtype=np.int64)

    def _outside(self, pages: Sequence[int]) -> NoReturn:
        p = next(p for p in pages if not 1 <= p <= self.num_pages)
        raise ValueError(f"slot page {p} is outside the pool (padding page 0 is never allocated)")

    def _stamp(self, pages: Sequence[int], first: int, step: int = 1) -> None:
        """Number ``pages`` ``first``, ``first + step``, ... (step 0: ``_TAKEN`` / ``_HELD``)."""
        if len(pages) >= _VECTOR_MIN:
            idx = np.fromiter(pages, np.intp, len(pages))
            self._numbers[idx] = np.arange(len(pages), dtype=np.int64) * step + first if step else first
            return
        number = self._number
        for i, p in enumerate(pages):
            number[p] = first + i * step

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
            if pages:
                self._front -= len(pages)
                if self._checking:
                    self._stamp(pages, self._front)
                self._free[self._head : self._head] = pages

    def is_allocated(self, slot: int) -> bool:
        """Whether the page holding ``slot`` is currently handed out (for invariant checks)."""
        if not self._checking:
            raise RuntimeError("an allocator that stopped checking keeps no page numbers")
        page = slot // self.page_size
        return 1 <= page <= self.num_pages and self._number[page] < self._front
