"""The decoder's key/value cache: one preallocated pool of blocks, and per-row location tables.

``KVPool``: a single tensor ``kv [decoder layers, blocks * B, 2H]`` (keys in the first H
columns, values in the last H), allocated once from a byte budget and handed out in blocks of
``B`` positions (a free list on the host, a reference count per block). Both caches live in it:

* self-attention: the K/V of every decoder position of every sequence;
* cross-attention (encoder-decoder): each source sequence's encoder K/V per decoder layer,
  written once when the request joins and read by all of its beams (one copy per source).

Blocks are taken as sequences grow (``itif.generation.running``): a decoder-only request takes
its prompt's blocks when it joins and each row one more block whenever its length crosses a
block boundary. Full prompt blocks are *prefix blocks*: named by a digest of (tenant and its
weights' upload, the block's tokens, the previous block's digest), so a tenant's requests with a
common prefix (a system prompt) share them, reference-counted. A prefix block nobody uses any
more stays cached in an LRU while the pool has room: it counts as free, and ``alloc`` evicts the
least recently released first.

``RowTable``: per running row, ``loc [rows, W]`` (the flat pool position holding position ``t``
of the row's history) and ``length [rows]`` (positions filled). A new row's table holds its
request's prompt locations (shared by all its rows: the prompt is computed once) followed by
locations from the row's own blocks, filled in block by block as the row grows. Beam
reordering copies table rows, never cache contents: row ``r`` continuing row ``parent[r]``
takes ``parent``'s locations for the positions already filled and keeps its own for the
positions still to come, which nobody has written or read. So position ``t`` of a beam's
history may sit in the blocks of whichever row produced it; a request holds all its rows'
blocks until it leaves.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from itif.errors import InvalidConfig, Overloaded


class KVPool:
    """``kv [layers, capacity, 2H]`` in blocks of ``block`` positions, zero-filled. Freed
    blocks keep their last K/V: attention never reads a masked position it does not own
    (``itif.generation.model.StepRows``)."""

    def __init__(self, layers: int, hidden: int, budget_bytes: int, device, dtype: torch.dtype,
                 block: int = 16) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.block = block
        self.block_bytes = layers * block * 2 * hidden * elem
        self.blocks = int(budget_bytes // self.block_bytes)
        if self.blocks < 1:
            raise InvalidConfig(f"kv_cache_bytes {budget_bytes} holds no block "
                                f"(one block is {self.block_bytes} bytes)")
        self.kv = torch.zeros(layers, self.blocks * block, 2 * hidden, dtype=dtype, device=device)
        self._free = list(range(self.blocks - 1, -1, -1))
        self._ref = np.zeros(self.blocks, np.int64)
        self._prefix = np.zeros(self.blocks, bool)  # block -> named by a digest
        self._digest_of: dict[int, bytes] = {}  # prefix block -> its digest
        self._by_digest: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unused prefix blocks, oldest first

    @property
    def free_blocks(self) -> int:
        """Blocks ``alloc`` can hand out: free ones and unused cached prefix blocks."""
        return len(self._free) + len(self._lru)

    @property
    def cached_blocks(self) -> int:
        """Unused prefix blocks kept for a later request (counted in ``free_blocks``)."""
        return len(self._lru)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def refcount(self, block: int) -> int:
        """The requests holding ``block`` (0: free, or a cached prefix block nobody uses)."""
        return int(self._ref[block])

    def alloc(self, n: int) -> list[int]:
        """``n`` block ids, each referenced once; unused prefix blocks are evicted (least
        recently released first) when the free list runs out. Overloaded when fewer than ``n``
        are free (callers check ``free_blocks``)."""
        if n > self.free_blocks:
            raise Overloaded(f"the KV cache has {self.free_blocks} free blocks, {n} needed")
        out = self._free[len(self._free) - min(n, len(self._free)):] if n else []
        del self._free[len(self._free) - len(out):]
        while len(out) < n:  # a cached prefix block's last user left long ago: its K/V go
            b, _ = self._lru.popitem(last=False)
            del self._by_digest[self._digest_of.pop(b)]
            self._prefix[b] = False
            out.append(b)
        self._ref[out] = 1
        return out

    def release(self, blocks) -> None:
        """One reference fewer to each of ``blocks`` (a list or an int array; a block shared by
        several of the requests leaving appears once per request); one left unused is free
        again (a prefix block: cached, evictable)."""
        idx = np.asarray(blocks, np.int64)
        if not idx.size:
            return
        np.subtract.at(self._ref, idx, 1)
        unused = np.unique(idx[self._ref[idx] == 0])
        named = self._prefix[unused]
        for b in unused[named].tolist():  # prompt blocks only: a few per request
            self._lru[b] = None
        self._free.extend(unused[~named].tolist())

    def lookup(self, digest: bytes) -> int | None:
        """The prefix block named ``digest``, referenced once more; None if not cached."""
        b = self._by_digest.get(digest)
        if b is not None:
            self._ref[b] += 1
            self._lru.pop(b, None)
        return b

    def find(self, digest: bytes) -> int | None:
        """The cached prefix block named ``digest`` (its reference count unchanged), or None."""
        return self._by_digest.get(digest)

    def register(self, digest: bytes, block: int) -> None:
        """``block`` (referenced, its K/V about to be written) is the prefix block ``digest``."""
        self._by_digest[digest] = block
        self._digest_of[block] = digest
        self._prefix[block] = True

    def forget(self, block: int) -> None:
        """``block`` is no prefix block any more (its K/V were never written)."""
        d = self._digest_of.pop(block, None)
        if d is not None:
            del self._by_digest[d]
            self._prefix[block] = False
            self._lru.pop(block, None)
            if self._ref[block] == 0:
                self._free.append(block)

    def locations(self, blocks: list[int], n: int) -> torch.Tensor:
        """The first ``n`` flat positions of ``blocks`` in order (int64, on the pool's device)."""
        b = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        return (b[:, None] * self.block + torch.arange(self.block, device=b.device)).reshape(-1)[:n]


def prefix_digests(tenant_key: tuple, tokens, block: int) -> list[bytes]:
    """The digest of each full block of ``tokens``: sha256 of the previous block's digest, the
    tenant key (its name and weights' upload: another tenant's, or re-uploaded weights, give
    other K/V for the same tokens) and the block's token ids."""
    out: list[bytes] = []
    prev = repr(tenant_key).encode()
    ids = np.asarray(tokens, np.int64)
    for i in range(len(ids) // block):
        prev = hashlib.sha256(prev + ids[i * block:(i + 1) * block].tobytes()).digest()
        out.append(prev)
    return out


class RowTable:
    """Cache locations of the running rows, in the search's row order."""

    def __init__(self, width: int, device) -> None:
        self.width = width
        self.device = torch.device(device)
        self.loc = torch.zeros(0, width, dtype=torch.int64, device=self.device)
        self.length = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._cols = torch.arange(width, device=self.device)

    @property
    def rows(self) -> int:
        return self.loc.shape[0]

    def add(self, prompt_locs: torch.Tensor, own_locs: torch.Tensor, length: int) -> None:
        """Append rows sharing one prompt's locations [P], each with its own [rows, G] (G may
        be 0: filled by ``fill`` as the rows grow), ``length`` positions filled (P, or more for
        a resumed request)."""
        n, g = own_locs.shape
        p = prompt_locs.numel()
        g = min(g, self.width - p)  # whole blocks may reach past the last position: never used
        new = torch.zeros(n, self.width, dtype=torch.int64, device=self.device)
        new[:, :p] = prompt_locs
        new[:, p:p + g] = own_locs[:, :g]
        self.loc = torch.cat([self.loc, new])
        self.length = torch.cat([self.length, torch.full((n,), int(length), dtype=torch.int64,
                                                         device=self.device)])

    def fill(self, rows: np.ndarray, start: np.ndarray, blocks: np.ndarray, block: int) -> None:
        """Row ``rows[i]``'s positions ``start[i] : start[i] + block`` are block ``blocks[i]``'s
        (host arrays: one new block each, all written at once; positions past the table's width
        are dropped: never written)."""
        cols = start[:, None] + np.arange(block)[None, :]
        ok = cols < self.width
        r = np.broadcast_to(rows[:, None], cols.shape)[ok]
        locs = (blocks[:, None] * block + np.arange(block)[None, :])[ok]
        t = lambda a: torch.as_tensor(a, dtype=torch.int64, device=self.device)  # noqa: E731 (a one-line local helper)
        self.loc[t(r), t(cols[ok])] = t(locs)

    def advance(self) -> None:
        """Every row's input token has been written at position ``length``."""
        self.length += 1

    def reorder(self, parent: torch.Tensor) -> None:
        """Row ``r`` continues ``parent[r]``'s history (filled positions); its own later ones
        stay."""
        filled = self._cols[None, :] < self.length[:, None]
        self.loc = torch.where(filled, self.loc.index_select(0, parent), self.loc)

    def compact(self, keep: torch.Tensor) -> None:
        self.loc = self.loc.index_select(0, keep)
        self.length = self.length.index_select(0, keep)


__all__ = ["KVPool", "RowTable", "prefix_digests"]
