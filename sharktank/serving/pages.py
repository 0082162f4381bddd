"""Bookkeeping for a paged KV cache: which pages each sequence owns and which are shared.

Device memory is a pool of ``num_pages`` pages of ``page_size`` token positions; a sequence
owns an ordered list of page ids, and its position ``p`` lives in page ``pages[p // page_size]``,
slot ``p % page_size``. Every page has a reference count (the open sequences holding it). A
full page whose KV entries were written is *committed*: registered in a prefix cache under a
hash-chain key, the SHA-256 of its parent page's key and its own tokens, so a key names the
whole prefix up to the end of that page, not just the page. A new sequence takes references on
the longest cached chain of its prompt's full pages instead of prefilling them. A cached page
whose count drops to zero stays cached but becomes evictable; ``extend`` takes free pages first,
then evicts the least recently released cached page. The invariant that makes sharing safe:
only full, committed pages are ever shared, and committed pages are immutable (a sequence only
writes positions past its committed pages, into pages it alone holds), so no request ever
writes a page another reads. Pure bookkeeping: no tensors, no threads.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["PoolExhausted", "Allocation", "PagePool"]

_ROOT = b""  # the chain key "before" a sequence's first page


class PoolExhausted(Exception):
    """For callers that treat a refused :meth:`PagePool.extend` as an error (the pool itself
    never raises it: ``extend`` returns False)."""


@dataclass
class Allocation:
    """One sequence's pages. ``pages[:committed]`` are in the prefix cache (shared, immutable);
    the first ``cached_tokens`` positions were found there by :meth:`PagePool.open`."""

    pages: list[int]
    cached_tokens: int
    committed: int
    _key: bytes = field(default=_ROOT, repr=False)  # chain key of pages[committed - 1]
    _stopped: bool = field(default=False, repr=False)  # a duplicate key ended the chain
    _closed: bool = field(default=False, repr=False)


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding ``tokens`` after the prefix whose last page has key ``parent``."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class PagePool:
    """A pool of KV-cache pages with reference counts and an LRU prefix cache."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        self._used = 0
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._cache: dict[bytes, int] = {}  # chain key -> page
        self._key_of: dict[int, bytes] = {}  # page -> chain key, for every cached page
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with no refs, oldest first
        self._hits = 0
        self._lookups = 0

    @property
    def free(self) -> int:
        """Pages neither referenced nor cached (allocatable without evicting)."""
        return len(self._free)

    @property
    def cached_unreferenced(self) -> int:
        """Cached pages no sequence holds (evictable, least recently released first)."""
        return len(self._lru)

    @property
    def used(self) -> int:
        """Pages held by at least one open sequence."""
        return self._used

    @property
    def available(self) -> int:
        """Pages ``extend`` can hand out: free ones, then evicted cached ones."""
        return self.free + self.cached_unreferenced

    def pages_for(self, tokens: int) -> int:
        """How many pages cover ``tokens`` positions."""
        return -(-tokens // self.page_size)

    def ref_count(self, page: int) -> int:
        """How many open sequences hold ``page``."""
        return self._refs[page]

    def open(self, tokens: Sequence[int], *, record: bool = True) -> Allocation:
        """Start a sequence for prompt ``tokens``, holding the longest cached chain of its full
        pages, at most ``(len(tokens) - 1) // page_size`` of them so that at least the last
        prompt token is prefilled (its logits give the first output token). ``record``: count
        the lookup in :meth:`stats` (False for a try that may be closed at once: then
        :meth:`record` it if it is kept)."""
        ps, key, pages = self.page_size, _ROOT, []
        for i in range(max(0, (len(tokens) - 1) // ps)):
            child = _chain(key, tokens[i * ps : (i + 1) * ps])
            page = self._cache.get(child)
            if page is None:
                break
            self._take(page)
            pages.append(page)
            key = child
        alloc = Allocation(pages, len(pages) * ps, len(pages), _key=key)
        if record:
            self.record(alloc)
        return alloc

    def record(self, alloc: Allocation) -> None:
        """Count ``alloc``'s lookup and the tokens it found cached in :meth:`stats`."""
        self._lookups += 1
        self._hits += alloc.cached_tokens

    def extend(self, alloc: Allocation, positions: int) -> bool:
        """Give ``alloc`` pages covering ``positions`` positions, free pages first, then evicting
        the least recently released cached ones. If too few are available, change nothing and
        return False."""
        self._check_open(alloc)
        need = self.pages_for(positions) - len(alloc.pages)
        if need > self.available:
            return False
        for _ in range(need):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._cache[self._key_of.pop(page)]
            self._take(page)
            alloc.pages.append(page)
        return True

    def commit(self, alloc: Allocation, tokens: Sequence[int], written: int) -> None:
        """Record that the first ``written`` positions of ``alloc`` (``tokens``, its token ids)
        hold their KV entries, and register each newly full page in the prefix cache.

        If a page's key is already cached by another page (two sequences prefilled the same
        prefix at once), the existing page stays cached and this one private. Committing then
        stops for good for this allocation: ``committed`` counts a leading run of cached pages,
        so no later page may be cached behind a private one. Only reuse of this sequence's
        tail is lost, and the sequence that won usually commits the same tail itself."""
        self._check_open(alloc)
        ps = self.page_size
        if not alloc.committed * ps <= written <= min(len(tokens), len(alloc.pages) * ps):
            raise ValueError(
                f"written {written} outside [{alloc.committed * ps}, min(tokens {len(tokens)}, "
                f"{len(alloc.pages)} pages x {ps})]"
            )
        if alloc._stopped:
            return
        for i in range(alloc.committed, written // ps):
            key = _chain(alloc._key, tokens[i * ps : (i + 1) * ps])
            if key in self._cache:
                alloc._stopped = True
                return
            page = alloc.pages[i]
            self._cache[key], self._key_of[page] = page, key
            alloc.committed, alloc._key = i + 1, key

    def close(self, alloc: Allocation) -> None:
        """Release ``alloc``: committed pages nobody else holds become cached-unreferenced (most
        recently released), the others free. Closing twice raises ValueError."""
        self._check_open(alloc)
        alloc._closed = True
        # The last page is released first, so the oldest end of the LRU holds the tails of
        # prefixes: eviction then shortens a cached chain rather than orphaning its tail.
        for page in reversed(alloc.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._used -= 1
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def stats(self) -> dict:
        """Counts for metrics: ``hits`` is prompt tokens served from the cache in all, and
        ``lookups`` the number of :meth:`open` calls."""
        return {
            "pages": self.num_pages,
            "used": self.used,
            "free": self.free,
            "cached": len(self._cache),
            "hits": self._hits,
            "lookups": self._lookups,
        }

    def check(self) -> None:
        """Raise AssertionError if the internal books disagree (for tests and debugging)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert all(self._refs[p] == 0 and p not in self._key_of for p in free), "free page in use"
        assert self._used == sum(r > 0 for r in self._refs), "used count is off"
        assert all(self._cache.get(k) == p for p, k in self._key_of.items()), "key maps elsewhere"
        assert len(self._cache) == len(self._key_of), "cache and key map differ"
        assert all(self._refs[p] == 0 and p in self._key_of for p in self._lru), "bad LRU entry"
        assert len(free) + self._used + len(self._lru) == self.num_pages, "pages lost"

    def _take(self, page: int) -> None:
        if self._refs[page] == 0:
            self._used += 1
            self._lru.pop(page, None)
        self._refs[page] += 1

    def _check_open(self, alloc: Allocation) -> None:
        if alloc._closed:
            raise ValueError(f"allocation of pages {alloc.pages} is already closed")
