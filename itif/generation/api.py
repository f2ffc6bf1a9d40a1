"""What a generation request is and what it returns: plain data, no torch.

``GenerateRequest`` mirrors the arguments of Hugging Face ``generate()`` that itif serves; the
daemon, the CLI and ``GenEngine.generate`` all take it. ``check_request`` is the one place that
decides whether a request's parameters make sense; its errors name the offending field, so the
servers can answer INVALID_ARGUMENT with the message as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from itif.errors import InvalidRequest

__all__ = [
    "HF_TOP_K",
    "EarlyStopping",
    "GenerateRequest",
    "Generation",
    "GenerationDefaults",
    "check_request",
    "MAX_BEAMS",
    "MAX_LOG_LENGTH_PENALTY",
    "MAX_NO_REPEAT_NGRAM",
    "TEMPERATURE_RANGE",
]

EarlyStopping = bool | Literal["never"]

#: Widest beam a request may ask for: the search keeps ``2 * num_beams`` candidates per step.
MAX_BEAMS = 16

#: Largest ``no_repeat_ngram_size``: the ban compares every row of the running batch with its
#: whole history over the batch's largest size, so one request's size would set every
#: tenant's cost (memory: rows x positions x size).
MAX_NO_REPEAT_NGRAM = 64

#: Sampling temperatures served. The search keeps them in float32 and divides logits by them:
#: far outside this range the quotient overflows (below) or every token is equally likely (above).
TEMPERATURE_RANGE = (1e-6, 1e6)

#: Beam search divides a score by ``length ** length_penalty`` in float32 for every length up to
#: ``max_new_tokens``: ``|length_penalty| * ln(max_new_tokens)`` must stay under this (e**80 is
#: about 5.5e34, float32 ends at 3.4e38).
MAX_LOG_LENGTH_PENALTY = 80.0


@dataclass
class GenerateRequest:
    """One generation input of one tenant (the ``generate()`` arguments itif honours).

    ``input_ids``: the prompt (decoder-only) or the source sequence (encoder-decoder), 1-D.
    ``eos_token_id``: None takes the tenant's checkpoint generation settings.
    ``early_stopping``: True, False or "never", as in ``generate()``.
    """

    tenant: str
    input_ids: Sequence[int]
    max_new_tokens: int = 20
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    no_repeat_ngram_size: int = 0
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off (an unset top_k of the itif API's Generate is HF_TOP_K)
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | None = None

    @property
    def mode(self) -> Literal["greedy", "sample", "beam"]:
        if self.do_sample:
            return "sample"
        return "beam" if self.num_beams > 1 else "greedy"


@dataclass
class Generation:
    """What one request produced.

    ``sequences``: ``num_return_sequences`` lists of generated token ids, best first for beam
    search, without the prompt (decoder-only) or the decoder start token (encoder-decoder), and
    without trailing padding. ``scores``: the beam scores (length-penalised sum of log
    probabilities, as ``generate()``'s ``sequences_scores``) for beam search, else None.
    """

    tenant: str
    sequences: list[list[int]]
    scores: list[float] | None = None
    finish_reasons: list[str] = field(default_factory=list)  # "eos" or "length", per sequence


@dataclass(frozen=True)
class GenerationDefaults:
    """A tenant checkpoint's generation settings (``generation_config.json``, else ``config.json``),
    honoured as ``generate()`` honours them when the request does not say otherwise.

    ``eos_token_ids``: every id that ends a sequence (a request's ``eos_token_id`` replaces them);
    ``bad_words_ids``: single-token bans (Marian bans its pad token); ``forced_*``: the token
    forced at the first / last allowed step (BART); ``suppress_tokens``: banned at every step
    (an end token among them too, unlike a bad word: ``SuppressTokensLogitsProcessor``).
    """

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    decoder_start_token_id: int | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    suppress_tokens: tuple[int, ...] = ()  # banned at every step, an end token too


#: generate()'s top_k when neither the call nor the checkpoint sets one (transformers'
#: GenerationConfig default): what an unset ``top_k`` of the itif API's Generate means.
HF_TOP_K = 50


def check_request(r: GenerateRequest, max_new_tokens_limit: int,
                  vocab_size: int | None = None) -> None:
    """Raise InvalidRequest naming the field when ``r``'s parameters are out of range or
    conflict."""

    def bad(name: str, why: str) -> InvalidRequest:
        return InvalidRequest(f"{name}: {why}")

    if len(r.input_ids) == 0:
        raise bad("input_ids", "is empty")
    if vocab_size is not None:
        lo, hi = min(r.input_ids), max(r.input_ids)
        if lo < 0 or hi >= vocab_size:
            raise bad(
                "input_ids",
                f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})",
            )
    if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
        raise bad("max_new_tokens", f"must be at least 1, got {r.max_new_tokens!r}")
    if r.max_new_tokens > max_new_tokens_limit:
        raise bad("max_new_tokens", f"{r.max_new_tokens} is over the limit {max_new_tokens_limit}")
    if not isinstance(r.num_beams, int) or not 1 <= r.num_beams <= MAX_BEAMS:
        raise bad("num_beams", f"must be in [1, {MAX_BEAMS}], got {r.num_beams!r}")
    if not isinstance(r.num_return_sequences, int) or r.num_return_sequences < 1:
        raise bad("num_return_sequences", f"must be at least 1, got {r.num_return_sequences!r}")
    if r.early_stopping not in (True, False, "never"):
        raise bad("early_stopping", f"must be true, false or \"never\", got {r.early_stopping!r}")
    if not math.isfinite(r.length_penalty):
        raise bad("length_penalty", f"must be finite, got {r.length_penalty!r}")
    if (r.mode == "beam"
            and abs(r.length_penalty) * math.log(r.max_new_tokens) > MAX_LOG_LENGTH_PENALTY):
        raise bad("length_penalty", f"{r.length_penalty!r} with max_new_tokens {r.max_new_tokens}: "
                  f"max_new_tokens ** |length_penalty| overflows float32 (|length_penalty| * "
                  f"ln(max_new_tokens) must be at most {MAX_LOG_LENGTH_PENALTY:g})")
    if not isinstance(r.no_repeat_ngram_size, int) or r.no_repeat_ngram_size < 0:
        raise bad(
            "no_repeat_ngram_size", f"must be 0 (off) or more, got {r.no_repeat_ngram_size!r}"
        )
    if r.no_repeat_ngram_size > MAX_NO_REPEAT_NGRAM:
        raise bad("no_repeat_ngram_size", f"{r.no_repeat_ngram_size} is over the limit "
                  f"{MAX_NO_REPEAT_NGRAM}")
    if r.do_sample:
        if r.num_beams > 1:
            raise bad("num_beams", "sampling with num_beams > 1 (beam sampling) is not served; "
                      "use do_sample with num_beams 1, or beam search without do_sample")
        lo, hi = TEMPERATURE_RANGE
        if not lo <= r.temperature <= hi:
            raise bad("temperature", f"must be in [{lo:g}, {hi:g}], got {r.temperature!r}")
        if not isinstance(r.top_k, int) or r.top_k < 0:
            raise bad("top_k", f"must be 0 (off) or more, got {r.top_k!r}")
        if not (0.0 <= r.top_p <= 1.0):  # 0 keeps the most likely token, as generate()'s does
            raise bad("top_p", f"must be in [0, 1], got {r.top_p!r}")
    else:
        for name, value, neutral in (("temperature", r.temperature, 1.0), ("top_k", r.top_k, 0),
                                     ("top_p", r.top_p, 1.0), ("seed", r.seed, None)):
            if value != neutral:
                raise bad(name, f"is set ({value!r}) but do_sample is false")
        if r.num_beams == 1 and r.num_return_sequences > 1:
            raise bad("num_return_sequences", "greedy search returns one sequence; "
                      "use num_beams >= num_return_sequences or do_sample")
        if r.num_return_sequences > r.num_beams:
            raise bad("num_return_sequences",
                      f"{r.num_return_sequences} is more than num_beams {r.num_beams}")
    if (r.eos_token_id is not None and vocab_size is not None
            and not 0 <= r.eos_token_id < vocab_size):
        raise bad("eos_token_id", f"{r.eos_token_id} outside the vocabulary [0, {vocab_size})")
