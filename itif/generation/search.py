"""The decoding search of many requests in one running batch: greedy, beam search and sampling.

Call chain, one decoding iteration of the engine::

    GenEngine loop -> decoder forward (logits of each row's last position)
      -> SearchBatch.step(logits)              tokens, parent rows, finished keys
           greedy/sample rows: processors -> argmax | warpers -> softmax -> argmax(p / Exp noise)
           beam rows, per (num_beams, candidates) group: log_softmax -> processors -> + beam
             scores -> top 2*num_beams candidates -> running beams / finished hypotheses
      -> engine reorders its cache row tables by ``parent``, appends ``tokens``
      -> SearchBatch.remove(finished keys)     results, ``keep`` (to compact the engine's rows)

It reproduces ``transformers`` 5.x ``generate()`` (``_sample`` and ``_beam_search``) request by
request: the same float32 operations on the same per-request shapes (a beam request's top-k runs
over its own ``num_beams * vocab`` scores, as in ``generate()``), so the token ids are the ones
``generate()`` returns for that request alone, and beam scores are its ``sequences_scores``.
Sampling applies the same warpers and the same draw as ``torch.multinomial`` (``argmax(p / q)``,
``q ~ Exp(1)``), but ``q`` comes from a seeded hash (``processors.exponential_noise``), not from
torch's generator: a seed gives the same tokens whatever else is in the batch.

State: one entry per row in a dict of tensors (``self._t``), rows in the engine's order. A
request's rows are contiguous (``add`` appends, ``remove`` keeps the survivors' order); row
``j`` of a beam request is its running beam ``j`` and also holds its finished-hypothesis slot
``j`` (``generate()``'s ``beam_scores``/``sequences``, kept sorted best first). Per-request
parameters are copied onto each of its rows, so ``step`` works on tensors only: its Python loops
run over the modes and the distinct (num_beams, candidates) pairs, never over requests or rows.
A request whose search ended keeps its rows (they step as no-ops) until ``remove``.

What a request asks for (:class:`SearchParams`, resolved from the request and its checkpoint's
defaults by :func:`search_params`) and what it gets back (:class:`SearchResult`) are
``itif.generation.search_request``'s: this module only keeps the rows and steps them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from itif.errors import InvalidRequest
from itif.generation.processors import (
    ban_bad_words,
    ban_early_eos,
    ban_repeated_ngrams,
    force_tokens,
    sample_tokens,
    warp,
)
from itif.generation.search_request import SearchParams, SearchResult, search_params

#: ``SearchParams``, ``SearchResult`` and ``search_params`` live in ``search_request`` (a request's
#: side of the search) and are named here too: the engine reaches them through this module.
__all__ = ["Preempted", "SearchBatch", "SearchParams", "SearchResult", "StepResult",
           "search_params"]

GREEDY, SAMPLE, BEAM = 0, 1, 2
_MODES = {"greedy": GREEDY, "sample": SAMPLE, "beam": BEAM}
_FAR = -1.0e9  # generate()'s "impossible" score


@dataclass
class StepResult:
    """What one step decided. ``tokens`` [rows]: the token each row appends; ``parent`` [rows]:
    the row (pre-step order) whose history and cache the row continues; ``finished``: keys whose
    search ended at this step (their rows stay until ``remove``); ``streamed``: (sid, sink,
    token) [k] of the streaming rows (``SearchBatch.stream``) that appended a token."""

    tokens: torch.Tensor
    parent: torch.Tensor
    finished: list[Hashable]
    streamed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


# Per-row state: name -> (dtype, padding value of trailing dimensions, pad on the left)
_FIELDS: dict[str, tuple[torch.dtype, float, bool]] = {
    **{n: (torch.int64, 0, False) for n in (
        "req", "ridx", "mode", "nb", "K", "plen", "gen", "max_new", "min_new", "ngram", "pad",
        "fbos", "feos", "topk", "seed", "es", "fin_len", "sid", "sink")},
    **{n: (torch.float32, 0.0, False) for n in ("temp", "topp_cut", "run_score", "fin_score")},
    **{n: (torch.bool, False, False) for n in (
        "use_topp", "row_done", "req_done", "fin_flag", "heur", "never_pos")},
    "hist": (torch.int64, 0, False), "fin_hist": (torch.int64, 0, False),
    "eos": (torch.int64, -1, False), "bw_last": (torch.int64, -1, False),
    "bw_len": (torch.int64, 0, False),
    "bw_pre": (torch.int64, -1, True), "lpt": (torch.float32, 1.0, False),
}


def _pad_tail(t: torch.Tensor, shape: Sequence[int], fill, left: bool) -> torch.Tensor:
    """``t`` [rows, *tail] padded with ``fill`` to [rows, *shape]."""
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    out = torch.full((t.shape[0], *shape), fill, dtype=t.dtype, device=t.device)
    view = out
    for d, n in enumerate(t.shape[1:]):
        view = view.narrow(d + 1, shape[d] - n if left and d == len(shape) - 1 else 0, n)
    view.copy_(t)
    return out


@dataclass
class Preempted:
    """A request taken out of the batch by ``SearchBatch.preempt``: its parameters, its rows'
    state, and each row's decoder history so far (prompt and generated tokens, one length:
    what a resumed request recomputes; the last token's logits decide its next step)."""

    params: SearchParams
    state: dict[str, torch.Tensor]
    histories: list[list[int]]


@dataclass
class _Req:
    id: int
    params: SearchParams


class SearchBatch:
    """The search state of every request in the running batch (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if int(vocab_size) < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._t = {n: torch.empty((0,), dtype=dt, device=self.device)
                   for n, (dt, _, _) in _FIELDS.items()}
        for n in ("hist", "fin_hist", "eos", "bw_last", "bw_len", "lpt"):
            self._t[n] = self._t[n].view(0, 0)
        self._t["bw_pre"] = self._t["bw_pre"].view(0, 0, 0)
        self._reqs: dict[Hashable, _Req] = {}
        self._keys: dict[int, Hashable] = {}
        self._next_id = 0
        self._ngrams: Counter[int] = Counter()     # no_repeat_ngram_size -> requests
        # (num_beams, candidates) -> beam requests
        self._groups: Counter[tuple[int, int]] = Counter()
        self._modes: Counter[int] = Counter()
        self._forced = 0

    @property
    def rows(self) -> int:
        return int(self._t["req"].shape[0])

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._reqs

    # ---- joining and leaving -------------------------------------------------------------

    def add(self, key: Hashable, params: SearchParams, history: Sequence[int]) -> slice:
        """Append ``params.rows`` rows for a new request; returns them. ``history``: the decoder
        tokens before the first new one (the prompt; or ``[decoder_start_token_id]``)."""
        if key in self._reqs:
            raise InvalidRequest(f"key: {key!r} is already in the batch")
        hist = [int(t) for t in history]
        if not hist:
            raise InvalidRequest("history: is empty")
        if len(hist) != params.prompt_len:
            raise InvalidRequest(f"history: {len(hist)} tokens, but prompt_len is "
                                 f"{params.prompt_len}")
        v = self.vocab_size
        fbos, feos = params.forced_bos_token_id, params.forced_eos_token_id
        for name, ids in (("history", hist), ("eos_token_ids", params.eos_token_ids),
                          ("bad_words_ids", [t for w in params.bad_words_ids for t in w]),
                          ("forced_bos_token_id", [fbos] if fbos is not None else []),
                          ("forced_eos_token_id", [feos] if feos is not None else [])):
            bad = [t for t in ids if not 0 <= t < v]
            if bad:
                raise InvalidRequest(f"{name}: token id {bad[0]} outside the vocabulary [0, {v})")
        if params.mode not in _MODES:
            raise InvalidRequest(f"mode: must be greedy, beam or sample, got {params.mode!r}")
        n, mode = params.rows, _MODES[params.mode]
        if mode == BEAM and params.num_beams < 2:
            raise InvalidRequest(f"num_beams: beam search needs at least 2, got {params.num_beams}")
        if params.num_return_sequences > n:
            raise InvalidRequest(f"num_return_sequences: {params.num_return_sequences} is more "
                                 f"than the {n} rows of a {params.mode} search")
        rid = self._next_id
        self._next_id += 1
        # any integer seed is served (folded into int64's range); none: a fresh one per request
        if params.seed is not None:
            seed = int(params.seed) % (1 << 63)
        else:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        nb = params.num_beams
        K = max(2, 1 + len(params.eos_token_ids)) * nb if mode == BEAM else 0
        dev = self.device
        eos = list(params.eos_token_ids)
        words = list(params.bad_words_ids)
        plen_max = max((len(w) - 1 for w in words), default=0)
        lp = params.length_penalty
        lpt = [1.0]
        if mode == BEAM:
            lpt += [float(t) ** lp for t in range(1, params.max_new_tokens + 1)]
        scalars = dict(
            req=rid, mode=mode, nb=nb, K=K, plen=len(hist), gen=0, max_new=params.max_new_tokens,
            min_new=params.min_new_tokens, ngram=params.no_repeat_ngram_size,
            pad=params.pad_token_id if params.pad_token_id is not None else 0,
            fbos=params.forced_bos_token_id if params.forced_bos_token_id is not None else -1,
            feos=params.forced_eos_token_id if params.forced_eos_token_id is not None else -1,
            topk=min(params.top_k, v) if mode == SAMPLE else 0, seed=seed,  # k >= vocab: all
            es={False: 0, True: 1, "never": 2}[params.early_stopping], fin_len=len(hist),
            sid=-1, sink=-1,
            temp=params.temperature if mode == SAMPLE else 1.0, fin_score=_FAR,
            use_topp=mode == SAMPLE and params.top_p < 1.0, row_done=False, req_done=False,
            fin_flag=False, heur=True, never_pos=params.early_stopping == "never" and lp > 0.0)
        new = {k: torch.full((n,), val, dtype=_FIELDS[k][0], device=dev)
               for k, val in scalars.items()}
        new["ridx"] = torch.arange(n, dtype=torch.int64, device=dev)
        # 1 - top_p in double, then rounded to float32 (as the warper's scalar comparison rounds it)
        new["topp_cut"] = torch.full((n,), 1.0 - params.top_p if mode == SAMPLE else 0.0,
                                     dtype=torch.float64, device=dev).float()
        run = torch.zeros((n,), dtype=torch.float32, device=dev)
        if mode == BEAM:
            run[1:] = _FAR
        new["run_score"] = run
        new["hist"] = torch.tensor([hist] * n, dtype=torch.int64, device=dev)
        new["fin_hist"] = new["hist"].clone()
        new["eos"] = torch.tensor([eos] * n, dtype=torch.int64, device=dev).view(n, len(eos))
        nw = len(words)
        new["bw_last"] = torch.tensor([[w[-1] for w in words]] * n, dtype=torch.int64,
                                      device=dev).view(n, nw)
        new["bw_len"] = torch.tensor([[len(w) - 1 for w in words]] * n, dtype=torch.int64,
                                     device=dev).view(n, nw)
        pre = [[-1] * (plen_max - len(w) + 1) + list(w[:-1]) for w in words]
        new["bw_pre"] = torch.tensor([pre] * n, dtype=torch.int64,
                                     device=dev).view(n, nw, plen_max)
        new["lpt"] = torch.tensor([lpt] * n, dtype=torch.float64, device=dev).float()
        return self._join(key, rid, params, new)

    def _join(self, key: Hashable, rid: int, params: SearchParams,
              new: dict[str, torch.Tensor]) -> slice:
        """Append the rows ``new`` (every field) of request ``rid``; returns them."""
        width = params.prompt_len + params.max_new_tokens
        start, n = self.rows, int(new["req"].shape[0])
        grown = {}
        for name, (_, fill, left) in _FIELDS.items():
            old, add = self._t[name], new[name]
            tail = [max(a, b) for a, b in zip(old.shape[1:], add.shape[1:])]
            if name in ("hist", "fin_hist"):
                tail = [max(tail[0], width)]
            grown[name] = torch.cat([_pad_tail(old, tail, fill, left),
                                     _pad_tail(add, tail, fill, left)])
        self._t.update(grown)  # all fields or none: a request that fails here leaves no rows
        self._reqs[key] = _Req(rid, params)
        self._keys[rid] = key
        self._count(params, +1)
        return slice(start, start + n)

    def preempt(self, key: Hashable) -> tuple[Preempted, torch.Tensor]:
        """Take ``key``'s rows out with their whole state (histories, beam scores, kept
        hypotheses, the sampling seed and step: ``resume`` continues exactly where it stopped).
        Returns that state and ``keep``, as ``remove`` does."""
        req = self._reqs[key]
        t = self._t
        gone = t["req"] == req.id
        rows = torch.nonzero(gone).view(-1)
        state = {name: t[name][rows].clone() for name in t}
        self._reqs.pop(key)
        del self._keys[req.id]
        self._count(req.params, -1)
        keep = torch.nonzero(~gone).view(-1)
        for name in t:
            t[name] = t[name][keep]
        plen, gen = state["plen"].tolist(), state["gen"].tolist()
        n = plen[0] + max(gen)  # done rows (sampling) are padded: their tokens are never read
        pad = int(state["pad"][0])
        hist = [h[:p + g] + [pad] * (n - p - g)
                for h, p, g in zip(state["hist"].tolist(), plen, gen)]
        return Preempted(req.params, state, hist), keep

    def resume(self, key: Hashable, p: Preempted) -> slice:
        """Append the rows ``preempt`` took out, as they were (under a new internal id)."""
        if key in self._reqs:
            raise InvalidRequest(f"key: {key!r} is already in the batch")
        rid = self._next_id
        self._next_id += 1
        new = dict(p.state)
        new["req"] = torch.full_like(new["req"], rid)
        return self._join(key, rid, p.params, new)

    def stream(self, key: Hashable, sid: int, sink: int) -> None:
        """From the next step on, hand ``key``'s tokens out as they are appended, tagged with
        the caller's numbers ``sid`` (the request) and ``sink`` (its consumer), all streaming
        rows' together (``StepResult.streamed``). Only a one-row greedy or sampling request
        streams (a beam's history changes as beams swap): other keys are left as they are."""
        p = self._reqs[key].params
        if p.rows == 1 and p.mode != "beam":
            rows = self._t["req"] == self._reqs[key].id
            self._t["sid"][rows], self._t["sink"][rows] = sid, sink

    def _count(self, p: SearchParams, sign: int) -> None:
        for counter, k in ((self._ngrams, p.no_repeat_ngram_size), (self._modes, _MODES[p.mode])):
            counter[k] += sign
        if p.mode == "beam":
            self._groups[(p.num_beams, max(2, 1 + len(p.eos_token_ids)) * p.num_beams)] += sign
        forced = p.forced_bos_token_id is not None or p.forced_eos_token_id is not None
        self._forced += sign * int(forced)
        for c in (self._ngrams, self._groups, self._modes):
            for k in [k for k, n in c.items() if n <= 0]:
                del c[k]

    def remove(self, keys: Sequence[Hashable]) -> tuple[dict[Hashable, SearchResult], torch.Tensor]:
        """Drop the keys' rows. Returns each key's :class:`SearchResult` and ``keep``: the
        surviving rows' indices in the old order (their relative order is unchanged)."""
        missing = [k for k in keys if k not in self._reqs]
        if missing:
            raise KeyError(f"not in the search batch: {missing[0]!r}")
        t = self._t
        ids = torch.tensor([self._reqs[k].id for k in keys], dtype=torch.int64, device=self.device)
        gone = torch.isin(t["req"], ids)
        rows = torch.nonzero(gone).view(-1)
        # one host transfer of everything the results need, then plain Python per removed key
        cols = {n: t[n][rows].tolist() for n in (
            "req", "ridx", "plen", "gen", "hist", "fin_hist", "fin_len", "fin_score", "run_score",
            "row_done", "req_done", "fin_flag")}
        by_req: dict[int, list[int]] = {}
        for i, r in enumerate(cols["req"]):
            by_req.setdefault(r, []).append(i)
        out: dict[Hashable, SearchResult] = {}
        for k in keys:
            req = self._reqs.pop(k)
            del self._keys[req.id]
            self._count(req.params, -1)
            out[k] = _result(req.params, by_req[req.id], cols)
        keep = torch.nonzero(~gone).view(-1)
        for name in t:
            t[name] = t[name][keep]
        return out, keep

    def tokens_of(self, key: Hashable) -> list[int] | None:
        """The tokens decided so far for a one-row (greedy, or sampling with one return
        sequence) request, for streaming; None for beam search and multi-sequence sampling."""
        req = self._reqs[key]
        if req.params.rows != 1 or req.params.mode == "beam":
            return None
        row = int(torch.nonzero(self._t["req"] == req.id)[0, 0])
        p, g = int(self._t["plen"][row]), int(self._t["gen"][row])
        return self._t["hist"][row, p:p + g].tolist()

    def new_tokens(self, sent: Mapping[Hashable, int]) -> dict[Hashable, list[int]]:
        """``tokens_of`` for many streaming requests at once, past the ``sent[key]`` tokens each
        has streamed: one lookup of their rows and two host copies for all of them, whatever
        their number (the engine calls this every step). Keys ``tokens_of`` answers None for,
        and keys with nothing new, are left out."""
        keys = [k for k, n in sent.items()
                if self._reqs[k].params.rows == 1 and self._reqs[k].params.mode != "beam"]
        if not keys:
            return {}
        t = self._t
        ids = torch.tensor([self._reqs[k].id for k in keys], dtype=t["req"].dtype,
                           device=self.device)
        row = (t["req"][None, :] == ids[:, None]).to(torch.int8).argmax(1)  # first row of each
        end = t["plen"][row] + t["gen"][row]
        gen_host = t["gen"][row].tolist()
        have = [g - sent[k] for k, g in zip(keys, gen_host)]
        width = max(have)
        if width <= 0:
            return {}
        cols = (end[:, None] - width + torch.arange(width, device=self.device)).clamp(min=0)
        window = t["hist"][row[:, None], cols].tolist()
        return {k: window[i][width - n:] for i, (k, n) in enumerate(zip(keys, have)) if n > 0}

    # ---- one decoding step ---------------------------------------------------------------

    def step(self, logits: torch.Tensor) -> StepResult:
        """Decide every row's next token from ``logits`` [rows, vocab] (each row's last position,
        rows in the current order; converted to float32)."""
        t = self._t
        n = self.rows
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits: expected shape [{n}, {self.vocab_size}], "
                             f"got {list(logits.shape)}")
        logits = logits.to(device=self.device, dtype=torch.float32)
        tokens = t["pad"].clone()
        parent = torch.arange(n, device=self.device)
        grew = torch.zeros(n, dtype=torch.bool, device=self.device)  # rows that appended one
        finished: list[int] = []
        if self._modes.get(GREEDY) or self._modes.get(SAMPLE):
            finished += self._step_single(logits, tokens, grew)
        for nb, k in sorted(self._groups):
            finished += self._step_beam(logits, tokens, parent, nb, k)
        out = torch.nonzero(grew & (t["sid"] >= 0)).view(-1)  # streaming rows (never beams)
        return StepResult(tokens=tokens, parent=parent, finished=[self._keys[i] for i in finished],
                          streamed=(t["sid"][out], t["sink"][out], tokens[out]))

    def _process(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """generate()'s logits processors, in its order, on the rows ``idx``."""
        t = self._t
        gen = t["gen"][idx]
        hlen = t["plen"][idx] + gen
        if self._ngrams and max(self._ngrams) > 0:
            scores = ban_repeated_ngrams(scores, t["hist"][idx], hlen, t["ngram"][idx],
                                         max(self._ngrams))
        if t["bw_last"].shape[1]:
            scores = ban_bad_words(scores, t["hist"][idx], hlen, t["bw_pre"][idx], t["bw_len"][idx],
                                   t["bw_last"][idx])
        scores = ban_early_eos(scores, gen, t["min_new"][idx], t["eos"][idx])
        if self._forced:
            scores = force_tokens(scores, hlen, gen, t["max_new"][idx], t["fbos"][idx],
                                  t["feos"][idx])
        return scores

    def _append(self, idx: torch.Tensor, tok: torch.Tensor, grow: torch.Tensor) -> None:
        """Write ``tok`` after the history of rows ``idx`` where ``grow``; count it generated."""
        t = self._t
        pos = (t["plen"][idx] + t["gen"][idx]).clamp(max=t["hist"].shape[1] - 1)
        cur = t["hist"][idx, pos]
        t["hist"][idx, pos] = torch.where(grow, tok, cur)
        t["gen"][idx] += grow.long()

    def _is_eos(self, tok: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """``tok`` [rows, k] in each row's ``eos`` [rows, E] list."""
        return (tok.unsqueeze(-1) == eos.unsqueeze(1)).any(-1)

    def _step_single(self, logits: torch.Tensor, tokens: torch.Tensor, grew: torch.Tensor
                     ) -> list[int]:
        """Greedy and sampling rows (``_sample`` of generate()); ``grew``: set where a row
        appended a token."""
        t = self._t
        idx = torch.nonzero(~t["req_done"] & (t["mode"] != BEAM)).view(-1)
        if idx.numel() == 0:
            return []
        scores = self._process(logits[idx], idx)
        tok = scores.argmax(-1)
        if self._modes.get(SAMPLE):
            sub = torch.nonzero(t["mode"][idx] == SAMPLE).view(-1)
            if sub.numel():
                rows = idx[sub]
                warped = warp(scores[sub], t["temp"][rows], t["topk"][rows],
                              t["topp_cut"][rows], t["use_topp"][rows])
                tok[sub] = sample_tokens(warped, t["seed"][rows], t["ridx"][rows], t["gen"][rows])
        was_done = t["row_done"][idx]
        tok = torch.where(was_done, t["pad"][idx], tok)
        self._append(idx, tok, ~was_done)
        grew[idx] = ~was_done
        done = (was_done | self._is_eos(tok.view(-1, 1), t["eos"][idx]).view(-1)
                | (t["gen"][idx] >= t["max_new"][idx]))
        t["row_done"][idx] = done
        tokens[idx] = tok
        # a request ends when all its rows have: rows of a request are contiguous in idx
        first = t["ridx"][idx] == 0
        seg = torch.cumsum(first.long(), 0) - 1
        open_rows = torch.zeros(int(first.sum()), dtype=torch.int64, device=self.device)
        open_rows.index_add_(0, seg, (~done).long())
        ended = open_rows == 0
        t["req_done"][idx] = ended[seg]
        return t["req"][idx[first][ended]].tolist()

    def _step_beam(self, logits: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor,
                   nb: int, k: int) -> list[int]:
        """The beam requests with ``nb`` beams and ``k`` candidates (``_beam_search`` of
        generate(), one request per row of its [B, ...] tensors)."""
        t = self._t
        starts = torch.nonzero((t["mode"] == BEAM) & (t["nb"] == nb) & (t["K"] == k)
                               & (t["ridx"] == 0) & ~t["req_done"]).view(-1)
        b = int(starts.numel())
        if b == 0:
            return []
        v = self.vocab_size
        dev = self.device
        rows = starts.view(b, 1) + torch.arange(nb, device=dev).view(1, nb)          # [B, nb]
        flat = rows.view(-1)
        first = starts
        log_probs = torch.log_softmax(logits[flat], dim=-1)
        log_probs = self._process(log_probs, flat)
        log_probs = log_probs.view(b, nb, v) + t["run_score"][rows].view(b, nb, 1)
        top_scores, top_idx = torch.topk(log_probs.view(b, nb * v), k=k)              # [B, K]
        beam = top_idx // v
        tok = top_idx % v
        gen = t["gen"][first]                                                         # [B]
        hits = self._is_eos(tok, t["eos"][first]) | (gen + 1 >= t["max_new"][first]).view(b, 1)
        # running beams for the next step: the best nb candidates that did not just finish
        running = top_scores + hits.to(torch.float32) * _FAR
        nxt = torch.topk(running, k=nb)[1]
        new_run = running.gather(1, nxt)
        new_beam = beam.gather(1, nxt)
        new_tok = tok.gather(1, nxt)
        # finished hypotheses: merge the finished top-nb candidates into the kept ones
        did = hits & (torch.arange(k, device=dev) < nb).view(1, k)
        lpt = t["lpt"][first]
        cand = top_scores / lpt.gather(1, (gen + 1).view(b, 1))
        fin_flag = t["fin_flag"][rows]
        full = fin_flag.all(-1, keepdim=True) & (t["es"][first] == 1).view(b, 1)
        cand = cand + full.to(torch.float32) * _FAR
        cand = cand + (~t["heur"][first]).view(b, 1).to(torch.float32) * _FAR
        cand = cand + (~did) * _FAR
        merged = torch.cat((t["fin_score"][rows], cand), dim=1)                        # [B, nb + K]
        sel = torch.topk(merged, k=nb)[1]
        new_fin_score = merged.gather(1, sel)
        from_cand = sel >= nb
        cj = (sel - nb).clamp(min=0)
        kept = sel.clamp(max=nb - 1)  # the kept hypothesis a slot holds (where not from_cand)
        new_fin_flag = torch.where(from_cand, did.gather(1, cj), fin_flag.gather(1, kept))
        hist, fin_hist = t["hist"], t["fin_hist"]
        cand_rows = rows.gather(1, beam.gather(1, cj))                                 # [B, nb]
        hlen = (t["plen"][first] + gen).view(b, 1)
        cand_seq = hist[cand_rows]                                                     # [B, nb, H]
        cand_seq.scatter_(2, hlen.clamp(max=hist.shape[1] - 1).view(b, 1, 1).expand(b, nb, 1),
                          tok.gather(1, cj).unsqueeze(-1))
        old_seq = fin_hist[rows.gather(1, kept)]
        new_fin_hist = torch.where(from_cand.unsqueeze(-1), cand_seq, old_seq)
        new_fin_len = torch.where(from_cand, hlen + 1, t["fin_len"][rows.gather(1, kept)])
        # can the running beams still beat the worst kept hypothesis? (_check_early_stop_heuristic)
        glen = torch.where(t["never_pos"][first], t["max_new"][first], gen + 1)
        best = new_run[:, :1] / lpt.gather(1, glen.view(b, 1))
        worst = torch.where(new_fin_flag, new_fin_score.min(dim=1, keepdim=True)[0], _FAR)
        heur = t["heur"][first] & (best > worst).any(-1)
        all_fin = new_fin_flag.all(-1) & (t["es"][first] == 1)
        ended = ~(heur & ~all_fin & ~hits.all(-1))
        # write back: row j of each request continues candidate nxt[j]
        src = rows.gather(1, new_beam).view(-1)
        parent[flat] = src
        tokens[flat] = new_tok.view(-1)
        hist[flat] = hist[src]
        self._append(flat, new_tok.view(-1), torch.ones_like(flat, dtype=torch.bool))
        t["run_score"][flat] = new_run.view(-1)
        t["fin_score"][flat] = new_fin_score.view(-1)
        t["fin_flag"][flat] = new_fin_flag.view(-1)
        t["fin_len"][flat] = new_fin_len.view(-1)
        fin_hist[flat] = new_fin_hist.view(b * nb, -1)
        t["heur"][flat] = heur.view(b, 1).expand(b, nb).reshape(-1)
        t["req_done"][flat] = ended.view(b, 1).expand(b, nb).reshape(-1)
        return t["req"][first[ended]].tolist()


def _result(p: SearchParams, idx: list[int], cols: dict[str, list]) -> SearchResult:
    """A removed request's result from its rows' host copies (``idx`` into ``cols``)."""
    eos = set(p.eos_token_ids)
    done = cols["req_done"][idx[0]]

    def reason(seq: list[int], ended: bool) -> str:
        if not ended:
            return "cancelled"
        return "eos" if seq and seq[-1] in eos else "length"

    if p.mode == "beam":
        if done:
            best = idx[:p.num_return_sequences]
            seqs = [cols["fin_hist"][i][p.prompt_len:cols["fin_len"][i]] for i in best]
            return SearchResult(seqs, [float(cols["fin_score"][i]) for i in best],
                                [reason(s, True) for s in seqs])
        top = idx[:p.num_return_sequences]
        seqs = [cols["hist"][i][p.prompt_len:p.prompt_len + cols["gen"][i]] for i in top]
        return SearchResult(seqs, [float(cols["run_score"][i]) for i in top],
                            ["cancelled"] * len(seqs))
    seqs = [cols["hist"][i][p.prompt_len:p.prompt_len + cols["gen"][i]] for i in idx]
    return SearchResult(seqs, None, [reason(s, cols["row_done"][i]) for s, i in zip(seqs, idx)])
