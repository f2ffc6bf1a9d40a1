"""The daemon's end of the column path: the ingress processes' Infer calls, in bulk.

With ingress processes (``server.ingress_processes``), an Infer or InferBatch call of token ids
never becomes a Python object in the daemon. The ingress process that received it checks it
(auth, the tenant, lengths, ids: ``itif.server.ingress_columns``) and writes it, with the other
calls of the same turn of its event loop, as one :class:`~itif.hostpath.Arrivals` into its ring;
the daemon answers with one :class:`~itif.hostpath.Results` a batch::

    ingress k  --Arrivals ring k-->  ColumnDoor.decide: push into the ColumnQueue (numpy)
                                     ColumnDoor.run:    take, Engine.infer_columns, Results
    ingress k  <--Results ring k---  (rows split by the ingress process that sent them)

A call's id carries its ingress process (the top bits, :data:`FRONTEND_SHIFT`), so results go
back to the ring they came from. What does not fit the path (text, token types, explicit
outputs, a tenant the ingress process has no ready entry for, any call that would fail a check)
goes by frame to the daemon's own servicer, as before, and gets its exact answer there.

Threads: ``decide`` and ``run`` run on the scheduler's loop thread (``Scheduler.attach_columns``):
the engine keeps one caller, and the column batches and the ticket batches take turns. That
loop sleeps on every arrival ring's wake-up pipe (:meth:`ColumnDoor.wake_fds`,
``itif.scheduler.wakeup``), so arrivals wake it with no thread in between; the event loop
publishes the tenant table to the ingress processes (:meth:`ColumnDoor.snapshot`).
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time

import numpy as np

from itif import threadnames
from itif.daemon_state import State
from itif.errors import ItifError, TenantNotFound, clip
from itif.hostpath.colqueue import ColumnQueue
from itif.hostpath.columns import STATUS, Arrivals, Results, status_code
from itif.hostpath.ring import Ring
from itif.scheduler.outcomes import wrap
from itif.scheduler.tickets import TenantQuota
from itif.scheduler.wakeup import drain as _drain
from itif.server.ingress_columns import FRONTEND_SHIFT

log = logging.getLogger("itif.server.columns")

__all__ = ["FRONTEND_SHIFT", "ColumnDoor"]

_MESSAGES = {
    "NOT_FOUND": "tenant not found",
    "INVALID_ARGUMENT": "a row's length is outside the tenant's max_seq_len or the backbone's",
    "RESOURCE_EXHAUSTED": "the tenant's queue is full (max_queue); retry",
    "DEADLINE_EXCEEDED": "deadline exceeded before the request could run",
    "UNAVAILABLE": "the daemon is shutting down",
    "INTERNAL": "the daemon could not queue the request; its log has the details",
}
_OK = 0
_EXPIRED, _UNAVAILABLE = status_code("DEADLINE_EXCEEDED"), status_code("UNAVAILABLE")
_NO_ROWS = np.zeros(0, np.int32)
_COUNT, _MIN = np.count_nonzero, np.minimum.reduce


class ColumnDoor:
    """The rings of ``frontends`` ingress processes, the column queue, and the batches it runs.

    ``READ_GAP_S``: during a forward, arrivals are taken in (and refused when there is no room)
    this often; ``IDLE_S`` after the last forward, the reader thread sleeps until the next.

    ``arrival_slot_bytes``: the largest batch of arrivals an ingress process writes at once (a
    larger call goes by frame); ``result_slot_bytes``: the largest batch of results (split into
    parts when larger).
    """

    READ_GAP_S = 0.015
    IDLE_S = 0.5

    def __init__(self, frontends: int, *, slots: int = 16, arrival_slot_bytes: int = 1 << 20,
                 result_slot_bytes: int = 4 << 20) -> None:
        self.frontends = frontends
        self.arrivals = [Ring(slots, arrival_slot_bytes) for _ in range(frontends)]
        self.results = [Ring(slots, result_slot_bytes) for _ in range(frontends)]
        self._in = [r.consumer() for r in self.arrivals]
        self._out = [r.producer() for r in self.results]
        self.daemon = None
        self.queue: ColumnQueue | None = None
        self._config = None
        self._labels: dict[tuple[str, str], int] = {}  # (tenant, weights sha) -> num_labels
        self._names: dict[str, int] = {}  # tenant -> queue index (``_index``)
        #: rows taken in / answered / refused, batches run (tests and the serve bench read them)
        self.rows_in = self.rows_answered = self.rows_refused = self.batches = 0
        self.rows_withdrawn = 0
        self.decisions = 0  # times the scheduler asked whether a batch is due
        #: The queue and the rings' read side are the scheduler thread's, and, while it runs a
        #: forward, the reader thread's (:meth:`forwarding`); results are written by both.
        self._mutex = threading.Lock()
        self._out_lock = threading.RLock()
        self._forwarding = threading.Event()
        self._last_forward = -math.inf  # when the last forward ended (the reader's pace)
        self._forward_start = -math.inf  # when the running (or last) forward started
        self._stop = threading.Event()
        self._refusing = False  # the scheduler ended: arrivals are refused UNAVAILABLE
        self._running = _NO_ROWS  # the tenant index of each row of the batch in the forward
        self._reader: threading.Thread | None = None

    # ---- the ingress processes' side -------------------------------------------------------
    def spec(self, index: int) -> dict:
        """What ingress process ``index`` needs to attach (its fds: :meth:`fds`)."""
        return {"index": index, "frontends": self.frontends,
                "arrivals": self.arrivals[index].handle("producer"),
                "results": self.results[index].handle("consumer")}

    def fds(self, index: int) -> tuple[int, ...]:
        """The pipe ends ingress process ``index`` inherits."""
        return (*self.arrivals[index].handle("producer")["fds"],
                *self.results[index].handle("consumer")["fds"])

    def snapshot(self) -> dict | None:
        """The tenant table as the ingress processes check calls against it: each ready
        tenant's index, token digest, weights, head and limits. None until bound."""
        d, q = self.daemon, self.queue
        if d is None or q is None or not d.ready:
            return None
        cfg = d.config
        eng = d.engine
        index = {n: i for i, n in enumerate(q.names)}
        tenants, known, seen = {}, self._labels, {}
        for t in cfg.tenants:
            st = d.tenants.status.get(t.id)
            i = index.get(t.id)
            if st is None or st.state is not State.READY or i is None or t.id not in eng.store:
                continue
            key = (t.id, st.sha256)
            labels = known.get(key)
            if labels is None:
                labels = eng.tenant_info(t.id).num_labels or 0
            seen[key] = labels
            limit = min(t.max_seq_len or eng.max_seq_len, eng.max_seq_len)
            tenants[t.id] = (i, t.token_sha256, st.sha256, labels, limit,
                             t.max_inflight or 2 * t.max_queue, t.max_queue)
        self._labels = seen  # the tenants of this snapshot only: weights replaced drop out
        return {"admin": cfg.server.admin_token_sha256, "tenants": tenants,
                "hidden": eng.spec.hidden, "vocab": eng.spec.vocab_size,
                "max_len": eng.max_seq_len,
                "retry_after_ms": cfg.server.retry_after_ms,
                "max_inflight_calls": cfg.server.max_inflight_calls}

    # ---- the daemon's side ------------------------------------------------------------------
    def bind(self, daemon) -> bool:
        """Serve ``daemon`` (started): an encoder backbone whose weights all stay on the
        device. False (the ingress processes keep sending every call by frame) otherwise."""
        eng = daemon.engine
        if daemon.generator is not None or daemon.tiers is not None or not eng.spec.is_text:
            log.info("column path off: %s", "a decoder" if daemon.generator is not None else
                     "weight tiers" if daemon.tiers is not None else "not a text backbone")
            return False
        self.queue = ColumnQueue(max_len=eng.max_seq_len, vocab=eng.spec.vocab_size)
        self.daemon = daemon
        self._sync(daemon.config)
        daemon.scheduler.attach_columns(self)
        self._reader = threading.Thread(target=self._read_while_forwarding,
                                        name="itif-columns", daemon=True)
        self._reader.start()
        return True

    def close(self) -> None:
        if self.daemon is not None:
            log.info("column path: %d rows in, %d answered, %d refused, %d batches, %d decisions",
                     self.rows_in, self.rows_answered, self.rows_refused, self.batches,
                     self.decisions)
        self._stop.set()
        self._forwarding.set()  # the reader sees the stop
        if self.daemon is not None and self.daemon.scheduler is not None:
            self.daemon.scheduler.attach_columns(None)
        if self._reader is not None:
            self._reader.join(2.0)
        for ring in (*self.arrivals, *self.results):  # its ends too (they share its mapping)
            ring.close()

    def wake_fds(self) -> tuple[int, ...]:
        """Every arrival ring's wake-up pipe: the scheduler's loop sleeps on them."""
        return tuple(r.handle("consumer")["fds"][0] for r in self.arrivals)

    def forwarding(self, on: bool) -> None:
        """The scheduler's thread starts (``on``) or ends a forward: meanwhile the reader
        thread takes arrivals in, so a call the queue has no room for is refused at once, not
        after the forward (reliability promise 10), while the scheduler's thread reads the
        rings itself between forwards, with no thread in between."""
        if on:
            self._forward_start = time.monotonic()
            self._forwarding.set()
        else:
            with self._mutex:  # the reader is not inside a take-in from here on
                self._forwarding.clear()
            self._last_forward = time.monotonic()

    def _read_while_forwarding(self) -> None:
        threadnames.adopt()
        poller = select.poll()
        for fd in self.wake_fds():
            poller.register(fd, select.POLLIN)
        looked = -math.inf  # the reader's last look at the rings
        while not self._stop.is_set():
            # busy (a forward runs or ended within IDLE_S): a look once a forward has run
            # READ_GAP_S, then every READ_GAP_S while it lasts, or when a queued row's deadline
            # passes (it leaves the queue then, as a ticket does, not at the next batch). A
            # shorter forward gets no look: the scheduler's thread reads the rings right after
            # it, so a refusal still waits at most READ_GAP_S. A look costs ~100 us of CPU
            # (it takes the GIL from the forward between two of its ops), a wake-up a forward
            # ~40 us, a look at each flush of each ingress process ~50 us a request. Idle:
            # asleep until a forward.
            now = time.monotonic()
            if not self._forwarding.is_set() and now - self._last_forward > self.IDLE_S:
                self._forwarding.wait(self.IDLE_S)
                continue
            if self._forwarding.is_set():  # between forwards the scheduler's thread expires
                at = min(max(self._forward_start, looked) + self.READ_GAP_S,
                         self.queue.next_deadline)
            else:
                at = now + self.READ_GAP_S
            self._stop.wait(max(0.001, at - now))
            with self._mutex:
                now = time.monotonic()
                if (self._stop.is_set() or not self._forwarding.is_set()
                        or (now - self._forward_start < self.READ_GAP_S
                            and now < self.queue.next_deadline)):
                    continue  # the scheduler's thread reads them (its pipe bytes stay)
                looked = now
                got = poller.poll(0)
                for fd, _ in got:
                    _drain(fd)
                try:
                    self._refresh(now)
                    if got:
                        self._take_in(now, self._refusing)
                except Exception:  # noqa: BLE001 - the thread must live; the rows stay queued
                    log.exception("arrivals could not be taken in during a forward")

    def _index(self) -> dict[str, int]:
        """Tenant name -> its index in the queue's table (which only grows)."""
        names = self.queue.names
        if len(self._names) != len(names):
            self._names = {n: i for i, n in enumerate(names)}
        return self._names

    def _sync(self, cfg) -> None:
        """The queue's tenants and quotas as ``cfg`` says (a reload: on the loop thread)."""
        q = self.queue
        ids = set()
        for t in cfg.tenants:
            q.add_tenant(t.id, TenantQuota.from_tenant(t))
            ids.add(t.id)
        for i, name in enumerate(q.names):
            if q.live[i] and name not in ids:
                q.remove_tenant(name)
        quota = {t.id: t.max_queue for t in cfg.tenants}
        # each queue index's max_queue (a removed tenant's: never over), one past for strays
        self._max_queue = np.array([quota.get(n, 1 << 62) for n in q.names] + [1 << 62],
                                   np.int64)
        self._config = cfg

    # ---- the scheduler's source (``itif.scheduler.sources.ColumnSource``) --------------------
    def decide(self, now: float, *, last_end: float, estimate_ms, stopping: bool
               ) -> tuple[bool, float | None]:
        self.decisions += 1
        sch = self.daemon.config.scheduler
        with self._mutex:  # the reader thread pushes into the same queue during forwards
            self._refresh(now)
            self._take_in(now, stopping)
            return self.queue.due(now, max_tokens=sch.max_batch_tokens,
                                  max_rows=sch.max_batch_size, max_wait_ms=sch.max_wait_ms,
                                  last_end=last_end, estimate_ms=estimate_ms, stopping=stopping)

    def queue_depth(self, tenant: str) -> int:
        """The tenant's rows queued here (the admin API adds them to its queue depth)."""
        return self._rows_of(tenant)[0]

    def outstanding(self, tenant: str) -> int:
        """The tenant's rows queued or in the running batch: a removed tenant's weights stay
        until they are answered (``itif.daemon_config``), as its tickets' do."""
        return sum(self._rows_of(tenant))

    def _rows_of(self, tenant: str) -> tuple[int, int]:
        """(rows queued, rows in the running batch) of ``tenant``."""
        with self._mutex:
            i = self._index().get(tenant) if self.queue is not None else None
            if i is None:
                return 0, 0
            return int(self.queue.depth[i]), int(_COUNT(self._running == i))

    def pending(self) -> int:
        """Rows queued here: a stopping scheduler runs them before it ends."""
        return 0 if self.queue is None else self.queue.queued

    def stopped(self) -> None:
        """The scheduler's loop ended (shutdown): the rows still queued (its grace ran out),
        and every arrival from here, are refused UNAVAILABLE by the reader thread."""
        with self._mutex:
            self._refusing = True
            left = self.queue.withdraw()
            if left.size:
                self._refuse(left, np.full(left.size, _UNAVAILABLE, np.int8))
            self._forwarding.set()

    def _refresh(self, now: float) -> None:
        """Before arrivals are taken in (by either thread, under the mutex): a reload of
        tenants.yaml applied to the queue, and rows whose deadline passed out of it,
        DEADLINE_EXCEEDED (they would hold their tenant's room until the next batch)."""
        cfg = self.daemon.config
        if cfg is not self._config:
            self._sync(cfg)
        if now >= self.queue.next_deadline:
            call_id, _ = self.queue.expire(now)
            if call_id.size:
                self._refuse(call_id, np.full(call_id.size, _EXPIRED, np.int8))

    def _take_in(self, now: float, stopping: bool) -> None:
        """Every published arrival batch of every ring into the queue, as one batch (one
        unpack, one push: the engine's cost is per push, not per row), slots released."""
        taken = [(c, c.ready()) for c in self._in]
        views = [v for _, vs in taken for v in vs]
        if not views:
            return
        a = None
        try:
            a = Arrivals.unpack_many(views)  # a copy: the slots are free again at once
        except Exception:  # never leave a slot unread: that would spin
            log.exception("arrivals could not be read; their calls fail INTERNAL")
            status, call_id = self._unreadable(views)
        finally:
            views = None  # no view of a slot outlives its release
            for c, vs in taken:
                c.release(len(vs))
            taken = None
        if a is not None and a.tenant.size and int(_MIN(a.tenant)) < 0:
            a = self._withdraw(a)
        if a is not None:
            call_id = a.call_id
            try:
                status = (np.full(len(a), _UNAVAILABLE, np.int8) if stopping
                          else self.queue.push(a, now))
            except Exception:  # the calls fail, the loop goes on
                log.exception("arrivals could not be queued; their calls fail INTERNAL")
                status = np.full(len(a), status_code("INTERNAL"), np.int8)
        self.rows_in += call_id.size
        if _COUNT(status):  # _OK is 0
            if a is not None:
                self._over_max_queue(a, status)
            bad = status != _OK
            self._refuse(call_id[bad], status[bad])

    def _withdraw(self, a: Arrivals) -> Arrivals:
        """``a`` less its withdrawals (rows of tenant -1: the ingress process's callers that
        cancelled), whose calls' queued rows leave the queue, unanswered."""
        gone = a.tenant < 0
        self.rows_withdrawn += self.queue.withdraw(a.call_id[gone]).size
        keep = np.flatnonzero(~gone)
        ids, offsets = _gather(a.ids, a.offsets, keep)
        return Arrivals(a.call_id[keep], a.tenant[keep], offsets, ids, a.deadline[keep],
                        a.priority[keep], a.table_version)

    def _over_max_queue(self, a: Arrivals, status: np.ndarray) -> None:
        """Refuse, as the servicer does (INVALID_ARGUMENT, never "retry"), the calls with more
        rows than their tenant may ever queue (a snapshot older than a reload of max_queue let
        them through); their rows' status is set to OK here, done with. Vectorised: under a
        flood most refusals are plain RESOURCE_EXHAUSTED and cost no loop."""
        full = status == status_code("RESOURCE_EXHAUSTED")
        if not full.any():
            return
        _, inverse, counts = np.unique(a.call_id, return_inverse=True, return_counts=True)
        limit = self._max_queue[np.minimum(a.tenant, self._max_queue.size - 1)]
        over = full & (counts[inverse] > limit)
        for cid in np.unique(a.call_id[over]).tolist():  # only calls that can never fit
            mine = np.flatnonzero(a.call_id == cid)
            name = self.queue.names[int(a.tenant[mine[0]])]
            try:
                TenantQuota(max_queue=int(limit[mine[0]])).refuse_call(name, int(mine.size))
            except ItifError as e:
                self._refuse(a.call_id[mine], np.full(mine.size, status_code(e.code), np.int8),
                             str(e))
                status[mine] = _OK

    @staticmethod
    def _unreadable(views) -> tuple[np.ndarray, np.ndarray]:
        """(INTERNAL, call ids) for the rows of slots that failed to queue, read as plainly as
        can be; none when even that fails (their callers time out)."""
        try:
            ids = np.concatenate([Arrivals.unpack(v).call_id for v in views])
        except Exception:  # noqa: BLE001 - a slot that cannot be read at all
            ids = np.zeros(0, np.int64)
        return np.full(ids.size, status_code("INTERNAL"), np.int8), ids

    def run(self) -> tuple[int, int] | None:
        sch = self.daemon.config.scheduler
        with self._mutex:
            taken = self.queue.take(sch.max_batch_tokens, sch.max_batch_size)
        if taken.expired_call_id.size:
            self._refuse(taken.expired_call_id, np.full(taken.expired_call_id.size,
                                                        status_code("DEADLINE_EXCEEDED"), np.int8))
        n = len(taken)
        if not n:
            return None
        cpu, start, compute_s, computed = time.thread_time(), time.monotonic(), None, 0
        metrics = self.daemon.metrics
        self._running = taken.tenant
        try:
            self.forwarding(True)
            try:
                out = self.daemon.engine.infer_columns(taken.tenant, taken.ids, taken.offsets,
                                                       table=self.queue.names)
            finally:
                self.forwarding(False)
            cpu = time.thread_time() - cpu
            self._send(Results.ok(taken.call_id, out.offsets, out.values)
                       .with_weights(self._index(), out.weights))
            compute_s, computed = time.monotonic() - start, out.computed_rows
        except Exception as e:  # noqa: BLE001 - each tenant's rows alone: its error is its own
            cpu = time.thread_time() - cpu
            self._per_tenant(taken, e)
        finally:
            self._running = _NO_ROWS
        self.batches += 1
        if metrics is not None and compute_s is not None:  # answered: as a ticket batch's
            metrics.observe_column_batch(self.queue.names, taken.tenant, start - taken.enqueued,
                                         compute_s, int(taken.offsets[-1]), cpu, computed)
        return n, int(taken.offsets[-1])

    def _per_tenant(self, taken, first: Exception) -> None:
        """After a batch failed: each tenant's rows run alone; a tenant whose rows fail gets
        its error (a one-tenant batch keeps the first error without a second run)."""
        tenants = np.unique(taken.tenant)
        for t in tenants.tolist():
            rows = np.flatnonzero(taken.tenant == t)
            ids, offsets = _gather(taken.ids, taken.offsets, rows)
            try:
                if tenants.size == 1:
                    raise first
                out = self.daemon.engine.infer_columns(taken.tenant[rows], ids, offsets,
                                                       table=self.queue.names)
                self._send(Results.ok(taken.call_id[rows], out.offsets, out.values)
                           .with_weights(self._index(), out.weights))
            except Exception as e:  # noqa: BLE001 - the rows' status says what went wrong
                if isinstance(e, TenantNotFound):  # configured but without ready weights:
                    e = self._not_ready(self.queue.names[t], e)  # the servicer's answer
                err = wrap(e, ())  # as the ticket path types it (out of memory, internal)
                if not isinstance(e, ItifError):
                    log.warning("a column batch of tenant %s failed: %s: %s",
                                self.queue.names[t], type(e).__name__, e)
                code = err.code if err.code in STATUS else "INTERNAL"
                msg = clip(str(err.args[0]) if err.args else code)
                self._refuse(taken.call_id[rows], np.full(rows.size, status_code(code), np.int8),
                             msg)

    def _not_ready(self, tenant: str, error: Exception) -> Exception:
        """What the daemon's servicer answers for ``tenant``, whose weights the forward did not
        find (its snapshot entry was older than a delete or a failed load): NoWeights naming
        its state while it is configured, else ``error``."""
        try:
            self.daemon.tenants.check_ready(tenant)
        except ItifError as e:
            return e
        return error

    def _refuse(self, call_id: np.ndarray, status: np.ndarray, message: str | None = None
                ) -> None:
        n = call_id.size
        self.rows_refused += n
        errors = {i: message or _MESSAGES.get(STATUS[s], STATUS[s])
                  for i, s in enumerate(status.tolist())}
        self._send(Results.build(call_id, status, np.zeros(n + 1, np.int64),
                                 np.zeros(0, np.float32), errors))

    def _send(self, res: Results) -> None:
        """``res``'s rows to the rings of the ingress processes that sent them."""
        fe = res.call_id >> FRONTEND_SHIFT
        first = int(fe[0]) if fe.size else 0
        if not _COUNT(fe != first):
            parts = [(first, res)]
        elif res.err_row.size:  # failures (rare): each part keeps its rows' messages
            parts = [(int(k), _rows(res, np.flatnonzero(fe == k))) for k in np.unique(fe)]
        else:
            parts = _split_ok(res, fe)
        for k, part in parts:
            if 0 <= k < self.frontends:
                self._put(k, part)
            self.rows_answered += len(part)

    def _put(self, k: int, res: Results) -> None:
        with self._out_lock:  # the scheduler's thread and the reader's both answer
            self._put_locked(k, res)

    def _put_locked(self, k: int, res: Results) -> None:
        out = self._out[k]
        if res.nbytes() > out.slot_bytes and len(res) > 1:
            half = len(res) // 2
            self._put(k, _rows(res, np.arange(half)))
            self._put(k, _rows(res, np.arange(half, len(res))))
            return
        try:
            out.put(res, timeout=2.0)
        except Exception:  # noqa: BLE001 - an ingress process that stopped reading loses its
            log.warning("ingress process %d does not read its results; %d dropped (its "
                        "callers time out)", k, len(res))  # calls, nobody else's


def _split_ok(res: Results, fe: np.ndarray) -> list[tuple[int, Results]]:
    """``res`` (no failed row) as one part an ingress process (``fe``: each row's): one stable
    reorder by ingress process, then each part is a slice of it (a loop over the ingress
    processes, never over rows)."""
    order = fe.argsort(kind="stable")
    fs = fe[order]
    values, offsets = _gather(res.values, res.offsets, order)
    call_id = res.call_id[order]
    bounds = [0, *(np.flatnonzero(fs[1:] != fs[:-1]) + 1).tolist(), fs.size]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lo = int(offsets[a])
        part = Results.ok(call_id[a:b], offsets[a : b + 1] - lo, values[lo : int(offsets[b])])
        part.w_tenant, part.w_tag = res.w_tenant, res.w_tag
        parts.append((int(fs[a]), part))
    return parts


def _rows(res: Results, rows: np.ndarray) -> Results:
    """The results of ``rows`` (ascending) of ``res``, with its weights table."""
    values, offsets = _gather(res.values, res.offsets, rows)
    if not res.err_row.size:
        part = Results.ok(res.call_id[rows], offsets, values)
    else:
        errs = res.errors()  # failures only: a message each
        keep = {j: errs[r] for j, r in enumerate(rows.tolist()) if r in errs}
        part = Results.build(res.call_id[rows], res.status[rows], offsets, values, keep)
    part.w_tenant, part.w_tag = res.w_tenant, res.w_tag
    return part


def _gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The segments ``rows`` of ``values`` (cut by ``offsets``), back to back, and their
    offsets: three numpy calls, no loop over rows."""
    lengths = offsets[1:][rows] - offsets[:-1][rows]
    out = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    idx = np.arange(out[-1]) + np.repeat(offsets[:-1][rows] - out[:-1], lengths)
    return values[idx], out
