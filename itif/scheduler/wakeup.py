"""How the scheduler's loop sleeps and is woken: :class:`Wakeup`.

The loop sleeps in ``poll`` on a pipe of its own and on its column source's wake-up fds (the
arrival rings' pipes, ``itif.server.column_door``). A batch of arrivals from an ingress process
therefore wakes it straight from the kernel, with no thread in between, and while the loop runs
a forward the rings' wake-ups only pile up in their pipes, to be read at its next sleep. Work
that comes another way (a ticket, a config change, stop) calls :meth:`Wakeup.notify` under the
loop's lock, which writes to the pipe only while the loop sleeps: the loop sets ``sleeping``
under the same lock before it lets it go, so a notify can never fall between its last look at
the queues and its sleep.
"""

from __future__ import annotations

import math
import os
import select
import threading

__all__ = ["Wakeup"]


class Wakeup:
    """The loop's sleep, guarded by ``lock`` (the scheduler's)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._pipe: tuple[int, int] | None = None
        self._sleeping = False
        self._poll: tuple[object, select.poll] | None = None  # (the fds' source, its poll)

    def open(self) -> None:
        """The pipe, for a loop about to start (lock held)."""
        self._pipe = os.pipe()
        for fd in self._pipe:
            os.set_blocking(fd, False)

    def close(self) -> None:
        """The loop has left: nothing is written to the pipe any more (lock held)."""
        self._sleeping, self._poll = False, None
        fds, self._pipe = self._pipe, None
        for fd in fds or ():
            os.close(fd)

    def notify(self) -> None:
        """Wake the loop if it sleeps (lock held)."""
        if self._sleeping:
            self._sleeping = False
            try:
                os.write(self._pipe[1], b"\0")
            except BlockingIOError:  # full of unread wake-ups: it wakes anyway
                pass

    def sleep(self, timeout: float | None, source=None) -> None:
        """Let the lock go until :meth:`notify`, a byte on one of the column ``source``'s
        ``wake_fds()``, or ``timeout`` s; then take it again (lock held on entry)."""
        if self._poll is None or self._poll[0] is not source:
            poller = select.poll()
            for fd in (self._pipe[0], *(source.wake_fds() if source is not None else ())):
                poller.register(fd, select.POLLIN)
            self._poll = (source, poller)
        poller = self._poll[1]
        self._sleeping = True
        self._lock.release()
        try:
            for fd, _ in poller.poll(None if timeout is None
                                     else math.ceil(max(0.0, timeout) * 1000.0)):
                drain(fd)
        finally:
            self._lock.acquire()
            self._sleeping = False


def drain(fd: int) -> None:
    """Read every pending wake-up byte of a non-blocking pipe."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass
