"""A single-producer single-consumer ring of buffers in shared memory, one wake-up byte a batch.

One front-end process (the producer) writes batches (``itif.hostpath.columns``) into slots of a
``multiprocessing.shared_memory`` segment; the engine process (the consumer) reads them where
they lie and releases each slot when done. Results go back through a second ring the other way.

    segment:  control (64-byte lines: geometry | head | tail | producer waits for space)
              | length of each slot (uint64) | slot 0 | slot 1 | ... | slot N-1

``head`` counts batches published (the producer's only), ``tail`` batches released (the
consumer's only); slot ``i % N`` holds batch ``i``. Each is one aligned 8-byte store, which is
atomic on the machines torch serves on; the producer writes a slot's bytes and length before it
moves ``head``, the consumer reads them after it sees ``head`` move, and x86-64's stores are
seen in program order (on weaker orders the syscall of the wake-up byte is the fence).

Wake-ups: after publishing a batch the producer writes one byte to a pipe (non-blocking; a full
pipe already holds bytes the consumer will read, so dropping one loses nothing). A consumer
with nothing to read polls the pipe, then drains every byte and reads every published slot: one
wake-up a burst, at most one syscall a batch. No message carries a request, and no wake-up is
lost: the byte is written after ``head`` moved, so a consumer that read the old ``head`` finds
the byte. (bench/hostpath_cost.py measures what a wake-up costs.)

Back pressure: a full ring (``head - tail == N``) refuses the batch (``try_put`` returns False)
and the producer decides: wait for space (``put``: it raises the "waiting" flag and polls a
second pipe, which the consumer writes a byte to when it frees a slot and sees the flag), or
answer its calls RESOURCE_EXHAUSTED. Nothing is dropped. The flag and ``tail`` are a
store-then-load on each side, which x86 may reorder, so the producer's wait is bounded (5 ms)
and re-checks: a missed wake-up costs at most that, never a batch.

Across processes: ``Ring.handle(role)`` names the segment, the geometry and the two pipe ends
that role needs; pass the ends to the child (``subprocess.Popen(pass_fds=...)``, fork) and
``Producer.attach`` / ``Consumer.attach`` it there. The creator owns (and unlinks) the segment.
"""

from __future__ import annotations

import os
import select
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Protocol, Self

import numpy as np

__all__ = ["Consumer", "Producer", "Ring", "RingFull"]

_LINE = 64
_MAGIC = 0x49544946_52494E47  # "ITIFRING"
_HEAD, _TAIL, _WAIT = 8, 16, 24  # indices in the control array (uint64 words), a line apart
_SPACE_POLL_S = 0.005


class RingFull(Exception):
    """``put`` waited its whole timeout for a free slot."""


class Packable(Protocol):
    def nbytes(self) -> int: ...

    def pack_into(self, buf: Any, offset: int = 0) -> int: ...


def _geometry(slots: int, slot_bytes: int) -> tuple[int, int, int]:
    """(offset of slot 0, stride of a slot, total segment size)."""
    lengths = 4 * _LINE
    first = lengths + ((8 * slots + _LINE - 1) // _LINE) * _LINE
    stride = ((slot_bytes + _LINE - 1) // _LINE) * _LINE
    return first, stride, first + stride * slots


def _nonblocking_byte(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # the pipe is full of unread wake-ups: the reader will wake
        pass


def _drain(fd: int) -> bool:
    """Read every pending wake-up byte; False when the other end is closed."""
    while True:
        try:
            got = os.read(fd, 4096)
        except BlockingIOError:
            return True
        if not got:
            return False
        if len(got) < 4096:
            return True


def _wait_readable(fd: int, timeout: float | None) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


class _End:
    """What both ends share: the mapped segment and its views."""

    def __init__(self, shm: shared_memory.SharedMemory, slots: int, slot_bytes: int) -> None:
        self._shm = shm
        self.slots, self.slot_bytes = slots, slot_bytes
        first, stride, size = _geometry(slots, slot_bytes)
        if shm.size < size:
            raise ValueError(f"segment {shm.name} has {shm.size} bytes, the ring needs {size}")
        self._buf = shm.buf
        # the control words and slot lengths as ``memoryview``s of uint64: an item is a Python
        # int, read or written in a tenth of what a numpy scalar costs, and each access is one
        # aligned 8-byte load or store (``struct``'s native "Q")
        self._ctl = shm.buf[: 4 * _LINE].cast("Q")
        self._len = shm.buf[4 * _LINE : 4 * _LINE + 8 * slots].cast("Q")
        self._first, self._stride = first, stride

    def _slot(self, i: int, nbytes: int | None = None) -> memoryview:
        start = self._first + (i % self.slots) * self._stride
        return self._buf[start : start + (self.slot_bytes if nbytes is None else nbytes)]

    @property
    def pending(self) -> int:
        """Batches published and not yet released."""
        return self._ctl[_HEAD] - self._ctl[_TAIL]

    def release_views(self) -> None:
        """Drop this end's views of the segment (before the segment is closed)."""
        for view in (self._ctl, self._len):
            if view is not None:
                view.release()
        self._ctl = self._len = None  # type: ignore[assignment]
        self._buf = None  # type: ignore[assignment]


def _attach(handle: dict) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=handle["name"])
    # Python 3.11 registers an attached segment with this process's resource tracker, which
    # would unlink it when this process exits; only the creator owns it.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class Producer(_End):
    """The writing end: ``try_put`` / ``put`` a batch, or ``reserve`` a slot and ``commit``."""

    def __init__(self, shm, slots: int, slot_bytes: int, notify_w: int, space_r: int) -> None:
        super().__init__(shm, slots, slot_bytes)
        self._notify_w, self._space_r = notify_w, space_r
        self.refused = 0  # batches try_put refused because the ring was full (back pressure)

    @classmethod
    def attach(cls, handle: dict) -> Producer:
        return cls(_attach(handle), handle["slots"], handle["slot_bytes"], *handle["fds"])

    def reserve(self, nbytes: int) -> memoryview | None:
        """The next free slot's first ``nbytes`` to write a batch into; None when the ring is
        full. ValueError for a batch larger than a slot (split it: nothing waits forever)."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"a batch of {nbytes} bytes does not fit a slot of "
                             f"{self.slot_bytes}: send it in parts")
        ctl = self._ctl
        head = ctl[_HEAD]
        if head - ctl[_TAIL] >= self.slots:
            return None
        return self._slot(head, nbytes)

    def commit(self, nbytes: int) -> None:
        """Publish the reserved slot (``nbytes`` written) and wake the consumer."""
        ctl = self._ctl
        head = ctl[_HEAD]
        self._len[head % self.slots] = nbytes
        ctl[_HEAD] = head + 1
        _nonblocking_byte(self._notify_w)

    def try_put(self, item: Packable | bytes) -> bool:
        """Publish one batch; False (nothing written) when the ring is full."""
        raw = isinstance(item, (bytes, bytearray, memoryview))
        n = len(item) if raw else item.nbytes()
        slot = self.reserve(n)
        if slot is None:
            self.refused += 1
            return False
        if raw:
            slot[:] = item
        else:
            item.pack_into(slot)
        self.commit(n)
        return True

    def put(self, item: Packable | bytes, timeout: float | None = None) -> None:
        """Publish one batch, waiting for a free slot up to ``timeout`` s (RingFull after)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.try_put(item):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise RingFull(f"no free slot in {timeout} s: the consumer is behind")
            self._ctl[_WAIT] = 1
            if self.pending >= self.slots:  # still full after raising the flag: sleep on it
                _wait_readable(self._space_r, _SPACE_POLL_S if left is None
                               else min(left, _SPACE_POLL_S))
                _drain(self._space_r)

    def close(self) -> None:
        self.release_views()
        self._shm.close()


class Consumer(_End):
    """The reading end: ``wait`` for batches, ``peek`` the oldest, ``release`` it."""

    def __init__(self, shm, slots: int, slot_bytes: int, notify_r: int, space_w: int) -> None:
        super().__init__(shm, slots, slot_bytes)
        self._notify_r, self._space_w = notify_r, space_w
        self.peer_closed = False  # the producer's pipe end is closed (it exited)
        self.wakeups = 0

    @classmethod
    def attach(cls, handle: dict) -> Consumer:
        return cls(_attach(handle), handle["slots"], handle["slot_bytes"], *handle["fds"])

    def wait(self, timeout: float | None = None) -> bool:
        """Until a batch is published (True) or ``timeout`` s pass / the producer is gone."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.pending == 0:
            if self.peer_closed:
                return False
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            if _wait_readable(self._notify_r, left):
                self.wakeups += 1
                self.peer_closed = not _drain(self._notify_r)
        return True

    def peek(self) -> memoryview | None:
        """The oldest unreleased batch's bytes, where they lie (valid until ``release``)."""
        tail = self._ctl[_TAIL]
        if self._ctl[_HEAD] == tail:
            return None
        return self._slot(tail, self._len[tail % self.slots])

    def ready(self) -> list[memoryview]:
        """Every published, unreleased batch, oldest first, where they lie: what one wake-up
        finds (``release(len(...))`` them once read)."""
        ctl = self._ctl
        tail, head = ctl[_TAIL], ctl[_HEAD]
        if head == tail:
            return []
        lens, slots, buf = self._len, self.slots, self._buf
        first, stride = self._first, self._stride
        out = []
        for i in range(tail, head):
            start = first + (i % slots) * stride
            out.append(buf[start : start + lens[i % slots]])
        return out

    def release(self, n: int = 1) -> None:
        """Free the oldest ``n`` batches' slots (their views must not be read after this)."""
        if not n:
            return
        ctl = self._ctl
        ctl[_TAIL] = ctl[_TAIL] + n
        if ctl[_WAIT]:
            ctl[_WAIT] = 0
            _nonblocking_byte(self._space_w)

    def get(self, timeout: float | None = None) -> bytes | None:
        """The oldest batch as a copy, released; None when none came within ``timeout``."""
        if not self.wait(timeout):
            return None
        out = bytes(self.peek())  # type: ignore[arg-type]
        self.release()
        return out

    def close(self) -> None:
        self.release_views()
        self._shm.close()


class Ring:
    """Creates (and owns) the segment and the two pipes of one ring; hands out its ends."""

    def __init__(self, slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        if slots < 1 or slot_bytes < 64:
            raise ValueError("a ring needs at least 1 slot of at least 64 bytes")
        self.slots, self.slot_bytes = int(slots), int(slot_bytes)
        self._shm = shared_memory.SharedMemory(create=True, size=_geometry(slots, slot_bytes)[2])
        ctl = np.frombuffer(self._shm.buf, np.uint64, 4 * _LINE // 8, 0)
        ctl[:] = 0
        ctl[0], ctl[1], ctl[2] = _MAGIC, slots, slot_bytes
        del ctl
        self._notify = os.pipe()  # producer -> consumer: a batch is there
        self._space = os.pipe()  # consumer -> producer: a slot is free
        for fd in (*self._notify, *self._space):
            os.set_blocking(fd, False)
        self._ends: list[_End] = []

    @property
    def name(self) -> str:
        return self._shm.name

    def handle(self, role: str) -> dict:
        """What a process needs to attach as ``role`` ("producer" or "consumer"); its ``fds``
        must be inherited by that process (``pass_fds``)."""
        if role == "producer":
            fds = (self._notify[1], self._space[0])
        elif role == "consumer":
            fds = (self._notify[0], self._space[1])
        else:
            raise ValueError(f"role {role!r} is not 'producer' or 'consumer'")
        return {"name": self.name, "slots": self.slots, "slot_bytes": self.slot_bytes,
                "fds": fds}

    def producer(self) -> Producer:
        end = Producer(self._shm, self.slots, self.slot_bytes, *self.handle("producer")["fds"])
        self._ends.append(end)
        return end

    def consumer(self) -> Consumer:
        end = Consumer(self._shm, self.slots, self.slot_bytes, *self.handle("consumer")["fds"])
        self._ends.append(end)
        return end

    def close_end(self, role: str) -> None:
        """Close this process's copy of ``role``'s pipe ends (after handing them to a child:
        then the other side sees the child's exit as end of file)."""
        for fd in self.handle(role)["fds"]:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Unmap and unlink the segment, close the pipes."""
        for end in self._ends:
            end.release_views()
        self._ends.clear()
        for fd in (*self._notify, *self._space):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self._shm.close()
        except BufferError:  # a view a caller kept: the mapping goes with the process
            pass
        self._shm.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
