"""What the daemon tells whoever watches it: the interface the server layer wires up.

``itif.daemon`` is the domain core and imports neither gRPC nor the metrics; the server
(``itif.server.app``) sets ``daemon.metrics`` to an object with these methods
(``itif.metrics.Metrics``), or leaves it ``None`` (tests, tools): then nothing is observed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from itif.requests import Request, Result
    from itif.scheduler import SchedulerTicket

__all__ = ["DaemonObserver"]


class DaemonObserver(Protocol):
    def note_tenant(self, tenant: str) -> None:
        """The tenant the current call was authorised for (the label of its counters)."""

    def watch(self, tenant: str, tickets: Sequence[SchedulerTicket]) -> None:
        """One accepted call of ``tenant``: its rows, as the scheduler finishes them."""

    def run_batch(self, engine) -> Callable[[list[Request]], list[Result]]:
        """The scheduler's ``run_batch`` for ``engine``: ``engine.infer`` plus observations."""

    def observe_tokens(self, tenant: str, seconds: float, count: int, first: bool) -> None:
        """A Generate call of ``tenant`` sent ``count`` tokens, ``seconds`` after its submit
        (``first``) or after its previous tokens."""

    def observe_column_batch(self, names, tenant, queued_s, compute_s: float, tokens: int,
                             forward_cpu_s: float, computed_rows: int = 0) -> None:
        """The column path answered a batch: a row's tenant as an index into ``names``, each
        row's wait ``queued_s``, the batch's time ``compute_s`` and ``tokens``, its forward's
        ``forward_cpu_s`` CPU seconds and ``computed_rows`` token rows (padding included)."""

    def forget_tenant(self, tenant: str) -> None:
        """``tenant`` left the configuration and its calls have finished: drop what is kept
        for it (its series, its call statistics)."""

    def observe_generation(self, tenant: str, unstreamed: int, first_s: float | None) -> None:
        """A Generate call ended: ``unstreamed`` tokens came only with its result;
        ``first_s``: seconds from submit to that result when nothing was streamed before."""
