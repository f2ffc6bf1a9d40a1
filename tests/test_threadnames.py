"""itif.threadnames: a thread's Python name becomes its OS name (what /proc, top -H and the
frontend-cost bench's CPU by thread read)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from itif import threadnames


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")
def test_a_thread_takes_its_python_name_cut_to_15_bytes():
    got = {}

    def body():
        tid = threading.get_native_id()
        comm = Path(f"/proc/self/task/{tid}/comm")
        got["before"] = comm.read_text().strip()
        got["ok"] = threadnames.adopt()
        got["after"] = comm.read_text().strip()

    t = threading.Thread(target=body, name="itif-a-long-thread-name")
    t.start()
    t.join()
    assert got["ok"] and got["after"] == "itif-a-long-thr" != got["before"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's name is Linux's")
def test_the_c_library_loads_where_find_library_finds_nothing(monkeypatch):
    """A slim container may have neither ldconfig nor a compiler, so ``find_library("c")`` is
    None there: ``itif.clib`` loads glibc by its own name, and thread names still take."""
    import ctypes.util

    from itif import clib

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    clib.libc.cache_clear()
    try:
        assert clib.libc() is not None and hasattr(clib.libc(), "prctl")
        got = {}
        t = threading.Thread(target=lambda: got.update(ok=threadnames.adopt()), name="itif-x")
        t.start()
        t.join()
        assert got["ok"]
    finally:
        clib.libc.cache_clear()
