"""An ingress process's end of the column path (``itif.server.column_door`` draws it).

Everything a call costs before and after the model runs happens here, in the ingress process:
parsing the request, the caller's token against the tenant table's digests, the tenant's
limits, the lengths and token ids, the calls in flight, and the reply's encoding. What reaches
the daemon is one :class:`~itif.hostpath.Arrivals` for all the calls of one turn of this
process's event loop, and what comes back is one :class:`~itif.hostpath.Results` a batch.

:meth:`ColumnClient.prepare` says whether a call can go this way: Infer and InferBatch of token
ids only (no text, token types or explicit outputs), a tenant the last snapshot lists as ready,
a token that may see it. A call whose rows break the tenant's or the backbone's limits (a
length, a token id) is refused here, INVALID_ARGUMENT with the daemon's own message
(``itif.requests.check_token_rows``), so an invalid flood never reaches the daemon. Any other
call (and any call that would fail another check: the daemon's servicer gives the exact error)
goes by frame, as before. A call over this process's share of its tenant's ``max_inflight``
(or of the server's ``max_inflight_calls``) is refused here, RESOURCE_EXHAUSTED with the retry
hint, before it costs the daemon anything.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from itif import threadnames
from itif.errors import Busy, InvalidRequest, clip
from itif.hostpath.columns import STATUS, Arrivals, Results
from itif.hostpath.ring import Consumer, Producer
from itif.requests import check_tenant_lengths, check_token_rows
from itif.server._proto.itif.v1 import itif_pb2
from itif.server.errors import retry_hint

log = logging.getLogger("itif.server.ingress")

__all__ = ["ColumnClient", "Prepared"]

#: A call id is ``(ingress process << FRONTEND_SHIFT) | its own counter``: the daemon sends
#: each row's result back to the ring of the process that sent it.
FRONTEND_SHIFT = 48
INFER, INFER_BATCH = "/itif.v1.Itif/Infer", "/itif.v1.Itif/InferBatch"
_CODES = {name: getattr(grpc.StatusCode, name) for name in STATUS}
#: seconds an ingress process gathers calls into one batch of arrivals: one ring slot and one
#: wake-up of the daemon for all of them (the daemon's work per batch is mostly fixed)
FLUSH_S = 0.001
#: seconds between an ingress process's reports of its column calls to the daemon's metrics
REPORT_S = 0.1


def _busy(ms: int) -> tuple[tuple[str, str], ...]:
    """The retry hint of a transient refusal, as the daemon's refusals trail it."""
    return retry_hint(Busy(""), ms)


class Refused(Exception):
    """A call answered here with ``code`` and ``details`` (and ``trailers``)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


@dataclass
class Prepared:
    """A call that goes by columns: its rows, checked."""

    method: str
    tenant: str
    index: int  # the tenant's index in the daemon's column queue
    ids: list[np.ndarray]
    sha: str
    output: str  # "logits" or "pooled": the tenant's default
    width: int  # values a row
    priority: int
    refused: Refused | None = None  # answered here, without the daemon (invalid rows)


@dataclass
class _Call:
    future: asyncio.Future
    rows: int
    tenant: int  # its tenant's table index
    got: list[np.ndarray] = field(default_factory=list)
    sha: str | None = None  # the weights its rows were computed with (the results say)


class ColumnClient:
    """This process's rings, the last tenant snapshot, and the calls waiting for results."""

    def __init__(self, spec: dict, max_message_bytes: int, report=None) -> None:
        self.index, self.frontends = spec["index"], spec["frontends"]
        self.arrivals = Producer.attach(spec["arrivals"])
        self.results = Consumer.attach(spec["results"])
        self.max_message_bytes = max_message_bytes
        self.snapshot: dict | None = None
        self._loop = asyncio.get_running_loop()
        # call ids unique across a restart of this process (the daemon may still answer the
        # old one's calls into the rings it takes over)
        self._next = (os.getpid() & 0xFFFFFF) << 24
        self._calls: dict[int, _Call] = {}
        self._pending: list[tuple[int, Prepared, float]] = []
        self._cancelled: list[int] = []  # calls cancelled since the last flush
        self._inflight: dict[str, int] = {}
        self._total = 0
        self._digests: dict[str, str] = {}  # token -> sha256 (the tokens seen; bounded)
        self.sent_calls = 0  # calls this process sent by columns (tests read it)
        self._report = report  # sends the counts below to the daemon's metrics
        self._counts: dict[tuple[str, str, str], list[float]] = {}
        self._closed = False
        threading.Thread(target=self._read, name="itif-ingress-results", daemon=True).start()

    def close(self) -> None:
        self._closed = True

    # ---- which calls go by columns -------------------------------------------------------
    def prepare(self, method: str, body: bytes, metadata) -> Prepared | None:
        """The call as checked rows (with ``refused`` set: answered here, invalid), or None:
        it goes by frame."""
        snap = self.snapshot
        if snap is None or method not in (INFER, INFER_BATCH):
            return None
        try:
            if method == INFER:
                req = itif_pb2.InferRequest.FromString(body)
                inputs = [req.input]
            else:
                req = itif_pb2.InferBatchRequest.FromString(body)
                inputs = req.inputs
        except Exception:  # noqa: BLE001 - the daemon's servicer says what is wrong with it
            return None
        entry = snap["tenants"].get(req.tenant)
        if entry is None or req.outputs or not inputs or req.priority > 127:
            return None
        index, token_sha, sha, labels, limit, _, max_queue = entry
        # more rows than the tenant may queue, or than a ring slot holds: the servicer's answer
        if len(inputs) > max_queue or 40 * len(inputs) > self.arrivals.slot_bytes // 2:
            return None
        if not self._may_see(metadata, snap["admin"], token_sha):
            return None
        ids = []
        tokens, vocab, bad = 0, snap["vocab"], False
        for inp in inputs:
            if inp.WhichOneof("input") != "input_ids" or inp.input_ids.token_type_ids:
                return None
            a = np.asarray(inp.input_ids.ids, np.int64)
            bad = bad or not 1 <= a.size <= limit or a.min() < 0 or a.max() >= vocab
            ids.append(a)
            tokens += a.size
        output, width = ("logits", labels) if labels else ("pooled", snap["hidden"])
        p = Prepared(method, req.tenant, index, ids, sha, output, width, req.priority)
        if bad:  # the servicer's answer, from here: an invalid call costs the daemon nothing
            p.refused = self._invalid(ids, req.tenant, limit, snap["max_len"], vocab)
            return p if p.refused is not None else None
        if 40 * len(inputs) + 4 * tokens > self.arrivals.slot_bytes // 2:
            return None
        return p

    @staticmethod
    def _invalid(ids: list[np.ndarray], tenant: str, limit: int, max_len: int, vocab: int
                 ) -> Refused | None:
        """The daemon's INVALID_ARGUMENT for these rows (its checks, in its order)."""
        lengths = np.fromiter((a.size for a in ids), np.int64, count=len(ids))
        try:
            check_token_rows(lengths, np.concatenate(ids), max_len, vocab)
            check_tenant_lengths(lengths.tolist(), tenant, limit if limit < max_len else None)
        except InvalidRequest as e:
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, clip(str(e)))
        return None

    def _may_see(self, metadata, admin_sha: str, token_sha: str) -> bool:
        auth = ""
        for k, v in metadata or ():
            if k == "authorization":
                auth = v.strip() if isinstance(v, str) else ""
        if not auth.startswith("Bearer "):
            return False
        token = auth[len("Bearer "):].strip()
        digest = self._digests.get(token)
        if digest is None:
            digest = hashlib.sha256(token.encode()).hexdigest()
            if len(self._digests) > 4096:
                self._digests.clear()
            self._digests[token] = digest
        return digest == admin_sha or (bool(token_sha) and digest == token_sha)

    # ---- a call ------------------------------------------------------------------------
    async def counted(self, p: Prepared, context) -> tuple[bytes | None, Refused | None]:
        """:meth:`call`, counted for the daemon's metrics as its interceptor counts a framed
        call: (the reply, None) or (None, why it was refused). The counts go to the daemon in
        one report every :data:`REPORT_S` (one a call would wake the daemon's event loop a
        call): a column call shows in /metrics up to that much after its answer."""
        start = time.perf_counter()
        code, reply, refused = "OK", None, None
        try:
            if p.refused is not None:
                raise p.refused
            reply = await self.call(p, context.time_remaining())
        except Refused as r:
            refused, code = r, r.code.name
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            left = context.time_remaining()
            if left is not None and left <= 0 and code != "OK":
                code = "DEADLINE_EXCEEDED"
            if not self._counts and self._report is not None:  # at most one report a period
                self._loop.call_later(REPORT_S, self._send_counts)
            key = (p.tenant, p.method.rpartition("/")[2], code)
            self._counts.setdefault(key, []).append(time.perf_counter() - start)
        return reply, refused

    def _send_counts(self) -> None:
        counts, self._counts = self._counts, {}
        if counts:
            self._report(counts)

    async def call(self, p: Prepared, remaining: float | None) -> bytes:
        """Send ``p`` with the other calls of the next :data:`FLUSH_S`; its reply's bytes, or
        :class:`Refused`."""
        self._admit(p)
        self._next += 1
        cid = (self.index << FRONTEND_SHIFT) | self._next
        fut = self._loop.create_future()
        self._calls[cid] = _Call(fut, len(p.ids), p.index)
        self._flush_soon()
        deadline = math.inf if remaining is None else time.monotonic() + remaining
        self._pending.append((cid, p, deadline))
        try:
            rows, sha = await fut
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed: its
            self._flush_soon()  # rows leave the engine's queue (a withdrawal, next flush)
            self._cancelled.append(cid)
            raise
        finally:
            self._calls.pop(cid, None)
            self._inflight[p.tenant] -= 1
            self._total -= 1
        return self._reply(p, rows, sha or p.sha)

    def _admit(self, p: Prepared) -> None:
        snap = self.snapshot
        share = math.ceil(snap["tenants"][p.tenant][5] / self.frontends)
        total_share = math.ceil(snap["max_inflight_calls"] / self.frontends)
        mine = self._inflight.get(p.tenant, 0)
        if mine >= share or self._total >= total_share:
            ms = snap["retry_after_ms"]
            what = (f"tenant {p.tenant!r} has {mine} calls in flight, its limit (tenants[]."
                    "max_inflight, default 2 x max_queue); retry after some are answered"
                    if mine >= share else f"the server has {self._total} calls in flight, its "
                    "limit (server.max_inflight_calls); retry after some are answered")
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, what,
                          _busy(ms))
        self._inflight[p.tenant] = mine + 1
        self._total += 1

    def _reply(self, p: Prepared, rows: list[np.ndarray], sha: str) -> bytes:
        """``sha``: the weights the rows were computed with (the snapshot's may be older)."""
        def one(v: np.ndarray) -> itif_pb2.InferResponse:
            return itif_pb2.InferResponse(
                outputs=[itif_pb2.Tensor(name=p.output, shape=[v.size],
                                         data=v.astype("<f4", copy=False).tobytes())],
                weights_sha256=sha)

        msg = (one(rows[0]) if p.method == INFER
               else itif_pb2.InferBatchResponse(results=[one(v) for v in rows]))
        raw = msg.SerializeToString()
        if len(raw) > self.max_message_bytes:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the reply is {len(raw)} bytes, over server.max_message_bytes "
                          f"({self.max_message_bytes})", (("grpc-retry-pushback-ms", "-1"),))
        return raw

    def _flush_soon(self) -> None:
        if not self._pending and not self._cancelled:  # the calls (and withdrawals) of the
            self._loop.call_later(FLUSH_S, self._flush)  # next FLUSH_S go in one batch

    def _flush(self) -> None:
        """The calls gathered since the first of them, as arrivals, in as few ring slots as
        they fit (less those cancelled meanwhile), and the withdrawals of calls cancelled
        after they were sent: rows of tenant -1 (``ColumnDoor``)."""
        if self._cancelled:
            gone = np.array(self._cancelled, np.int64)
            self._cancelled = []
            n = gone.size
            try:
                self.arrivals.try_put(Arrivals.build(gone, np.full(n, -1, np.int32),
                                                     np.zeros(n + 1, np.int64),
                                                     np.zeros(0, np.int32)))
            except ValueError:  # more than a slot holds: those rows run, their results
                pass  # are not read
        pending = [item for item in self._pending if item[0] in self._calls]
        self._pending = []
        chunk: list[tuple[int, Prepared, float]] = []
        size = 0
        for item in pending:
            n = sum(a.size for a in item[1].ids)
            if chunk and (size + 4 * n + 64 * len(item[1].ids)) * 1.1 > self.arrivals.slot_bytes:
                self._send(chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += 4 * n + 64 * len(item[1].ids)
        if chunk:
            self._send(chunk)

    def _send(self, chunk: list[tuple[int, Prepared, float]]) -> None:
        rows = [len(p.ids) for _, p, _ in chunk]
        ids = [a for _, p, _ in chunk for a in p.ids]
        lengths = np.fromiter((a.size for a in ids), np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        per_call = np.array([(c, p.index, d, p.priority) for c, p, d in chunk], np.float64)
        cid = np.repeat(np.array([c for c, _, _ in chunk], np.int64), rows)  # exact: int64
        arrivals = Arrivals.build(cid, np.repeat(per_call[:, 1], rows), offsets,
                                  np.concatenate(ids), np.repeat(per_call[:, 2], rows),
                                  np.repeat(per_call[:, 3], rows))
        try:
            sent = self.arrivals.try_put(arrivals)
        except ValueError:  # larger than a slot (one huge call): refuse it, retry smaller
            sent = False
        if sent:
            self.sent_calls += len(chunk)
            return
        ms = self.snapshot["retry_after_ms"] if self.snapshot else 200
        err = Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      "the engine is behind (its arrival ring is full); retry",
                      _busy(ms))
        for cid, _, _ in chunk:
            call = self._calls.get(cid)
            if call is not None and not call.future.done():
                call.future.set_exception(err)

    # ---- results -------------------------------------------------------------------------
    def _read(self) -> None:
        """The results ring, copied out and handed to the event loop: one hand-over a wake-up."""
        threadnames.adopt()
        while not self._closed:
            if not self.results.wait(0.5):
                continue
            views = self.results.ready()
            got = [Results.unpack(bytes(v)) for v in views]
            self.results.release(len(views))
            try:
                self._loop.call_soon_threadsafe(self._deliver, got)
            except RuntimeError:  # the loop is closed: this process is ending
                return

    def _deliver(self, batches: list[Results]) -> None:
        for res in batches:
            errors = res.errors() if res.err_row.size else {}
            weights = res.weights() if res.w_tenant.size else {}
            status = res.status.tolist()
            for i, cid in enumerate(res.call_id.tolist()):
                call = self._calls.get(cid)
                if call is None or call.future.done():
                    continue  # its caller went away, or an earlier row failed it
                if status[i]:
                    code = STATUS[status[i]]
                    trailers = ()
                    if code == "RESOURCE_EXHAUSTED":
                        ms = self.snapshot["retry_after_ms"] if self.snapshot else 200
                        trailers = _busy(ms)
                    call.future.set_exception(Refused(_CODES[code], errors.get(i, code),
                                                      trailers))
                    continue
                call.got.append(res.row(i).copy())
                call.sha = weights.get(call.tenant, call.sha)
                if len(call.got) == call.rows:
                    call.future.set_result((call.got, call.sha))
