"""Requests and results as columns: one bytes buffer a batch, no Python object a request.

A front-end process turns each call into rows; what crosses into the engine process is a batch
of rows laid out as numpy columns in one contiguous buffer (a slot of ``itif.hostpath.ring``):

    Arrivals   header | call_id i8[n] | offsets i8[n+1] | deadline f8[n] | tenant i4[n]
                      | ids i4[offsets[n]] | priority i1[n]
    Results    header | call_id i8[n] | offsets i8[n+1] | values f4[offsets[n]] | status i1[n]
                      | err_row i4[k] | err_offsets i8[k+1] | err_text u1[...]
                      | w_tenant i4[m] | w_tag u1[64 m]   (the weights each tenant's rows used)

Row ``i``'s token ids are ``ids[offsets[i]:offsets[i+1]]``, its outputs
``values[offsets[i]:offsets[i+1]]``. ``deadline`` is a ``time.monotonic()`` time (``inf``: none;
every process of one host shares that clock), ``priority`` orders rows within a tenant (higher
first), ``tenant`` indexes the engine's tenant table of version ``table_version`` (indices are
never reused, see ``itif.hostpath.colqueue``). ``status`` is an index into :data:`STATUS`, the
gRPC code names itif's errors carry (``ItifError.code``); the few failed rows have a message in
the error table (``err_row`` names the row), so a success costs no text at all.

Every column starts on an 8-byte boundary; the header is 32 bytes (magic, row count, element
count, table version (for Results: the weights table's entries), error count and text bytes).
``unpack`` returns numpy views of the buffer
(no copy: read them before the ring slot is released, or copy), ``unpack_many`` copies the
slots of one wake-up into one batch, ``pack_into`` writes straight into a ring slot. Each costs
a fixed number of calls a column, whatever the number of rows, and the engine makes them for
every batch, so they are counted in microseconds (bench/hostpath_cost.py): small columns move
as bytes (a ``memoryview`` slice assignment, a ``bytes.join``), which costs a tenth of a numpy
call on a four-row batch.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from itif.errors import InvalidRequest

__all__ = ["STATUS", "Arrivals", "Results", "status_code"]

#: Row status codes: the index of the gRPC code name (``ItifError.code``). 0 is success.
STATUS = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
          "UNAVAILABLE", "INTERNAL", "FAILED_PRECONDITION", "CANCELLED")
_CODE = {name: i for i, name in enumerate(STATUS)}

_NO_ROWS, _NO_OFFSETS = np.zeros(0, np.int32), np.zeros(1, np.int64)
_NO_TEXT = np.zeros(0, np.uint8)
_HEAD = struct.Struct("<4sIqqiI")  # magic, n rows, elements, table version, k errors, text bytes
_ARRIVALS, _RESULTS = b"ITA1", b"ITR2"  # ITR2: with the weights table
#: Bytes a weights tag takes in :class:`Results` (a sha256 in hex).
TAG_BYTES = 64


def status_code(name: str) -> int:
    """The :data:`STATUS` index of a gRPC code name; unknown names are INTERNAL."""
    return _CODE.get(name, _CODE["INTERNAL"])


def _up8(n: int) -> int:
    return (n + 7) & ~7


_SIZE = {np.int64: 8, np.float64: 8, np.int32: 4, np.float32: 4, np.int8: 1, np.uint8: 1}
_BYTES_MAX = 1 << 16  # columns up to this size are packed as bytes (one extra copy is cheap)


def _layout(counts: Sequence[tuple[type, int]]) -> tuple[list[int], int]:
    """Start of each column after the header, and the total size (8-byte aligned)."""
    pos, starts = _HEAD.size, []
    for dtype, n in counts:
        starts.append(pos)
        pos = (pos + _SIZE[dtype] * n + 7) & ~7
    return starts, pos


def _views(buf, starts: list[int], counts) -> list[np.ndarray]:
    fb = np.frombuffer
    return [fb(buf, dtype, n, s) for s, (dtype, n) in zip(starts, counts)]


def _header(buf, magic: bytes) -> tuple[int, int, int, int, int]:
    got, n, total, version, k, text = _HEAD.unpack_from(buf, 0)
    if got != magic:
        raise InvalidRequest(f"not a {magic.decode()} buffer (magic {got!r})")
    return n, total, version, k, text


def _offsets(offsets, n_rows: int | None, what: str) -> np.ndarray:
    """``offsets`` as int64, checked: 1-D, starts at 0, never decreases."""
    off = np.asarray(offsets)
    if off.ndim != 1 or off.size < 1 or (off.dtype.kind not in "iu"):
        raise InvalidRequest(f"{what}: offsets must be a 1-D integer array of n+1 entries")
    off = off.astype(np.int64, copy=False)
    if n_rows is not None and off.size != n_rows + 1:
        raise InvalidRequest(f"{what}: offsets has {off.size} entries for {n_rows} rows")
    if off[0] != 0 or (off.size > 1 and (np.diff(off) < 0).any()):
        raise InvalidRequest(f"{what}: offsets must start at 0 and never decrease")
    return off


class _Packed:
    """What Arrivals and Results share: a header and their columns (``_counts`` says each one's
    dtype and length, ``_columns`` gives them in that order) packed into one buffer."""

    def nbytes(self) -> int:
        return _layout(self._counts())[1]

    def pack_into(self, buf, offset: int = 0) -> int:
        """Write into ``buf`` (a writable buffer) at ``offset``; returns the bytes written.

        A column of the right dtype, contiguous and up to ``_BYTES_MAX`` bytes, is copied as
        bytes (its ``tobytes`` into a ``memoryview`` slice: a fraction of a microsecond); any
        other goes through numpy (cast, broadcast, or a large one copied once)."""
        counts = self._counts()
        starts, size = _layout(counts)
        view = memoryview(buf)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        view = view[offset : offset + size]
        if view.nbytes < size:
            raise ValueError(f"{type(self).__name__.lower()} need {size} bytes, the buffer "
                             f"has {view.nbytes}")
        _HEAD.pack_into(view, 0, *self._head())
        for (dtype, n), start, src in zip(counts, starts, self._columns()):
            if not n:
                continue
            nb = _SIZE[dtype] * n
            if (nb <= _BYTES_MAX and isinstance(src, np.ndarray) and src.dtype == dtype
                    and src.size == n and src.flags.c_contiguous):
                view[start : start + nb] = src.tobytes()
            else:
                np.frombuffer(view, dtype, n, start)[...] = src
        return size

    def to_bytes(self) -> bytes:
        buf = bytearray(self.nbytes())
        self.pack_into(buf)
        return bytes(buf)


@dataclass
class Arrivals(_Packed):
    """A batch of requests as columns (see the module docstring)."""

    call_id: np.ndarray  # int64 [n]
    tenant: np.ndarray  # int32 [n]: index into the tenant table
    offsets: np.ndarray  # int64 [n+1] into ids
    ids: np.ndarray  # int32 [offsets[n]]
    deadline: np.ndarray  # float64 [n], monotonic seconds (inf: none)
    priority: np.ndarray  # int8 [n]
    table_version: int = 0

    @classmethod
    def build(cls, call_id, tenant, offsets, ids, deadline=None, priority=None,
              table_version: int = 0) -> Arrivals:
        """Columns from array-likes, checked and cast (the producer's side; ``unpack`` trusts
        the buffer's own layout)."""
        tenant = np.asarray(tenant, np.int32)
        n = tenant.size
        off = _offsets(offsets, n, "arrivals")
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu") or ids.size != off[-1]:
            raise InvalidRequest(f"arrivals: ids must be 1-D integers, {int(off[-1])} of them")
        return cls(np.asarray(call_id, np.int64).reshape(n), tenant, off,
                   ids.astype(np.int32, copy=False),
                   np.full(n, np.inf) if deadline is None else np.asarray(deadline, np.float64),
                   np.zeros(n, np.int8) if priority is None else np.asarray(priority, np.int8),
                   int(table_version))

    def __len__(self) -> int:
        return self.tenant.size

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def _counts(self) -> list[tuple[np.dtype, int]]:
        n = len(self)
        return [(np.int64, n), (np.int64, n + 1), (np.float64, n), (np.int32, n),
                (np.int32, int(self.offsets[-1])), (np.int8, n)]

    def _head(self) -> tuple:
        return (_ARRIVALS, len(self), int(self.offsets[-1]), self.table_version, 0, 0)

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.call_id, self.offsets, self.deadline, self.tenant, self.ids, self.priority)

    @classmethod
    def unpack(cls, buf) -> Arrivals:
        """Views of ``buf``'s columns (no copy). The engine reads one a ring slot, so this is
        the layout of ``_counts`` written out: six ``frombuffer`` calls and a header."""
        got, n, total, version, _, _ = _HEAD.unpack_from(buf, 0)
        if got != _ARRIVALS:
            _header(buf, _ARRIVALS)  # raises
        frombuffer, i8 = np.frombuffer, np.int64
        p = _HEAD.size  # call_id, offsets, deadline (8-byte) ... tenant, ids (4), priority (1)
        ids_at = _up8(p + 28 * n + 8)
        return cls(frombuffer(buf, i8, n, p), frombuffer(buf, np.int32, n, p + 24 * n + 8),
                   frombuffer(buf, i8, n + 1, p + 8 * n),
                   frombuffer(buf, np.int32, total, ids_at),
                   frombuffer(buf, np.float64, n, p + 16 * n + 8),
                   frombuffer(buf, np.int8, n, _up8(ids_at + 4 * total)), version)

    @classmethod
    def unpack_many(cls, bufs: Sequence) -> Arrivals:
        """One batch of the rows of every buffer in ``bufs`` (the ring slots one wake-up
        finds), in order, copied: the slots may be released as soon as this returns. Equal
        to ``concat([unpack(b) for b in bufs])`` (copied), at a fraction of its cost: each
        column is one ``bytes.join`` of the slots' byte ranges and one ``frombuffer``, and
        the offsets take one in-place add a buffer after the first."""
        if len(bufs) == 1:
            return cls.unpack(bytearray(bufs[0]))
        if not bufs:
            return cls.build(_NO_ROWS.astype(np.int64), _NO_ROWS, _NO_OFFSETS, _NO_ROWS)
        cols: list[list] = [[], [b"\0" * 8], [], [], [], []]
        call_id, offsets, deadline, tenant, ids, prio = cols
        rows, shifts, version, shift = [], [], 0, 0
        for buf in bufs:
            got, n, total, v, _, _ = _HEAD.unpack_from(buf, 0)
            if got != _ARRIVALS:
                _header(buf, _ARRIVALS)  # raises
            mv = memoryview(buf)
            p = _HEAD.size + 8 * n
            call_id.append(mv[_HEAD.size : p])
            offsets.append(mv[p + 8 : p + 8 * n + 8])
            p += 8 * n + 8
            deadline.append(mv[p : p + 8 * n])
            p += 8 * n
            tenant.append(mv[p : p + 4 * n])
            p = _up8(p + 4 * n)
            ids.append(mv[p : p + 4 * total])
            p = _up8(p + 4 * total)
            prio.append(mv[p : p + n])
            rows.append(n)
            shifts.append(shift)
            shift += total
            version = max(version, v)
        join, frombuffer = bytearray().join, np.frombuffer
        off = frombuffer(join(offsets), np.int64)
        at = 1 + rows[0]
        for n, k in zip(rows[1:], shifts[1:]):
            if n:
                off[at : at + n] += k
                at += n
        return cls(frombuffer(join(call_id), np.int64), frombuffer(join(tenant), np.int32),
                   off, frombuffer(join(ids), np.int32), frombuffer(join(deadline), np.float64),
                   frombuffer(join(prio), np.int8), version)

    @classmethod
    def concat(cls, parts: Sequence[Arrivals]) -> Arrivals:
        """One batch of several (the ring slots found at one wake-up): a fixed number of numpy
        calls a column, whatever the number of parts. The newest table version wins."""
        if len(parts) == 1:
            return parts[0]
        rows = [p.tenant.size for p in parts]
        cat = np.concatenate
        off = cat([_NO_OFFSETS, *(p.offsets[1:] for p in parts)])
        at, shift = 1 + rows[0], int(parts[0].offsets[-1])
        for n, p in zip(rows[1:], parts[1:]):
            if n:
                off[at : at + n] += shift
                at += n
                shift += int(p.offsets[-1])
        return cls(cat([p.call_id for p in parts]), cat([p.tenant for p in parts]), off,
                   cat([p.ids for p in parts]), cat([p.deadline for p in parts]),
                   cat([p.priority for p in parts]), max(p.table_version for p in parts))


@dataclass
class Results(_Packed):
    """A batch of answers as columns: outputs of the rows that ran, a status for every row,
    a message for each failed one (see the module docstring)."""

    call_id: np.ndarray  # int64 [n]
    status: np.ndarray  # int8 [n]: index into STATUS
    offsets: np.ndarray  # int64 [n+1] into values (a failed row's range is empty)
    values: np.ndarray  # float32 [offsets[n]]
    err_row: np.ndarray  # int32 [k]: the rows with a message
    err_offsets: np.ndarray  # int64 [k+1] into err_text
    err_text: np.ndarray  # uint8: the messages, UTF-8, back to back
    #: The weights the rows were computed with: tenant table index -> the store's tag of its
    #: weights (the daemon's: their sha256), read in the forward's own view of the store, so a
    #: reply names exactly the weights behind it even while an upload replaces them.
    w_tenant: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # int32 [m]
    w_tag: np.ndarray = field(default_factory=lambda: _NO_TEXT)  # uint8 [TAG_BYTES * m]

    @classmethod
    def build(cls, call_id, status, offsets, values,
              errors: dict[int, str] | None = None) -> Results:
        """From columns and ``{row: message}`` for the failed rows (the only per-row Python,
        and only for failures)."""
        call_id = np.asarray(call_id, np.int64)
        off = _offsets(offsets, call_id.size, "results")
        values = np.asarray(values, np.float32).reshape(-1)
        if values.size != off[-1]:
            raise InvalidRequest(f"results: {values.size} values for offsets ending at {off[-1]}")
        rows = sorted(errors or ())
        texts = [errors[r].encode("utf-8", "replace") for r in rows]
        lens = np.fromiter((len(t) for t in texts), np.int64, count=len(texts))
        return cls(call_id, np.asarray(status, np.int8).reshape(call_id.size), off, values,
                   np.asarray(rows, np.int32), np.concatenate(([0], np.cumsum(lens))),
                   np.frombuffer(b"".join(texts), np.uint8))

    @classmethod
    def ok(cls, call_id: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> Results:
        """Every row succeeded (the common batch): the columns as they are, no message."""
        return cls(call_id, np.zeros(call_id.size, np.int8), offsets, values, _NO_ROWS,
                   _NO_OFFSETS, _NO_TEXT)

    def with_weights(self, index: dict[str, int], tags: dict[str, str]) -> Results:
        """These results with the weights table of ``tags`` (tenant name -> its weights'
        tag; ``index``: name -> table index). A tag is at most :data:`TAG_BYTES` ASCII."""
        self.w_tenant = np.fromiter((index[t] for t in tags), np.int32, count=len(tags))
        self.w_tag = np.frombuffer(b"".join(t.encode("ascii").ljust(TAG_BYTES)[:TAG_BYTES]
                                            for t in tags.values()), np.uint8)
        return self

    def weights(self) -> dict[int, str]:
        """The weights table: tenant table index -> tag."""
        raw = self.w_tag.tobytes()
        return {int(t): raw[j * TAG_BYTES:(j + 1) * TAG_BYTES].decode("ascii").rstrip()
                for j, t in enumerate(self.w_tenant.tolist())}

    def __len__(self) -> int:
        return self.call_id.size

    def _counts(self) -> list[tuple[np.dtype, int]]:
        n, k, m = len(self), self.err_row.size, self.w_tenant.size
        return [(np.int64, n), (np.int64, n + 1), (np.float32, int(self.offsets[-1])),
                (np.int8, n), (np.int32, k), (np.int64, k + 1), (np.uint8, self.err_text.size),
                (np.int32, m), (np.uint8, TAG_BYTES * m)]

    def _head(self) -> tuple:  # the header's third field: the weights table's entries
        return (_RESULTS, len(self), int(self.offsets[-1]), self.w_tenant.size,
                self.err_row.size, self.err_text.size)

    def _columns(self) -> tuple[np.ndarray, ...]:
        return (self.call_id, self.offsets, self.values, self.status, self.err_row,
                self.err_offsets, self.err_text, self.w_tenant, self.w_tag)

    @classmethod
    def unpack(cls, buf) -> Results:
        n, total, m, k, text = _header(buf, _RESULTS)
        counts = [(np.int64, n), (np.int64, n + 1), (np.float32, total), (np.int8, n),
                  (np.int32, k), (np.int64, k + 1), (np.uint8, text), (np.int32, m),
                  (np.uint8, TAG_BYTES * m)]
        cols = _views(buf, _layout(counts)[0], counts)
        return cls(*(cols[i] for i in (0, 3, 1, 2, 4, 5, 6, 7, 8)))

    def errors(self) -> dict[int, str]:
        """``{row: message}`` of the failed rows."""
        o = self.err_offsets
        raw = self.err_text.tobytes()
        return {int(r): raw[o[j]:o[j + 1]].decode("utf-8", "replace")
                for j, r in enumerate(self.err_row)}

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]
