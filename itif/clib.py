"""The C library through ctypes: ``prctl`` (thread names), ``malloc_trim`` and ``mallopt`` (the
host allocator), ``memcmp``. No torch and no itif import, so the lightest process (an ingress
process) loads it as cheaply as the engine does."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__ = ["libc"]


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL | None:
    """The loaded C library, or None where there is none to load (loaded once a process)."""
    # find_library needs ldconfig, a compiler or ld, which a slim container may lack: glibc's
    # own name then
    name = ctypes.util.find_library("c") or ("libc.so.6" if sys.platform.startswith("linux")
                                             else None)
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
