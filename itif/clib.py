"""The C library through ctypes: ``prctl`` (thread names), ``malloc_trim`` and ``mallopt`` (the
host allocator), ``memcmp``. No torch and no itif import, so the lightest process (an ingress
process) loads it as cheaply as the engine does."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["libc"]


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL | None:
    """The loaded C library, or None where there is none to load (loaded once a process)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
