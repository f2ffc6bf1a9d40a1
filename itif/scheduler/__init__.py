"""The scheduler: per-tenant bounded queues in front of ONE fused engine.

    sched = Scheduler(engine.infer, max_batch_tokens=8192, max_batch_size=256, max_wait_ms=5)
    sched.set_tenant("acme", TenantQuota(max_queue=64, weight=2.0, latency_target_ms=100))
    sched.start()
    ticket = sched.submit(Request("acme", input_ids=ids), tokens=len(ids), deadline=now + 0.5)
    result = ticket.result()          # raises the request's typed error (itif.errors)
    sched.stop(grace_s=10)

One background thread forms batches from every tenant's queue and calls ``run_batch`` (normally
``Engine.infer``), so requests of many tenants run in one fused forward. Python work is per
request (heap pushes/pops), never per token.

When a batch runs (the triggers; TurboTransformers' "hungry" and "lazy" strategies)
-----------------------------------------------------------------------------------
The loop is the only caller of ``run_batch``, so the engine is idle exactly when the loop is
deciding. With queued work it runs a batch now when any of these holds:

1. *full*: the queued work fills a batch (``max_batch_tokens`` or ``max_batch_size``);
2. *hungry*: the oldest queued request arrived while the engine was busy (it has already waited a
   whole batch; waiting longer buys nothing) -- under load batches run back to back;
3. *lazy timeout*: the oldest queued request has waited ``max_wait_ms`` (a request reaching an
   idle engine waits at most that long for company);
4. *starvation guard*: for some tenant, its oldest request's wait plus the estimated run time of
   the next batch reaches half its ``latency_target_ms``;
5. the scheduler is stopping (drain as fast as possible).

Otherwise it sleeps until the earliest of those times, the next deadline, or a new submission.

How big a batch (latency sizing)
--------------------------------
A fused batch costs more the more it holds, and every member waits for all of it. With
``latency_sizing`` (off by default until the serving sweep shows it pays) a batch stops growing
at the first request whose addition would make a member miss its tenant's
``latency_target_ms`` that it would still meet in the batch as formed so far (predicted with
the run-time estimate). Members already past their target do not hold a batch back: under
overload batches still grow to the limits, which is what throughput needs. A formed batch whose
long members would hold its short ones back runs in two parts, the short ones first, when that
costs at most 5% of its time (``estimate.split_for_latency``). Off, batches grow to
``max_batch_tokens`` / ``max_batch_size`` and run whole.

The run-time estimate (``itif.scheduler.estimate``) is learned from the batches that ran:
fixed + per-request + per-token milliseconds, fitted online with exponential forgetting. It
also drives the starvation guard, with sizing on or off.

Which requests (weighted fairness)
----------------------------------
Start-time fair queueing over tenants, counted in tokens: every tenant has a virtual tag; a
batch repeatedly takes the head request of the tenant with the smallest tag and advances that
tag by ``tokens / weight``. A tenant whose queue was empty restarts at the system virtual time
(the tag of the last request taken), so idling banks no credit and a quiet tenant's new request
has the smallest tag: it goes into the very next batch however hard another tenant floods.
Backlogged tenants are served tokens in proportion to their weights. A head request that does
not fit the rest of the token budget leaves its tenant out of *this* batch only (it keeps the
smallest tag, so it is first in the next one); the first request of a batch always fits, even
when it alone exceeds ``max_batch_tokens``. Within a tenant: higher ``priority`` first, then
FIFO. Requests whose deadline passed are failed with :class:`DeadlineExceeded` and never run;
cancelled ones are skipped.

Parked tenants
--------------
``Scheduler.park(tenant)`` holds a tenant's requests out of every batch while its weights are
being loaded (``itif.weights.tiers``): they are accepted and queued as usual (limits,
deadlines, cancel, shutdown) but its queue leaves the active set, so neither batch formation nor
the triggers see it, and ``park(tenant, False)`` brings it back at the system virtual time.
Both are O(1). ``fail_parked`` fails a parked tenant's queued requests (its load failed).

Failures
--------
If ``run_batch`` raises for a batch, a per-request error (:class:`InvalidRequest`,
:class:`TenantNotFound`, :class:`NoWeights`) is isolated by bisection: the halves run again, so
only the bad requests fail (one bad request among n costs at most 2*ceil(log2 n) extra runs; the
budget is twice that, past it a still-failing part fails as a whole). Out-of-memory
(``itif.errors.is_out_of_memory``) runs each tenant's part of the batch again alone, once, so a
tenant whose rows do not fit fails only its own calls; a part that still runs out fails with
:class:`OutOfMemory` (RESOURCE_EXHAUSTED). Other typed errors fail the batch as they are, and
anything else becomes :class:`InternalError` (INTERNAL). The loop logs and carries on; it never
dies.

Modules
-------
``tickets`` (the value types, :class:`TenantQuota` with the limits of ``config.Tenant``, and
:class:`SchedulerTicket`), ``fairqueue`` (per-tenant queues, fair batch formation),
``triggers`` (when a batch runs), ``loop`` (:class:`Scheduler`: submission, lifecycle, the
loop, bisection). Nothing here imports the engine or torch: requests are
``itif.requests.Request``.
"""

from itif.scheduler.loop import Scheduler
from itif.scheduler.tickets import (
    InternalError,
    OutOfMemory,
    SchedulerStats,
    SchedulerTicket,
    TenantQuota,
    TenantStats,
)

__all__ = [
    "InternalError",
    "OutOfMemory",
    "Scheduler",
    "SchedulerStats",
    "TenantQuota",
    "TenantStats",
    "SchedulerTicket",
]
