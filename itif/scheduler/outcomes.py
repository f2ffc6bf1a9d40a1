"""What a failed batch's tickets get: which errors are one request's (isolated by bisection),
the grouping by tenant that keeps one tenant's failure from another's tickets, and the typed
error each ticket is failed with."""

from __future__ import annotations

import operator
import re
from typing import Any

from itif.errors import InvalidRequest, ItifError, NoWeights, TenantNotFound, is_out_of_memory
from itif.scheduler.tickets import InternalError, OutOfMemory, SchedulerTicket

__all__ = ["PER_REQUEST_ERRORS", "by_tenant", "count", "wrap"]

#: Errors that belong to one request, not to the whole batch: isolated by bisection.
PER_REQUEST_ERRORS = (InvalidRequest, TenantNotFound, NoWeights)
REQUEST_PREFIX = re.compile(r"^request \d+: ")


def count(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise InvalidRequest(f"{what} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise InvalidRequest(f"{what} must be an integer, got {v!r}") from None


def by_tenant(part: list[SchedulerTicket]) -> list[list[SchedulerTicket]]:
    """``part``'s tickets grouped by tenant, tenants in first-seen order."""
    groups: dict[str, list[SchedulerTicket]] = {}
    for t in part:
        groups.setdefault(t.tenant, []).append(t)
    return list(groups.values())


def wrap(exc: BaseException, part: list[SchedulerTicket]) -> ItifError:
    """The typed error every ticket of a failed (sub-)batch gets."""
    if isinstance(exc, ItifError):
        if len(part) == 1 and isinstance(exc, InvalidRequest) and exc.args:
            msg = REQUEST_PREFIX.sub("", str(exc.args[0]))  # "request 0:" means nothing to it
            try:
                new = type(exc)(msg)
                new.__cause__ = exc.__cause__
                return new
            except Exception:
                return exc
        return exc
    # the batch's size and the exception's text (shapes, allocation sizes) would tell a tenant
    # of the other tenants' requests beside its own: the daemon's log has them (``_call``)
    if is_out_of_memory(exc):
        err: ItifError = OutOfMemory(
            "the device ran out of memory running the batch this request was in: retry, or "
            "send fewer or shorter rows")
    else:
        err = InternalError(f"the batch this request was in failed ({type(exc).__name__}); "
                            "the daemon's log has the details")
    err.__cause__ = exc
    return err
