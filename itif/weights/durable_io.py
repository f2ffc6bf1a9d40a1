"""Durable file operations under the blob store (``itif.weights.blobstore``): fsyncs of files
and directories, a durable write, a quiet unlink, the shared threads that run commits' fsyncs,
and a full disk turned into the caller's error.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from itif.errors import Overloaded

__all__ = ["fsync_dir", "fsync_path", "no_space", "syncer", "unlink_quietly", "write_durably"]


_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def syncer() -> ThreadPoolExecutor:
    """The threads that run step 2 of commits (fsyncs release the GIL), shared by every store."""
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="itif-blob-sync")
        return _sync_pool


def fsync_path(path: Path) -> None:
    """fsync the file at ``path`` (its data, whichever descriptor wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Create or truncate ``path`` with ``data`` and fsync it (the caller fsyncs the directory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def no_space(e: BaseException) -> BaseException:
    """``e``, or for a full disk (or quota) the caller's error: RESOURCE_EXHAUSTED, not INTERNAL."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return Overloaded(f"no space left on the device for this upload ({e.strerror}); "
                          "nothing was stored")
    return e


def unlink_quietly(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
