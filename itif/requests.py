"""What an inference request is and what it returns: plain data, no torch.

The scheduler, the daemon and the servers pass these around without loading the engine;
``itif.runtime.engine`` (and ``itif``) re-export them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from itif.errors import InvalidRequest

__all__ = ["OUTPUTS", "Request", "Result", "check_tenant_lengths", "check_token_rows", "numel",
           "utf8_bytes", "utf8_text"]

_MAX_INDEX = int(np.iinfo(np.intp).max)


def numel(name: str, shape: Sequence[int]) -> int:
    """Elements of input ``name``'s tensor of ``shape`` as a client declared it (exact: np.prod
    wraps around int64 for absurd shapes). Refused: a negative dimension, and a shape no array
    can take even without elements (its dimensions, zeros read as ones, multiply past the largest
    index)."""
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"input {name!r}: shape {list(shape)} has a negative dimension")
    if math.prod(max(int(d), 1) for d in shape) > _MAX_INDEX:
        raise InvalidRequest(f"input {name!r}: shape {[int(d) for d in shape][:8]} is too large")
    return math.prod(shape)


def check_token_rows(lengths: np.ndarray, ids: np.ndarray, max_len: int, vocab: int) -> None:
    """InvalidRequest naming the first bad request of rows of token ids (``lengths`` a row,
    ``ids`` flat, int64): a length outside 1..``max_len`` (the backbone's positions) first,
    then an id outside the vocabulary. The engine's check, written once: ``Engine.check``,
    ``Engine.infer_columns`` and the ingress processes (``itif.server.ingress_columns``) answer
    a call with the same message."""
    if lengths.min() < 1 or lengths.max() > max_len:
        i = int(np.flatnonzero((lengths < 1) | (lengths > max_len))[0])
        raise InvalidRequest(
            f"request {i}: input_ids length {int(lengths[i])} is outside 1..{max_len} (the "
            "backbone's maximum sequence length)")
    if ids.min() < 0 or ids.max() >= vocab:
        pos = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        i = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        raise InvalidRequest(f"request {i}: input_ids holds token id {int(ids[pos])}, which is "
                             f"outside the vocabulary [0, {vocab})")


def check_tenant_lengths(lengths: Sequence[int], tenant: str, max_seq_len: int | None) -> None:
    """InvalidRequest naming the first request longer than the tenant's ``max_seq_len``."""
    if max_seq_len is None:
        return
    for i, n in enumerate(lengths):
        if n > max_seq_len:
            raise InvalidRequest(f"request {i}: length {n} exceeds tenant {tenant!r}'s "
                                 f"max_seq_len {max_seq_len}")


def utf8_bytes(text: str, what: str) -> bytes:
    """``text`` in UTF-8; InvalidRequest naming ``what`` when it is not valid Unicode. A JSON
    string may hold a lone surrogate (``"\\ud800"``): Python takes it, UTF-8 and the tokenizers
    do not (gRPC's string fields are checked UTF-8 already)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what}: not valid Unicode text (a lone surrogate at character "
                             f"{e.start})") from None


#: The most characters of text a request may send per position of its backbone. Tokenizing
#: holds the GIL (and so the daemon's event loop, every tenant's calls) for about 0.8 s a MiB,
#: and a text is refused only once tokenized, if over the positions: a 12 MiB text stalled
#: another tenant's call for 10 s. English runs 4-5 characters a token.
TEXT_CHARS_PER_POSITION = 64


def utf8_text(text: str, what: str, positions: int | None = None) -> str:
    """``text``, checked as :func:`utf8_bytes` checks it (for a tokenizer, which takes str);
    with ``positions`` (the backbone's), refused first when longer than
    :data:`TEXT_CHARS_PER_POSITION` characters a position."""
    if positions is not None and len(text) > TEXT_CHARS_PER_POSITION * positions:
        raise InvalidRequest(
            f"{what}: {len(text)} characters, over the {TEXT_CHARS_PER_POSITION * positions} "
            f"a text may have on this backbone ({TEXT_CHARS_PER_POSITION} for each of its "
            f"{positions} positions): send a shorter text")
    utf8_bytes(text, what)
    return text


#: The outputs a request may ask for, in the order ``Result.as_dict`` lists them.
OUTPUTS = ("logits", "pooled", "last_hidden_state")


@dataclass
class Request:
    """One inference input of one tenant.

    Text backbones take ``input_ids`` (and optionally ``token_type_ids``), 1-D, at most the
    backbone's max positions; ViT takes ``pixel_values`` [C, H, W] float. ``outputs`` defaults to
    ``("logits",)`` for a tenant with a classification head and ``("pooled",)`` otherwise.
    """

    tenant: str
    input_ids: Sequence[int] | np.ndarray | None = None
    token_type_ids: Sequence[int] | np.ndarray | None = None
    pixel_values: np.ndarray | None = None
    outputs: Sequence[str] | None = None


@dataclass
class Result:
    """Outputs of one request (numpy float32); fields not asked for are None."""

    tenant: str
    logits: np.ndarray | None = None  # [num_labels]
    pooled: np.ndarray | None = None  # [hidden]: the pooler's output; without one, token 0's state
    last_hidden_state: np.ndarray | None = None  # [length, hidden]
    weights: str = ""  # the tag of the tenant's weights that produced it (the daemon: their sha256)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in OUTPUTS if getattr(self, k) is not None}
