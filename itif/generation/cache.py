"""The decoder's key/value cache: one preallocated pool of blocks, and per-row location tables.

``KVPool``: a single tensor ``kv [decoder layers, blocks * B, 2H]`` (keys in the first H
columns, values in the last H), allocated once from a byte budget and handed out in blocks of
``B`` positions (a free list on the host). Both caches live in it:

* self-attention: the K/V of every decoder position of every sequence;
* cross-attention (encoder-decoder): each source sequence's encoder K/V per decoder layer,
  written once when the request joins and read by all of its beams (one copy per source).

A request reserves all its blocks when it joins (prompt, ``max_new_tokens`` positions per row,
its source), so a running request never runs out; one that does not fit waits.

``RowTable``: per running row, ``loc [rows, W]`` (the flat pool position holding position ``t``
of the row's history) and ``length [rows]`` (positions filled). A new row's table holds its
request's prompt locations (shared by all its rows: the prompt is computed once) followed by
locations from the row's own blocks. Beam reordering copies table rows, never cache contents:
row ``r`` continuing row ``parent[r]`` takes ``parent``'s locations for the positions already
filled and keeps its own for the positions still to come, which nobody has written or read. So
position ``t`` of a beam's history may sit in the blocks of whichever row produced it.
"""

from __future__ import annotations

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

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def alloc(self, n: int) -> list[int]:
        """``n`` block ids; Overloaded when fewer are free (callers check ``free_blocks``)."""
        if n > len(self._free):
            raise Overloaded(f"the KV cache has {len(self._free)} free blocks, {n} needed")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def locations(self, blocks: list[int], n: int) -> torch.Tensor:
        """The first ``n`` flat positions of ``blocks`` in order (int64, on the pool's device)."""
        b = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        return (b[:, None] * self.block + torch.arange(self.block, device=b.device)).reshape(-1)[:n]


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

    def add(self, prompt_locs: torch.Tensor, own_locs: torch.Tensor) -> None:
        """Append rows sharing one prompt's locations [P], each with its own [rows, G]."""
        n, g = own_locs.shape
        p = prompt_locs.numel()
        new = torch.zeros(n, self.width, dtype=torch.int64, device=self.device)
        new[:, :p] = prompt_locs
        new[:, p:p + g] = own_locs
        self.loc = torch.cat([self.loc, new])
        self.length = torch.cat([self.length, torch.full((n,), p, dtype=torch.int64, device=self.device)])

    def advance(self) -> None:
        """Every row's input token has been written at position ``length``."""
        self.length += 1

    def reorder(self, parent: torch.Tensor) -> None:
        """Row ``r`` continues ``parent[r]``'s history (filled positions); its own later ones stay."""
        filled = self._cols[None, :] < self.length[:, None]
        self.loc = torch.where(filled, self.loc.index_select(0, parent), self.loc)

    def compact(self, keep: torch.Tensor) -> None:
        self.loc = self.loc.index_select(0, keep)
        self.length = self.length.index_select(0, keep)


__all__ = ["KVPool", "RowTable"]
