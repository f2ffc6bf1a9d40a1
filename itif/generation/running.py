"""The running batch: the decoder rows of every admitted request, their cache, and one step.

``RunningBatch`` owns the KV pool and the row table (``itif.generation.cache``) and turns the
requests it holds into the three forward calls of ``itif.generation.model``. Rows are kept in
the search's order (a request's rows contiguous, new requests appended at the end; the same
order ``SearchBatch`` uses); each forward call runs them in *forward order*, a stable sort by
tenant, so every tenant's rows are contiguous for the grouped GEMMs, and its logits are
scattered back. Everything derived from the membership (forward order, GEMM plans, the
cross-attention groups) is rebuilt only when requests join or leave; a plain decode step reads
three device tables and launches the forward.

Per request the host keeps a few numbers in parallel numpy arrays (tenant, rows, positions
filled, source length, where its rows' own blocks start and how many each holds) and its cache
blocks; per-request device data (its source's pool locations) sits in a ``[requests, S]`` table
compacted like the row table.

The cache is taken on demand (decoder-only): a request joins with its prompt's blocks, full
ones found in or added to its tenant's prefix cache (``cache.prefix_digests``), and each row
takes a block whenever it crosses into one (``grow``, before the decode that writes there, all
rows at once); ``grow_need`` tells the engine how many the next decode takes, so it can preempt
first. A resumed request (``JoiningRequest.histories``) recomputes its rows' histories at admission.
Encoder-decoder requests reserve everything at join, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from itif.generation import llama
from itif.generation.cache import KVPool, RowTable, prefix_digests
from itif.generation.model import (
    CrossGroup,
    Scratch,
    SeqGroup,
    SlotMatrix,
    TenantParams,
    decode,
    encode,
    group_rows,
    prefill,
    rows_of_requests,
)
from itif.generation.spec import DecoderSpec
from itif.weights.store import WeightStore

#: Bytes one layer's gathered history may take while tokens past a cached prefix (or a resumed
#: request's generated tokens) are computed a row per token (``RunningBatch._compute``): each
#: row gathers its sequence's K/V, so the rows run in chunks that keep it under this.
RECOMPUTE_BYTES = 64 << 20


@dataclass
class JoiningRequest:
    """One request joining the running batch (not the server's admission gate,
    ``itif.server.admission.Admission``): ``source`` (encoder-decoder: the encoder input, else
    None), ``prompt`` (decoder-only: the prompt; encoder-decoder: ``[decoder_start_token_id]``),
    ``rows`` (beams or samples) and ``max_new_tokens``: the most generated tokens each row
    feeds back, so the cache positions it needs (the request's ``max_new_tokens`` - 1: the
    last token is never fed, as in ``generate()``)."""

    key: Hashable
    tenant: str
    prompt: Sequence[int]
    rows: int
    max_new_tokens: int
    source: Sequence[int] | None = None
    #: a preempted request resuming (decoder-only): each row's history so far (``prompt`` and
    #: its generated tokens, all of one length), recomputed into the blocks it held before
    histories: Sequence[Sequence[int]] | None = None


class RunningBatch:
    def __init__(self, spec: DecoderSpec, store: WeightStore, kv_cache_bytes: int,
                 block: int = 16, before_forward: Callable[[set[str]], None] | None = None,
                 lora=None) -> None:
        self.spec, self.store = spec, store
        self.lora = lora  # the engine's LoraBank (itif.generation.decoder_lora), or None
        # test hook (itif.faults): called with the tenants of each forward before it runs
        self.before_forward = before_forward
        self.device, self.dtype = store.device, store.dtype
        self.pool = KVPool(
            spec.dec_layers, spec.kv_width, kv_cache_bytes, self.device, self.dtype, block
        )
        # the decoder-only forward: ``llama``'s for that family, else ``model``'s (looked up at
        # each call, so a test that replaces this module's ``prefill`` or ``decode`` sees it)
        self._llama = spec.family == "llama"
        self.table = RowTable(spec.max_len, self.device)
        self.last = torch.zeros(0, dtype=torch.int64, device=self.device)  # each row's next input
        n0 = np.zeros(0, np.int64)
        self.rid, self.tenant, self.nrows, self.length, self.src_len = n0, n0, n0, n0, n0
        # per request: the first position of its rows' own blocks, the positions they may
        # fill there, and the own blocks each row holds so far (taken as the rows grow)
        self.start, self.maxgen, self.own = n0, n0, n0
        self.src_loc = torch.zeros(0, spec.max_position, dtype=torch.int64, device=self.device)
        self._scratch = Scratch()  # the decode step's gather buffers, reused step after step
        self.blocks: dict[int, list[int]] = {}  # request id -> the blocks it joined with
        self._grown, self._grown_rid = n0, n0  # blocks taken as rows grew, and their requests
        self.ids: dict[Hashable, int] = {}  # key -> request id
        self._next = 0
        self._sm: SlotMatrix | None = None
        self._tids: dict[str, int] = {}  # tenant -> stable id (rows of the SlotMatrix)
        self._fwd = None  # cached forward structure of the current membership

    # ---- accounting ------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.table.rows

    @property
    def requests(self) -> int:
        return int(self.rid.size)

    def blocks_full(self, a: JoiningRequest) -> int:
        """Every block ``a`` may ever hold: what it needs to finish alone in the pool."""
        p = self.pool
        src = p.blocks_for(len(a.source)) if a.source is not None else 0
        return p.blocks_for(len(a.prompt)) + a.rows * p.blocks_for(a.max_new_tokens) + src

    def blocks_needed(self, a: JoiningRequest) -> int:
        """Free blocks ``a`` needs to join: encoder-decoder, all it may ever hold; decoder-only,
        its prompt's and, per row, those of its next position (a resumed request: and of the
        tokens it had generated)."""
        if self.spec.encoder_decoder:
            return self.blocks_full(a)
        p = self.pool
        gen = len(a.histories[0]) - len(a.prompt) if a.histories else 0
        return p.blocks_for(len(a.prompt)) + a.rows * min(p.blocks_for(gen + 1),
                                                          p.blocks_for(a.max_new_tokens))

    def fits(self, a: JoiningRequest) -> bool:
        return self.blocks_needed(a) <= self.pool.free_blocks

    def _deficit(self) -> np.ndarray:
        """Per request: blocks each of its rows must take before the next decode writes
        position ``length`` (0 unless that position starts a new block of the row's own)."""
        filled = np.minimum(self.length - self.start + 1, self.maxgen)
        return np.maximum(-(-filled // self.pool.block) - self.own, 0)

    def grow_need(self) -> int:
        """Blocks the next decode takes (rows crossing into a new block)."""
        return int((self._deficit() * self.nrows).sum()) if self.requests else 0

    def grow(self) -> None:
        """Give each row crossing into a new block that block (``grow_need`` must be free): one
        allocation and one row-table write for all of them, no loop over the requests."""
        d = self._deficit() if self.requests else np.zeros(0, np.int64)
        if not d.any():
            return
        row_d = np.repeat(d, self.nrows)  # blocks each row takes now
        rows = np.repeat(np.arange(row_d.size), row_d)  # one entry per new block
        req = np.repeat(np.arange(self.requests), self.nrows)[rows]
        nth = np.arange(rows.size) - np.repeat(np.cumsum(row_d) - row_d, row_d)
        blocks = np.asarray(self.pool.alloc(int(rows.size)), np.int64)
        self.table.fill(rows, self.start[req] + (self.own[req] + nth) * self.pool.block, blocks,
                        self.pool.block)
        self._grown_rid = np.concatenate([self._grown_rid, self.rid[req]])
        self._grown = np.concatenate([self._grown, blocks])
        self.own = self.own + d

    def newest(self) -> Hashable:
        """The key of the request that joined last (the one to preempt)."""
        rid = int(self.rid.max())
        return next(k for k, r in self.ids.items() if r == rid)

    def keys_of(self, tenant: str) -> list[Hashable]:
        """Keys of the running requests of ``tenant``."""
        tid = self._tids.get(tenant)
        if tid is None:
            return []
        mine = set(self.rid[self.tenant == tid].tolist())
        return [k for k, r in self.ids.items() if r in mine]

    def cross_positions(self, key: Hashable) -> int:
        """Pool positions holding ``key``'s cross-attention K/V (its source length, once)."""
        i = int(np.flatnonzero(self.rid == self.ids[key])[0])
        return int(self.src_len[i])

    def _slots(self) -> SlotMatrix:
        view = self.store.view
        if self._sm is None or self._sm.version != view.version:
            self._sm = SlotMatrix(self.spec, view, self._tids, self.lora)
            self._fwd = None
        return self._sm

    # ---- membership ------------------------------------------------------------------------
    def admit(self, items: Sequence[JoiningRequest]) -> torch.Tensor:
        """Take the cache of ``items`` (all must fit: ``blocks_needed``), run their encoder /
        prompt, append their rows. Returns the logits of the new rows [sum rows, V] (each
        request's first-step logits, repeated over its rows; a resumed request's, each row's
        own). If it raises, nothing of ``items`` stays: their blocks are free again and the
        running rows are as they were."""
        spec, pool, dev = self.spec, self.pool, self.device
        sm = self._slots()
        n = len(items)
        tenant = np.array([sm.tenant_index[a.tenant] for a in items], np.int64)
        rows = np.array([a.rows for a in items], np.int64)
        plen = np.array([len(a.prompt) for a in items], np.int64)
        rids = np.arange(self._next, self._next + n, dtype=np.int64)
        self._next += n
        made: list[int] = []  # prefix blocks named here (forgotten again if this fails)
        try:  # a failure (out of memory, most often) leaves the batch as it was
            if spec.encoder_decoder:
                prompt_locs, own, src_locs, logits = self._admit_enc_dec(items, rids, tenant, sm)
                length = plen
            else:
                prompt_locs, own, length, logits = self._admit_decoder(items, rids, tenant, sm,
                                                                       made)
        except BaseException:
            for b in made:
                pool.forget(b)
            for a, rid in zip(items, rids.tolist()):
                blocks = self.blocks.pop(rid, None)
                if blocks is not None:
                    pool.release(blocks)
                if self.ids.get(a.key) == rid:
                    del self.ids[a.key]
            raise
        for pl, ow, m in zip(prompt_locs, own, length):
            self.table.add(pl, ow, m)
        self.last = torch.cat(
            [self.last, torch.zeros(int(rows.sum()), dtype=torch.int64, device=dev)]
        )
        self.rid = np.concatenate([self.rid, rids])
        self.tenant = np.concatenate([self.tenant, tenant])
        self.nrows = np.concatenate([self.nrows, rows])
        self.length = np.concatenate([self.length, length]).astype(np.int64)
        self.start = np.concatenate([self.start, plen])
        self.maxgen = np.concatenate([self.maxgen, [a.max_new_tokens for a in items]]
                                     ).astype(np.int64)
        held = [o.shape[1] // pool.block if not spec.encoder_decoder
                else pool.blocks_for(a.max_new_tokens) for a, o in zip(items, own)]
        self.own = np.concatenate([self.own, held]).astype(np.int64)
        if spec.encoder_decoder:
            self.src_len = np.concatenate([self.src_len, [len(a.source) for a in items]]
                                          ).astype(np.int64)
            new_src = torch.zeros(n, self.src_loc.shape[1], dtype=torch.int64, device=dev)
            adm = torch.nn.utils.rnn.pad_sequence(src_locs, batch_first=True)  # admission order
            new_src[:, : adm.shape[1]] = adm
            self.src_loc = torch.cat([self.src_loc, new_src])
        else:
            self.src_len = np.concatenate([self.src_len, np.zeros(n, np.int64)])
        self._fwd = None
        return logits

    def _admit_enc_dec(self, items, rids, tenant, sm):
        """BART, Marian: every block reserved at once (source, start token, ``max_new_tokens``
        per row: these requests are never preempted); the encoder, then the start token."""
        spec, pool, dev = self.spec, self.pool, self.device
        n = len(items)
        prompt_locs, own, src_locs = [], [], []
        for a, rid in zip(items, rids.tolist()):  # admission: once per joining request
            src = pool.blocks_for(len(a.source))
            pb, gb = pool.blocks_for(len(a.prompt)), pool.blocks_for(a.max_new_tokens)
            self.ids[a.key] = rid
            blocks = self.blocks[rid] = pool.alloc(pb + a.rows * gb + src)
            prompt_locs.append(pool.locations(blocks[:pb], len(a.prompt)))
            own.append(pool.locations(blocks[pb:pb + a.rows * gb], a.rows * gb * pool.block)
                       .view(a.rows, gb * pool.block)[:, :a.max_new_tokens])
            src_locs.append(pool.locations(blocks[pb + a.rows * gb:], len(a.source)))
        order, tenant_ids, row_tenant = group_rows(tenant)  # new requests in forward order
        if self.before_forward is not None:
            self.before_forward({a.tenant for a in items})
        P = TenantParams(sm, tenant_ids, row_tenant, dev, self.dtype)
        slen = np.array([len(a.source) for a in items], np.int64)
        sstart, _ = rows_of_requests(slen[order])
        tok_tenant = np.repeat(row_tenant, slen[order])
        Ptok = TenantParams(sm, tenant_ids, tok_tenant, dev, self.dtype)
        ids, pos = _packed([items[i].source for i in order], slen[order], dev)
        sloc = torch.cat([src_locs[i] for i in order])
        encode(spec, Ptok, pool.kv, ids, pos, SeqGroup.build(sstart, slen[order], dev), sloc)
        # The first step's cross-attention reads only as many source columns as the longest
        # new source (padding masked, and read at the request's own first source position),
        # not the table's full width.
        packed = torch.nn.utils.rnn.pad_sequence([src_locs[i] for i in order], batch_first=True)
        cross = CrossGroup.build(SeqGroup.build(np.arange(n), np.ones(n, np.int64), dev), packed,
                                 slen[order])
        start = torch.tensor([items[i].prompt[0] for i in order], device=dev)
        loc = torch.stack([prompt_locs[i] for i in order])  # [n, 1]
        logits_f = decode(spec, P, pool.kv, start, torch.zeros(n, dtype=torch.int64, device=dev),
                          loc, cross)
        logits = torch.empty_like(logits_f)
        logits[torch.as_tensor(order, device=dev)] = logits_f  # back to admission order
        reps = torch.as_tensor([a.rows for a in items], device=dev)
        return prompt_locs, own, src_locs, logits.repeat_interleave(reps, dim=0)

    def remove(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """Drop ``keys``' rows and free their blocks. Returns ``keep``: the surviving rows'
        indices in the old order (as ``SearchBatch.remove`` does)."""
        gone = np.array([self.ids.pop(k) for k in keys], np.int64)
        drop = np.isin(self.rid, gone)
        for rid in gone.tolist():
            self.pool.release(self.blocks.pop(rid))
        if self._grown.size:
            mine = np.isin(self._grown_rid, gone)
            self.pool.release(self._grown[mine])
            self._grown, self._grown_rid = self._grown[~mine], self._grown_rid[~mine]
        keep_req = np.flatnonzero(~drop)
        keep = torch.as_tensor(np.flatnonzero(np.repeat(~drop, self.nrows)), dtype=torch.int64,
                               device=self.device)
        self.table.compact(keep)
        self.last = self.last.index_select(0, keep)
        kr = torch.as_tensor(keep_req, dtype=torch.int64, device=self.device)
        if self.spec.encoder_decoder:
            self.src_loc = self.src_loc.index_select(0, kr)
        self.rid, self.tenant, self.nrows = (
            self.rid[keep_req],
            self.tenant[keep_req],
            self.nrows[keep_req],
        )
        self.length, self.src_len = self.length[keep_req], self.src_len[keep_req]
        self.start, self.maxgen = self.start[keep_req], self.maxgen[keep_req]
        self.own = self.own[keep_req]
        self._fwd = None
        return keep

    def _admit_decoder(self, items, rids, tenant, sm, made: list[int]):
        """Decoder-only: the prompt's blocks (shared by the request's rows), full blocks found
        in the tenant's prefix cache or named there (``made``); a resumed request's rows also
        take their own blocks for the tokens they had generated (as they held them before).
        Then the tokens past the cached prefix run (``_compute``): the prompt, and a resumed
        request's rows' generated tokens. The block of the prompt's last token is always
        computed (its logits start the request)."""
        pool, dev, B = self.pool, self.device, self.pool.block
        view = self.store.view
        segs = []  # (tokens, first position computed, locations, tenant) of each sequence
        pick, prompt_locs, own, lengths = [], [], [], []  # pick: each new row's logits' segment
        for a, rid, tid in zip(items, rids.tolist(), tenant.tolist()):
            self.ids[a.key] = rid
            blocks = self.blocks[rid] = []
            h, n = list(a.prompt), len(a.prompt)
            key, hit, cached = (a.tenant, view.tenants[a.tenant].generation), True, 0
            for i, d in enumerate(prefix_digests(key, h, B)):
                # the block of the last token is computed (its logits are needed)
                b = pool.lookup(d) if hit and i < (n - 1) // B else None
                if b is None:
                    hit = False
                    b = pool.alloc(1)[0]
                    if pool.find(d) is None:  # not cached yet: this block will be
                        pool.register(d, b)
                        made.append(b)
                else:
                    cached += 1
                blocks.append(b)
            blocks.extend(pool.alloc(pool.blocks_for(n) - n // B))  # the partial block
            pl = pool.locations(blocks, n)
            prompt_locs.append(pl)
            segs.append((h, cached * B, pl, tid))
            if not a.histories:  # every row starts from the prompt's last logits
                pick.extend([len(segs) - 1] * a.rows)
                own.append(torch.zeros(a.rows, 0, dtype=torch.int64, device=dev))
                lengths.append(n)
                continue
            m = len(a.histories[0])  # resumed: each row's generated tokens in its own blocks
            k = pool.blocks_for(m - n)
            ob = pool.alloc(a.rows * k)
            blocks.extend(ob)
            ol = pool.locations(ob, a.rows * k * B).view(a.rows, k * B)
            own.append(ol)
            lengths.append(m)
            for r, hr in enumerate(a.histories):
                pick.append(len(segs))
                segs.append((list(hr), n, torch.cat([pl, ol[r, :m - n]]), tid))
        if self.before_forward is not None:
            self.before_forward({a.tenant for a in items})
        logits = self._compute(segs, sm)
        return prompt_locs, own, lengths, logits[torch.as_tensor(pick, device=dev)]

    def _compute(self, segs, sm) -> torch.Tensor:
        """The K/V of each sequence ``(tokens, c, locations, tenant)`` of ``segs`` from its
        position ``c`` on, and the logits of its last token [sequences, V]. First the ones with
        nothing cached (``c`` = 0), in one packed ``prefill``; then the others in ``decode``
        calls, a row per token, every layer writing all rows' K/V before any row attends, so a
        token sees the cached positions and the tokens before it (through its sequence's
        locations) as in a prefill. Their tokens go in sequence order, in chunks whose gathered
        history stays under ``RECOMPUTE_BYTES`` a layer: a chunk reads only what it or earlier
        chunks (or the prefill) wrote."""
        spec, pool, dev = self.spec, self.pool, self.device
        t = lambda a: torch.as_tensor(np.asarray(a, np.int64), device=dev)  # noqa: E731 (a one-line local helper)
        stenant = np.array([q[3] for q in segs], np.int64)
        slen = np.array([len(q[0]) for q in segs], np.int64)
        c0 = np.array([q[1] for q in segs], np.int64)
        out: torch.Tensor | None = None
        fresh = np.flatnonzero(c0 == 0)
        if fresh.size:  # nothing cached: their packed prefill
            order, tenant_ids, row_tenant = group_rows(stenant[fresh])
            f = fresh[order]
            pstart, _ = rows_of_requests(slen[f])
            Ptok = TenantParams(sm, tenant_ids, np.repeat(row_tenant, slen[f]), dev, self.dtype)
            ids, pos = _packed([segs[i][0] for i in f], slen[f], dev)
            wloc = torch.cat([segs[i][2] for i in f])
            run = llama.prefill if self._llama else prefill
            lf = run(spec, Ptok, pool.kv, ids, pos, SeqGroup.build(pstart, slen[f], dev), wloc,
                     pstart + slen[f] - 1)
            out = lf.new_empty(len(segs), lf.shape[1])
            out[t(f)] = lf
        rest = np.flatnonzero(c0 > 0)
        if not rest.size:
            return out
        cnt = slen[rest] - c0[rest]
        seg = np.repeat(rest, cnt)  # each token row's sequence
        ids = np.concatenate([segs[i][0][c0[i]:] for i in rest])
        pos = np.concatenate([np.arange(c0[i], slen[i]) for i in rest])
        is_last = np.zeros(seg.size, bool)
        is_last[np.cumsum(cnt) - 1] = True
        loc = torch.nn.utils.rnn.pad_sequence([segs[i][2] for i in rest], batch_first=True)
        row = np.zeros(len(segs), np.int64)
        row[rest] = np.arange(rest.size)  # sequence -> its row of ``loc``
        per = max(1, RECOMPUTE_BYTES // (loc.shape[1] * pool.kv.shape[2] * pool.kv.element_size()))
        run = llama.decode if self._llama else decode
        for a in range(0, seg.size, per):
            order, tenant_ids, row_tenant = group_rows(stenant[seg[a:a + per]])
            k = a + order  # this chunk's token rows, in forward order
            L = int(pos[k].max()) + 1
            lk = run(spec, TenantParams(sm, tenant_ids, row_tenant, dev, self.dtype), pool.kv,
                     t(ids[k]), t(pos[k]), loc[t(row[seg[k]]), :L], None)
            if out is None:
                out = lk.new_empty(len(segs), lk.shape[1])
            done = np.flatnonzero(is_last[k])
            if done.size:
                out[t(seg[k[done]])] = lk[t(done)]
        return out

    # ---- one step ----------------------------------------------------------------------------
    def _structure(self, sel: np.ndarray | None = None):
        """(perm, P, cross) of a decode over every row, cached per membership; or over the rows
        of the requests at indices ``sel`` (ascending), built each call. ``perm``: the rows, as
        indices into the row table, in forward order."""
        if sel is None and self._fwd is not None:
            return self._fwd
        sm = self._slots()
        req = np.arange(self.requests) if sel is None else sel
        tenant, nrows = self.tenant[req], self.nrows[req]
        perm, tenant_ids, row_tenant = group_rows(np.repeat(tenant, nrows))
        if sel is not None:  # subset rows -> row table rows
            perm = np.flatnonzero(np.isin(np.repeat(np.arange(self.requests), self.nrows), sel))[
                perm
            ]
        P = TenantParams(sm, tenant_ids, row_tenant, self.device, self.dtype)
        cross = None
        if self.spec.encoder_decoder:
            rorder = req[np.argsort(tenant, kind="stable")]  # requests in forward order
            starts, counts = rows_of_requests(self.nrows[rorder])
            S = max(int(self.src_len[rorder].max()), 1)
            ro = torch.as_tensor(rorder, device=self.device)
            cross = CrossGroup.build(SeqGroup.build(starts, counts, self.device),
                                     self.src_loc.index_select(0, ro)[:, :S], self.src_len[rorder],
                                     self.spec.dec_layers, 2 * self.spec.hidden,
                                     self.dtype.itemsize)
        fwd = (torch.as_tensor(perm, device=self.device), P, cross)
        if sel is None:
            self._fwd = fwd
        return fwd

    def _forward(self, fwd, L: int) -> torch.Tensor:
        """The decode forward of ``fwd``'s rows (writing their K/V at their next position);
        their logits in forward order."""
        perm, P, cross = fwd
        if self.before_forward is not None:
            ids = set(P.tenant_ids.tolist())
            self.before_forward({t for t, i in P.sm.tenant_index.items() if i in ids})
        pos = self.table.length.index_select(0, perm)
        loc = self.table.loc[:, :L].index_select(0, perm)
        run = llama.decode if self._llama else decode
        return run(self.spec, P, self.pool.kv, self.last.index_select(0, perm), pos, loc, cross,
                   self._scratch)

    def _advance(self) -> None:
        self.table.advance()
        self.length += 1

    def decode(self) -> torch.Tensor:
        """Run every row's input token (``last``) at its next position. Returns logits [rows, V]
        in row order, and advances the rows. If it raises, nothing has advanced (a K/V written
        at the next position is written again by the next try). Rows crossing into a new block
        take it first (``grow``: Overloaded if the pool has not room, as ``grow_need`` says)."""
        self.grow()
        fwd = self._structure()
        logits_f = self._forward(fwd, int(self.length.max()) + 1)
        logits = torch.empty_like(logits_f)
        logits[fwd[0]] = logits_f
        self._advance()
        return logits

    def decode_apart(self) -> tuple[torch.Tensor, dict[Hashable, Exception]]:
        """``decode`` after it failed (out of memory, most often): the requests run in halves,
        a half that fails is halved again, so a request fails only if it fails alone. Returns
        the logits [rows, V] in row order (a failed request's rows undefined) and each failed
        request's key and error; every row is advanced, so the caller removes the failed ones
        (``remove``) before the next step."""
        self.grow()
        logits: torch.Tensor | None = None
        failed: dict[int, Exception] = {}
        todo = np.array_split(np.arange(self.requests), 2)
        while todo:
            sel = todo.pop()
            if not sel.size:
                continue
            try:
                fwd = self._structure(sel)
                logits_f = self._forward(fwd, int(self.length[sel].max()) + 1)
            except Exception as e:  # noqa: BLE001 - isolated below, one request at the end
                if sel.size == 1:
                    failed[int(self.rid[sel[0]])] = e
                else:
                    todo.extend(np.array_split(sel, 2))
                continue
            if logits is None:
                logits = logits_f.new_empty(self.rows, logits_f.shape[1])
            logits[fwd[0]] = logits_f
        if logits is None:  # every request failed
            logits = torch.empty(self.rows, 0, dtype=self.dtype, device=self.device)
        self._advance()
        key_of = {rid: k for k, rid in self.ids.items()}
        return logits, {key_of[rid]: e for rid, e in failed.items()}

    def apply(self, tokens: torch.Tensor, parent: torch.Tensor) -> None:
        """The search's decision: row r continues row ``parent[r]`` and next feeds ``tokens[r]``."""
        self.table.reorder(parent)
        self.last = tokens.to(torch.int64)


__all__ = ["JoiningRequest", "RunningBatch"]


def _packed(seqs, lens: np.ndarray, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of ``seqs`` back to back, and each token's position in its sequence."""
    ids = torch.as_tensor(np.concatenate([np.asarray(q, np.int64) for q in seqs]), device=dev)
    pos = torch.arange(int(lens.sum()), device=dev) - torch.as_tensor(
        np.repeat(np.cumsum(lens) - lens, lens), device=dev)
    return ids, pos
