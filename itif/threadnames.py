"""The OS name of itif's long-lived threads.

Python names its threads (``itif-scheduler``, ``itif-columns``...) but the OS sees every one as
``python``. Each long-lived thread calls :func:`adopt` first, so ``/proc/<pid>/task/*/comm``,
``top -H``, ``perf`` and ``bench/frontend_cost.py``'s CPU by thread show which thread spends
what. Linux only (``prctl(PR_SET_NAME)``, 15 bytes); a no-op elsewhere.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from itif.clib import libc

__all__ = ["adopt"]

_PR_SET_NAME = 15


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    return getattr(libc(), "prctl", None)


def adopt() -> bool:
    """Give the calling OS thread its Python name (cut to 15 bytes); True when it took."""
    prctl = _prctl()
    if prctl is None:
        return False
    name = threading.current_thread().name.encode("ascii", "replace")[:15]
    return prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) == 0
