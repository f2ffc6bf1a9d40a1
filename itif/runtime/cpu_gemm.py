"""The CPU's few-rows GEMM (``kernels/seg_gemm_cpu.cpp``): build once, use where it is faster.

``run_gemm`` (``itif.runtime.gemm``) sends a float32 CPU GEMM here when its longest
segment has :data:`MIN_ROWS` to :data:`MAX_ROWS` rows (a decode step, short requests): per
segment, ``y[s:e] = x[s:e] @ w[slot].T`` with the weights read in place, as the other
backends do. Measured on the 2-core
AMD EPYC (AVX2) these sessions run on, a marian-decoding decode step's GEMMs (8 tenants x 16
rows, 6 layers; ``bench/cpu_gemm.py``): 46-48 ms against 71-74 ms for MKL's ``bmm``.

The kernel is C++ with AVX2/FMA intrinsics, compiled by ``torch.utils.cpp_extension`` the first
time a process needs it (about 30 s on that machine, with a log line saying so; cached in
``TORCH_EXTENSIONS_DIR``, so later processes load it in about a second). :func:`ensure` builds it
synchronously, so a forward never changes GEMM backend halfway through a run. A process killed
mid-build leaves torch's build lock behind, which would make every later start wait forever;
one older than :data:`STALE_LOCK_S` is removed (:func:`clear_stale_lock`). Without a C++
compiler, without AVX2/FMA, or with ``ITIF_CPU_GEMM=0``, everything stays on MKL (the reason is
logged once and kept in :data:`state`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from itif.platform import ThreadSwitch

log = logging.getLogger("itif.runtime")

#: A product goes to the kernel when its longest segment has MIN_ROWS to MAX_ROWS rows.
#: bench/cpu_gemm.py, 8 tenants against [2048, 512] each, 2 threads: the kernel 2.0 vs MKL
#: 1.2 ms at 1 row a tenant, 2.0 vs 2.7 at 4, 2.2 vs 3.7 at 16, 6.8 vs 8.1 at 64 (its chunks of
#: 16 rows re-read a weight block from cache, MKL packs it once per call and catches up).
MIN_ROWS = 4
MAX_ROWS = 64

#: Rows of x the kernel takes at once (one chunk); a segment of r rows is ceil(r / 16) chunks.
CHUNK = 16

#: A build lock this old was left by a process that died while building (a build takes about
#: 30 s here): torch would wait on it forever, so :func:`clear_stale_lock` removes it.
STALE_LOCK_S = 300.0

_lock = threading.Lock()
_switch = ThreadSwitch()
state: dict = {"module": None, "why_not": None, "build_s": None}


def _source(filename: str = "seg_gemm_cpu.cpp") -> Path:
    here = Path(__file__).resolve().parent.parent  # itif/
    for cand in (here / "kernels" / filename, here.parent / "kernels" / filename):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"kernels/{filename} not found next to the itif package")


def _cpu_has_avx2_fma() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return cap in ("AVX2", "AVX512")


def clear_stale_lock(build_dir: Path, stale_s: float = STALE_LOCK_S,
                     poll_s: float = 1.0) -> bool:
    """Wait while another process builds the kernel (its lock in ``build_dir`` is fresh); remove
    a lock older than ``stale_s`` seconds, which a process killed mid-build leaves behind and
    torch's loader would wait on forever (a daemon that never starts). True if one was removed."""
    lock = Path(build_dir) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age > stale_s:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            log.warning("removed %s, left %.0f s ago by a build that did not finish; "
                        "building the CPU few-rows GEMM kernel again", lock, age)
            return True
        time.sleep(poll_s)


def _build_dir(name: str) -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # noqa: PLC0415
    except ImportError:  # a torch without it: its loader's own wait applies
        return None
    return Path(_get_build_directory(name, verbose=False))


def load_kernel(name: str, filename: str, what: str):
    """Build (first time in an environment) or load the C++ extension ``name`` from
    ``kernels/<filename>`` (AVX2/FMA, OpenMP), after clearing a stale build lock; raises what
    the build raises. Shared by this module and ``itif.runtime.cpu_attention``."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415

    src = _source(filename)
    build_dir = _build_dir(name)
    if build_dir is not None:
        clear_stale_lock(build_dir)
    log.info("loading %s (%s; the first build in a fresh environment compiles it, about 30 s)",
             what, src.name)
    # -fopenmp: at::parallel_for is OpenMP inside torch; without it the pragma is dropped and
    # the kernel runs on one thread
    return load(name=name, sources=[str(src)], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


def ensure_kernel(state: dict, lock: threading.Lock, env: str, name: str, filename: str,
                  what: str, instead: str) -> bool:
    """Build (or load) the C++ extension ``name`` from ``kernels/<filename>`` into ``state``
    (``module``, ``why_not``, ``build_s``) once a process; True when it is usable. ``env=0``
    turns it off; a CPU without AVX2/FMA or a failed build leaves it off, and the log says
    why and what runs ``instead``. Shared by this module and ``itif.runtime.cpu_attention``."""
    if state["module"] is not None:
        return True
    if state["why_not"] is not None:
        return False
    with lock:
        if state["module"] is not None or state["why_not"] is not None:
            return state["module"] is not None
        if os.environ.get(env, "1") == "0":
            state["why_not"] = f"disabled by {env}=0"
        elif not _cpu_has_avx2_fma():
            cap = torch.backends.cpu.get_cpu_capability()
            state["why_not"] = f"this CPU has no AVX2/FMA ({cap})"
        else:
            t0 = time.perf_counter()
            try:
                state["module"] = load_kernel(name, filename, what)
                state["build_s"] = round(time.perf_counter() - t0, 2)
            except Exception as e:  # no compiler, no ninja, a build error: ``instead`` runs
                state["why_not"] = f"build failed: {type(e).__name__}: {str(e)[:300]}"
        if state["why_not"] is not None:
            log.warning("%s not used (%s); %s", what[0].upper() + what[1:], state["why_not"],
                        instead)
        return state["module"] is not None


def ensure() -> bool:
    """Build (or load) the kernel now if this process may use it; True when it is usable."""
    return ensure_kernel(state, _lock, "ITIF_CPU_GEMM", "itif_seg_gemm_cpu", "seg_gemm_cpu.cpp",
                         "the CPU few-rows GEMM kernel", "MKL runs every GEMM")


#: ``with suspended():`` every product of this thread stays on MKL (the cost model
#: calibrates MKL's backends alone this way); ``suspended(False)`` lets the kernel run again.
suspended = _switch.suspended


def _suits(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32


def ensure_for(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`ensure` for an engine on ``device`` in ``dtype``: built now (not mid-run) when
    its products can go to the kernel; False (nothing built) otherwise."""
    return _suits(device, dtype) and ensure()


def applies(max_rows: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``run_gemm`` sends a plan whose longest segment has ``max_rows`` rows here (the
    one rule, for the runtime and the cost model alike)."""
    return (state["module"] is not None and not _switch.off
            and _suits(device, dtype) and MIN_ROWS <= max_rows <= MAX_ROWS)


def chunks(start, end) -> int:
    """Chunks of :data:`CHUNK` rows the kernel runs for these segments."""
    return sum(-(-(e - s) // CHUNK) for s, e in zip(start, end))


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether these operands suit the kernel (with :func:`applies`: whether it runs them)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.is_contiguous() and w.is_contiguous())


def seg_gemm(x: torch.Tensor, w: torch.Tensor, start, end, slot, out: torch.Tensor) -> torch.Tensor:
    """``out[s:e] = x[s:e] @ w[slot].T`` for each segment; ``out`` contiguous [rows, N]."""
    state["module"].seg_gemm(x, w, list(start), list(end), list(slot), out)
    return out


__all__ = ["CHUNK", "MAX_ROWS", "MIN_ROWS", "applies", "chunks", "ensure", "ensure_for",
           "load_kernel", "seg_gemm", "state", "suspended", "usable"]
