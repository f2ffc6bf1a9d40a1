"""What the scheduler's loop runs besides tickets: a :class:`ColumnSource`.

The column path (``itif.server.column_door``) keeps its own queue of rows as numpy columns and
runs its own batches; the scheduler's thread asks it for work whenever it looks for its own, so
the engine still has one caller. When both have a batch due they take turns.
"""

from __future__ import annotations

from typing import Callable, Protocol

__all__ = ["ColumnSource"]


class ColumnSource(Protocol):
    """A source of batches that are not tickets (``itif.server.column_door``): it keeps its
    own queue and runs its own batches, on the scheduler's thread."""

    def decide(self, now: float, *, last_end: float, estimate_ms: Callable[[int, int], float],
               stopping: bool) -> tuple[bool, float | None]:
        """(a batch is due now?, else when to look again). Called under the scheduler's
        lock: take in arrivals, never run the engine here."""

    def run(self) -> tuple[int, int] | None:
        """Form and run one batch, deliver its results; (rows, tokens) run, or None."""

    def wake_fds(self) -> tuple[int, ...]:
        """Pipes whose bytes say arrivals came in: the loop sleeps on them (``poll``) and
        reads them empty when it wakes."""

    def forwarding(self, on: bool) -> None:
        """This loop starts (``on``) or ends a forward of its own batches: the source may take
        its arrivals in meanwhile (from another thread)."""

    def queue_depth(self, tenant: str) -> int:
        """The tenant's rows queued in the source (not running)."""

    def outstanding(self, tenant: str) -> int:
        """The tenant's rows queued in the source or running."""

    def pending(self) -> int:
        """Rows queued in the source: a stopping loop runs them before it ends."""

    def stopped(self) -> None:
        """The loop has ended: the source refuses what is left, and what comes later."""
