"""One request's side of the decoding search: what it asks for and what it gets back.

A :class:`~itif.generation.api.GenerateRequest` leaves settings to its tenant's checkpoint
(end tokens, the pad token, bad words, a minimum length); :func:`search_params` resolves them
into a :class:`SearchParams` as ``transformers``' ``generate()`` resolves its arguments against a
generation config, once, when the request arrives. ``SearchBatch`` (``itif.generation.search``)
copies those parameters onto the request's rows and never reads the request or the defaults
again; when the request leaves it hands back a :class:`SearchResult`.

Kept apart from the batch because the two change for different reasons: this module follows
``generate()``'s argument rules, the batch follows its per-step arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from itif.generation.api import EarlyStopping, GenerateRequest, Generation, GenerationDefaults

__all__ = ["SearchParams", "SearchResult", "search_params"]


@dataclass(frozen=True)
class SearchParams:
    """One request's search, resolved against its tenant's ``GenerationDefaults`` (see
    :func:`search_params`). Token fields use None for "none"; ``min_new_tokens`` counts the
    generated tokens before which EOS is banned (``generate()``'s min_length and min_new_tokens
    folded into one); ``prompt_len``: the length of the history ``add`` receives."""

    mode: str
    num_beams: int
    num_return_sequences: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: EarlyStopping
    no_repeat_ngram_size: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    forced_bos_token_id: int | None
    forced_eos_token_id: int | None
    bad_words_ids: tuple[tuple[int, ...], ...]
    min_new_tokens: int
    prompt_len: int

    @property
    def rows(self) -> int:
        """Rows the request occupies: its beams, its samples, or one."""
        if self.mode == "beam":
            return self.num_beams
        return self.num_return_sequences if self.mode == "sample" else 1


def search_params(request: GenerateRequest, defaults: GenerationDefaults,
                  encoder_decoder: bool) -> SearchParams:
    """Resolve ``request`` as ``generate()`` resolves its arguments against the checkpoint's
    generation config: a request's ``eos_token_id`` replaces the checkpoint's EOS ids; the pad
    token falls back to the first EOS id; bad words equal to an EOS id are dropped (as
    ``NoBadWordsLogitsProcessor`` drops them), suppressed tokens never; ``min_new_tokens`` (if
    set) wins over ``min_length``, which counts the whole decoder sequence (the prompt of a
    decoder-only model, the start token of an encoder-decoder one)."""
    if request.eos_token_id is not None:
        eos = (int(request.eos_token_id),)
    else:
        eos = tuple(defaults.eos_token_ids)
    pad = defaults.pad_token_id if defaults.pad_token_id is not None else (eos[0] if eos else None)
    prompt_len = 1 if encoder_decoder else len(request.input_ids)
    if defaults.min_new_tokens:
        min_new = int(defaults.min_new_tokens)
    else:
        min_new = max(0, int(defaults.min_length) - prompt_len)
    bad = tuple(tuple(int(t) for t in w) for w in defaults.bad_words_ids
                if len(w) > 0 and not (len(w) == 1 and int(w[0]) in eos))
    bad += tuple((int(t),) for t in defaults.suppress_tokens)  # an end token too, as generate()
    mode = request.mode
    max_new = int(request.max_new_tokens)
    return SearchParams(
        mode=mode, num_beams=int(request.num_beams) if mode == "beam" else 1,
        num_return_sequences=int(request.num_return_sequences), max_new_tokens=max_new,
        length_penalty=float(request.length_penalty), early_stopping=request.early_stopping,
        # an n-gram as long as the whole decoder sequence can never repeat: larger sizes act alike
        no_repeat_ngram_size=min(int(request.no_repeat_ngram_size), prompt_len + max_new),
        temperature=float(request.temperature),
        top_k=int(request.top_k), top_p=float(request.top_p), seed=request.seed, eos_token_ids=eos,
        pad_token_id=pad, forced_bos_token_id=defaults.forced_bos_token_id,
        forced_eos_token_id=defaults.forced_eos_token_id, bad_words_ids=bad, min_new_tokens=min_new,
        prompt_len=prompt_len)


@dataclass
class SearchResult:
    """One request's outcome: ``sequences`` best first (generated tokens only, no padding),
    ``scores`` (beam search: ``generate()``'s ``sequences_scores``; else None) and a finish
    reason per sequence: "eos", "length", or "cancelled" (removed before its search ended)."""

    sequences: list[list[int]]
    scores: list[float] | None
    finish_reasons: list[str] = field(default_factory=list)

    def generation(self, tenant: str) -> Generation:
        return Generation(tenant=tenant, sequences=self.sequences, scores=self.scores,
                          finish_reasons=self.finish_reasons)
