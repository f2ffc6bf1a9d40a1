"""The logits processors and sampling warpers of Hugging Face ``generate()``, over many rows at
once.

Every function here takes the scores of several rows, each row with its own parameters held in
tensors (one entry per row); the processors write their ``-inf`` into the scores in place (only
the entries they ban) and return them, so the caller passes a tensor it owns. They reproduce, bit
for bit in float32,
what ``transformers`` 5.x applies to one request's rows, in the order ``generate()`` applies them
(``_get_logits_processor``):

1. ``NoRepeatNGramLogitsProcessor``  -> :func:`ban_repeated_ngrams`
2. ``NoBadWordsLogitsProcessor``     -> :func:`ban_bad_words`
3. ``MinLength`` / ``MinNewTokensLengthLogitsProcessor`` -> :func:`ban_early_eos`
4. ``ForcedBOSTokenLogitsProcessor``, ``ForcedEOSTokenLogitsProcessor`` -> :func:`force_tokens`
5. sampling only: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``
   -> :func:`warp`

A row's parameter at its neutral value (0 = off, -1 = no token) leaves the row's scores exactly
as they were, so rows of different requests share one call. Token lists of different lengths
(EOS ids, bad words) are padded with -1 and banned through a spare column past the vocabulary
(column ``V``), which is dropped at the end: a padding entry can never touch a real token.

Histories: ``hist`` [rows, H] int64 holds each row's decoder tokens left-aligned (the prompt, or
the decoder start token, then the generated tokens), ``hlen`` [rows] how many are valid.

Sampling draws its randomness from :func:`exponential_noise`, a counter-based generator keyed by
(seed, row within the request, step, token id): a request's draws do not depend on what else is
in the batch, and there is no generator object per request to step in a Python loop.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ban_repeated_ngrams", "ban_bad_words", "ban_early_eos", "force_tokens", "warp",
           "exponential_noise", "sample_tokens", "NEG_INF"]

NEG_INF = -math.inf


def _ban(scores: torch.Tensor, cols: torch.Tensor, on: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` [rows, V] with ``-inf`` written at ``cols`` [rows, k], in place (entries < 0 or
    >= V, or where ``on`` [rows, k] is False, ban nothing). Only the banned entries are touched."""
    vocab = scores.shape[1]
    if cols.shape[1] == 0:
        return scores
    ok = (cols >= 0) & (cols < vocab)
    if on is not None:
        ok = ok & on
    r, j = torch.nonzero(ok, as_tuple=True)
    scores[r, cols[r, j]] = NEG_INF
    return scores


#: Elements of :func:`ban_repeated_ngrams`' window comparison made at once (32 MiB of int64):
#: its size is rows x the widest history x the largest n - 1 of the batch, so one request of
#: many long rows with a large ``no_repeat_ngram_size`` ran the device out of memory in the
#: search step, which fails every running request.
NGRAM_CHUNK = 1 << 22


def ban_repeated_ngrams(scores: torch.Tensor, hist: torch.Tensor, hlen: torch.Tensor,
                        ngram: torch.Tensor, max_ngram: int) -> torch.Tensor:
    """``NoRepeatNGramLogitsProcessor`` with a size per row (``ngram`` [rows], 0 = off).

    A row with ``n = ngram[r] > 0`` and at least ``n`` tokens bans every token ``t`` such that
    (its last ``n-1`` tokens, ``t``) already occurs in its history. Vectorised: the last ``n-1``
    tokens are compared with the first ``n-1`` tokens of every window of the history (one gather
    of ``[rows, H, max_ngram-1]``), and a matching window's last token is scattered to ``-inf``.
    ``max_ngram``: the largest ``ngram`` of the rows (a Python int: it sizes the comparison).
    """
    if max_ngram <= 0 or hist.shape[1] == 0:
        return scores
    rows, width = hist.shape
    step = max(1, NGRAM_CHUNK // (width * max(max_ngram - 1, 1)))
    if rows > step:  # in row chunks: the comparison's memory stays bounded whatever the batch
        for r in range(0, rows, step):  # (scores[r:r + step] is a view: banned in place)
            ban_repeated_ngrams(scores[r:r + step], hist[r:r + step], hlen[r:r + step],
                                ngram[r:r + step], max_ngram)
        return scores
    dev = hist.device
    n = ngram.view(rows, 1)
    k = torch.arange(max(max_ngram - 1, 1), device=dev).view(1, 1, -1)  # offsets in the prefix
    s = torch.arange(width, device=dev).view(1, width, 1)                      # window starts
    # token k of window s, against token k of the row's last n-1 tokens
    win = hist.gather(1, (s + k).clamp(max=width - 1).view(1, -1).expand(rows, -1)).view(
        rows, width, -1
    )
    pre_pos = (hlen.view(rows, 1) - n + 1 + k.view(1, -1)).clamp(0, width - 1)
    pre = hist.gather(1, pre_pos)
    used = k.view(1, 1, -1) < (n - 1).view(rows, 1, 1)  # only n-1 offsets count
    match = ((win == pre.view(rows, 1, -1)) | ~used).all(-1)
    match &= s.view(1, width) <= (hlen.view(rows, 1) - n)  # window ends in history
    match &= (n > 0) & (hlen.view(rows, 1) >= n)
    last = hist.gather(1, (s.view(1, width) + n - 1).clamp(0, width - 1))
    return _ban(scores, last, match)


def ban_bad_words(scores: torch.Tensor, hist: torch.Tensor, hlen: torch.Tensor,
                  bw_pre: torch.Tensor, bw_len: torch.Tensor,
                  bw_last: torch.Tensor) -> torch.Tensor:
    """``NoBadWordsLogitsProcessor``: each row's banned sequences, padded.

    ``bw_last`` [rows, W]: the last token of each sequence (-1 = padding); ``bw_len`` [rows, W]:
    the length of its prefix (0 for a single-token ban); ``bw_pre`` [rows, W, P]: the prefix,
    right-aligned. A sequence bans its last token when the row's history ends with its prefix
    (a prefix longer than the history bans nothing, as in ``generate()``).
    """
    rows, w = bw_last.shape
    if w == 0:
        return scores
    p = bw_pre.shape[2]
    width = hist.shape[1]
    if p:
        pos = hlen.view(rows, 1) - p + torch.arange(p, device=hist.device).view(1, p)
        tail = hist.gather(1, pos.clamp(0, max(width - 1, 0)))
        tail = torch.where(pos >= 0, tail, -2)
        care = torch.arange(p, device=hist.device).view(1, 1, p) >= (p - bw_len).view(rows, w, 1)
        match = ((bw_pre == tail.view(rows, 1, p)) | ~care).all(-1)
    else:
        match = torch.ones((rows, w), dtype=torch.bool, device=hist.device)
    match &= bw_len <= hlen.view(rows, 1)
    return _ban(scores, bw_last, match)


def ban_early_eos(scores: torch.Tensor, gen: torch.Tensor, min_new: torch.Tensor,
                  eos: torch.Tensor) -> torch.Tensor:
    """``MinLength``/``MinNewTokensLength``: rows that have generated fewer than ``min_new``
    [rows] tokens may not pick any of their ``eos`` [rows, E] ids (-1 padded)."""
    return _ban(scores, eos, (gen < min_new).view(-1, 1).expand_as(eos))


def force_tokens(scores: torch.Tensor, hlen: torch.Tensor, gen: torch.Tensor, max_new: torch.Tensor,
                 forced_bos: torch.Tensor, forced_eos: torch.Tensor) -> torch.Tensor:
    """``ForcedBOS`` then ``ForcedEOS``, in place: a row whose history is one token long with
    ``forced_bos >= 0`` gets ``-inf`` everywhere but 0 at that token; so does a row at its last
    step (``gen == max_new - 1``) with ``forced_eos >= 0``, applied second (it wins). Only the
    forced rows are rewritten."""
    for on, tok in (((hlen == 1) & (forced_bos >= 0), forced_bos),
                    ((gen == max_new - 1) & (forced_eos >= 0), forced_eos)):
        r = torch.nonzero(on).view(-1)
        if r.numel():
            scores[r] = NEG_INF
            scores[r, tok[r]] = 0.0
    return scores


def warp(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
         top_p_cut: torch.Tensor, use_top_p: torch.Tensor) -> torch.Tensor:
    """The sampling warpers in ``generate()``'s order: temperature, top-k, top-p (a new tensor).

    ``temperature`` [rows] float32 (1.0 = off; dividing by 1.0 is exact); ``top_k`` [rows]
    (0 = off; ``generate()`` keeps at least one token); ``top_p_cut`` [rows] float32: ``1 -
    top_p`` rounded to float32 as ``generate()``'s comparison rounds it; ``use_top_p`` [rows]:
    top_p < 1 (rows without it are left untouched, as ``generate()`` adds no warper for them).
    Top-p sorts whole rows as ``generate()`` does (its cumulative sums must be the same bits), so
    only the rows that use it are sorted.
    """
    rows, vocab = scores.shape
    scores = scores / temperature.view(rows, 1)
    # top-k: drop everything below the k-th largest value (ties with it stay)
    kr = torch.nonzero(top_k > 0).view(-1)
    if kr.numel():
        k = top_k[kr].clamp(1, vocab)
        kth = torch.topk(scores[kr], int(k.max()), dim=-1).values.gather(1, (k - 1).view(-1, 1))
        sub = scores[kr]
        scores[kr] = sub.masked_fill(sub < kth, NEG_INF)
    # top-p: ascending sort; drop the low tail whose cumulative probability is <= 1 - top_p
    pr = torch.nonzero(use_top_p).view(-1)
    if pr.numel():
        sub = scores[pr]
        sorted_logits, sorted_idx = torch.sort(sub, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= top_p_cut[pr].view(-1, 1)
        drop_sorted[:, -1] = False
        scores[pr] = sub.masked_fill(drop_sorted.scatter(1, sorted_idx, drop_sorted), NEG_INF)
    return scores


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32). The multipliers are
    below 2**31, so no product overflows int64 (the same bits on every device)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


_TOKEN_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """[1, vocab]: every token id hashed once (cached per vocabulary size and device)."""
    key = (vocab, str(device))
    if key not in _TOKEN_HASH:
        v = torch.arange(vocab, device=device, dtype=torch.int64).view(1, vocab)
        _TOKEN_HASH[key] = _mix32(_mix32((v * 0x61C88647) & _MASK32) ^ 0x2545F491)
    return _TOKEN_HASH[key]


def exponential_noise(seed: torch.Tensor, row: torch.Tensor, step: torch.Tensor,
                      vocab: int) -> torch.Tensor:
    """Exp(1) draws [rows, vocab] float32, a pure function of (seed, row, step, token id).

    ``seed`` [rows] (any int64), ``row`` [rows] (the row's index within its request), ``step``
    [rows] (how many tokens the row has generated). A row's key is hashed from its three numbers
    and each token id is hashed once (cached); a draw mixes the two, and its top 24 bits, offset
    by half a unit so they are never 0 or 1, make the uniform.
    """
    key = _mix32((seed >> 32) & _MASK32)
    for part in (seed & _MASK32, row & _MASK32, step & _MASK32):
        key = _mix32(key ^ part)
    h = _mix32(_token_hash(vocab, seed.device) ^ key.view(-1, 1))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(u)


def sample_tokens(scores: torch.Tensor, seed: torch.Tensor, row: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(scores)``, as ``torch.multinomial(probs, 1)`` draws it
    (``argmax(probs / q)`` with ``q ~ Exp(1)``), the noise from :func:`exponential_noise`."""
    probs = torch.softmax(scores, dim=-1)
    q = exponential_noise(seed, row, step, scores.shape[1])
    return (probs / q).argmax(-1)
