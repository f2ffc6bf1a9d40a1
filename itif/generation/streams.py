"""Streamed tokens leave the GenEngine in bulk: one array per step per consumer.

A *consumer* is any object with ``put(ids, tokens)``. The GenEngine's loop thread calls it
once per step in which any of its requests appended a token, with two int64 numpy arrays of
one length that the consumer then owns: the requests' ids (``GenTicket.id``, each at most once)
and the token each appended, in no particular order. ``put`` must not block: it posts the
arrays on (to an event loop, a queue, shared memory) and returns. The server has one consumer
per event loop (``itif.server.generate``), so however many calls stream, a step makes one call
per event loop, and what grows with the requests is numpy's work, not the interpreter's.

A request submitted without a consumer streams through its own ``on_event``, a "tokens"
``GenEvent`` per step (what callers of ``GenEngine.submit`` got before consumers existed):
that costs the step a Python call per such request.

Why slots: the search carries each streaming row's request id and its consumer's slot as two
more per-row tensors (``SearchBatch.stream``), so a step's streamed rows come out as three
tensors and are split by slot with numpy, never looked up per request. ``Sinks`` numbers the
consumers; it holds them weakly (a consumer dropped by its owner, its event loop closed say,
is skipped: nobody is left to deliver to) and never reuses a slot, so a row tagged with a
dead consumer's slot can never reach another consumer.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger("itif.generation")

__all__ = ["Consumer", "Sinks"]


class Consumer(Protocol):
    def put(self, ids: np.ndarray, tokens: np.ndarray) -> None: ...


class Sinks:
    """The engine's consumers, by slot (see the module docstring)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._slot: dict[int, int] = {}  # id(consumer) -> its slot (checked: ids are reused)

    def slot(self, sink: Consumer | None) -> int:
        """``sink``'s slot, a new one for a consumer not seen before; -1 for None (the
        request's own callback). Once per request joining: a dict lookup."""
        if sink is None:
            return -1
        s = self._slot.get(id(sink))
        if s is not None and self._refs[s]() is sink:
            return s
        self._refs.append(weakref.ref(sink))
        self._slot[id(sink)] = len(self._refs) - 1
        return len(self._refs) - 1

    def hand_out(self, streamed: Sequence[torch.Tensor] | None, gone: list[int],
                 failed: Callable[[np.ndarray, Exception], None]) -> tuple[list, list]:
        """A step's streamed rows, (request id, slot, token) tensors, to their consumers: one
        host copy, then one ``put`` per consumer. ``gone``: requests cancelled since the step
        began (handed nothing more). A consumer whose ``put`` raises ends its requests of
        this step: ``failed(ids, error)``. Returns the (ids, tokens) lists of the requests
        without a consumer, for the engine to hand each to its own callback."""
        if streamed is None or not streamed[0].numel():
            return [], []
        sid, slot, tok = streamed
        a = torch.stack((sid, slot, tok)).cpu().numpy()
        if gone:
            a = a[:, ~np.isin(a[0], gone)]
        ids, slots, toks = a
        for s in np.unique(slots[slots >= 0]).tolist():
            mine = slots == s
            sink = self._refs[s]()
            if sink is None:
                continue
            try:
                sink.put(ids[mine], toks[mine])
            except Exception as e:  # its requests end; the step goes on
                log.exception("a token consumer raised; its %d requests are cancelled",
                              int(mine.sum()))
                failed(ids[mine], e)
        own = slots < 0
        return ids[own].tolist(), toks[own].tolist()
