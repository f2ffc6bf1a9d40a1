"""What the generation loop hands its callers: ``GenEvent`` (one event of a submitted request)
and ``GenTicket`` (a submitted request and its state in the loop). Kept apart from
``itif.generation.engine``, which re-exports both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from itif.errors import ItifError
from itif.generation.api import GenerateRequest, Generation
from itif.generation.running import JoiningRequest


@dataclass(frozen=True)
class GenEvent:
    """What the loop tells a submitter. ``kind``: "tokens" (``tokens``: new ids of sequence
    ``sequence``, greedy and sampling), "done" (``generation``) or "error" (``error``)."""

    kind: str
    tokens: list[int] | None = None
    sequence: int = 0
    generation: Generation | None = None
    error: ItifError | None = None


@dataclass(eq=False)
class GenTicket:
    """One submitted request (hashable by identity)."""

    id: int
    request: GenerateRequest
    on_event: Callable[[GenEvent], None] = field(repr=False)
    params: Any = field(default=None, repr=False)
    admission: JoiningRequest | None = field(default=None, repr=False)
    history: list[int] = field(default_factory=list, repr=False)
    stream: bool = False
    sink: Any = field(default=None, repr=False)  # its streamed tokens' consumer (or on_event)
    resume: Any = field(default=None, repr=False)  # preempted: its search state (search.Preempted)
    cancelled: bool = False
    done: bool = False


__all__ = ["GenEvent", "GenTicket"]
