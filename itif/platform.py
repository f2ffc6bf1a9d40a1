"""Detect the platform once: CUDA through torch, CuPy, NVML. Optional imports never crash.

Nothing here runs at import time beyond cheap attribute checks; probes are cached functions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator

import torch

from itif.clib import libc

log = logging.getLogger("itif.platform")


@functools.lru_cache(maxsize=None)
def has_cuda() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def cupy_module():
    """The cupy module when it imports and sees a GPU, else None (logged once)."""
    if not has_cuda():
        return None
    try:
        import cupy  # noqa: PLC0415 - optional dependency

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as e:  # ImportError, or a CUDA runtime/driver mismatch
        log.warning("CuPy unavailable (%s): weight buffers fall back to torch allocations", e)
        return None


@functools.lru_cache(maxsize=None)
def nvml():
    """The initialised pynvml module, or None when NVML is absent."""
    try:
        import pynvml  # noqa: PLC0415 - provided by nvidia-ml-py

        pynvml.nvmlInit()
        return pynvml
    except Exception as e:
        log.info("NVML unavailable (%s): GPU metrics are not exported", e)
        return None


def gpu_handles(nv) -> list[tuple[int, object]]:
    """(index, NVML handle) of every GPU the initialised module ``nv`` lists; none without."""
    if nv is None:
        return []
    try:
        return [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(nv.nvmlDeviceGetCount())]
    except Exception as e:
        log.info("NVML lists no GPUs (%s): GPU metrics are not exported", e)
        return []


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when present. Asking for CUDA without one is a clear error."""
    if str(device) == "auto":
        return torch.device("cuda" if has_cuda() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not has_cuda():
        raise RuntimeError(f"device {str(device)!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu, cuda, auto)")
    return dev


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is float16 on CUDA and float32 on CPU.

    float16 and bfloat16 are accepted on the CPU too: the torch reference ops (GEMMs, LayerNorm,
    SDPA, GELU) all run in them. A CPU without native half-precision matmul support (AVX512-BF16
    or AMX) emulates them, often 100x slower than float32; that is logged once, not refused.
    """
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)} or 'auto'")
    if device.type == "cpu" and name != "float32":
        _warn_slow_cpu_half(name)
    return _DTYPES[name]


@functools.lru_cache(maxsize=None)
def _warn_slow_cpu_half(name: str) -> None:
    cpu = torch.cpu
    try:  # private probes; absent in some torch builds
        if name == "bfloat16":
            native = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
        else:
            native = cpu._is_amx_fp16_supported()
    except Exception:
        native = False
    if not native:
        need = "AVX512-BF16 or AMX" if name == "bfloat16" else "AMX-FP16"
        log.warning("dtype %s on a CPU without %s: its matmuls are emulated, far slower than "
                    "float32", name, need)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform as _platform

    return f"cpu-{_platform.machine()}-{torch.get_num_threads()}threads"


def _left_default(var: str, what: str) -> bool:
    """Whether the operator opted out of a process setting with ``<var>=default`` (or 0/off)."""
    if os.environ.get(var, "").lower() not in ("default", "0", "off"):
        return False
    log.info("%s=%s: %s left as it is", var, os.environ[var], what)
    return True


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_host_malloc: dict = {"tuned": None}


def tune_host_malloc(device: torch.device | str = "cpu") -> bool:
    """Keep a CPU forward's large activations in reused heap memory (glibc only; once a process).

    By default glibc serves every block over its mmap threshold (at most 32 MiB) with a fresh
    ``mmap`` and unmaps it when freed, and each engine thread gets its own arena, whose large
    blocks are mmapped too. A forward of 10,000+ rows allocates hundreds of MB of such blocks a
    layer, and the kernel faults in and zeroes every page again on each forward: measured 18-28 %
    of a 13,600- to 25,600-row MiniLM forward on this project's 2-core CPU (7.9 M minor faults
    against 0.7 M). Here: no mmapped blocks, no trimming of the heap's top, one arena for every
    thread started after this (threads keep per-thread caches for small blocks). The cost is a
    resident size that stays at its high-water mark, as a server's does anyway.

    CPU engines call it when built; benchmarks call it before their first baseline, so the
    baselines in the same process run under the same allocator. ``ITIF_HOST_MALLOC=default``
    leaves glibc as it is. Returns whether the settings are in force.
    """
    if torch.device(device).type != "cpu":
        return bool(_host_malloc["tuned"])
    if _host_malloc["tuned"] is not None:
        return _host_malloc["tuned"]
    import sys  # noqa: PLC0415

    ok = False
    opted_out = _left_default("ITIF_HOST_MALLOC", "glibc's allocator")
    if not opted_out and sys.platform.startswith("linux"):
        c = libc()
        try:
            c.gnu_get_libc_version  # not glibc (musl): leave it
            ok = all(c.mallopt(p, v) == 1 for p, v in (
                (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))
        except AttributeError as e:  # no C library, or not glibc
            log.info("host allocator not tuned (%s)", e)
    _host_malloc["tuned"] = ok
    return ok


def host_malloc() -> str:
    """``"tuned"`` once :func:`tune_host_malloc` is in force in this process, else ``"default"``
    (recorded with benchmark results)."""
    return "tuned" if _host_malloc["tuned"] else "default"


#: The daemon's first collector threshold (allocations of tracked objects between two
#: youngest-generation collections; Python's default is 700).
GC_THRESHOLD0 = 10_000


@functools.cache
def tune_gc() -> bool:
    """A serving process's settings for Python's cyclic garbage collector (once a process).

    Every gRPC call leaves a reference cycle (gRPC's call state and the context of its done
    callback) and, while it waits in the queue, lives through several youngest-generation
    collections, so a saturated daemon promotes tens of thousands of objects a second to the
    oldest generation, and each full collection walks everything the process holds: the
    interpreter's, torch's and transformers' startup objects included. Measured on this
    project's 2-core CPU, a burst of 8,000 calls (bert-tiny, 16 tenants): 1.7 s of collection
    in about 10 s, 0.09-0.31 s a full collection. Here, as many servers do: what startup made
    is frozen out of the collector's walks (``gc.freeze``, which never frees it: startup made
    no garbage worth a walk), and the youngest generation is collected every
    :data:`GC_THRESHOLD0` allocations instead of 700, a pause of about 2 ms (a saturating burst:
    a median 893 calls/s against 763, ``bench/results/cpu-serve-burst-gc-2026-11-24.json``).
    Call it once startup is done;
    ``ITIF_GC=default`` leaves the collector as it is. Returns whether the settings are in
    force.
    """
    import gc  # noqa: PLC0415

    if _left_default("ITIF_GC", "the garbage collector"):
        return False
    gc.collect()  # what startup left behind goes first; the rest is frozen
    gc.freeze()
    _, t1, t2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, t1, t2)
    return True


# ---- attention backends ------------------------------------------------------------------------
_sdpa_lock = threading.Lock()
_sdpa_state = {"users": 0, "saved": True}


@functools.cache
def cudnn_attention_allowed() -> bool:
    """Whether itif's forwards let torch's SDPA pick cuDNN attention (``ITIF_CUDNN_SDPA=1``).

    By default they do not. torch puts cuDNN attention first on sm90 and newer when the cuDNN
    is recent, and cuDNN builds an execution plan for every new (batch, heads, query length, key
    length, strides) it sees, kept in a cache that nothing bounds. itif's batches are ever-new
    shapes under a serving load (each request's length, each group's size). On an H100 the
    first pass over 100 serving batches of bert-base took 154 ms a batch and the same batches
    again 16 ms (bench/results/gpu-h100-2026-11-26-serve/graph_policy.json, CUDA graphs off,
    round 0 against round 1). Leaving cuDNN out, a first pass over fresh serving batches took
    36.6 ms a batch against 199.7 with it (bench/results/gpu-h100-2026-11-26-serve2/
    before-graph_policy.json, ``bench/graph_policy.py --attention itif cudnn``). Flash and
    memory-efficient attention build nothing per shape.
    """
    return os.environ.get("ITIF_CUDNN_SDPA", "") == "1"


@contextlib.contextmanager
def attention_backends(device: torch.device) -> Iterator[None]:
    """Around a forward on ``device``: torch's SDPA without its cuDNN backend (see
    :func:`cudnn_attention_allowed`); nothing on other devices or with ``ITIF_CUDNN_SDPA=1``.

    torch's switch is one process-wide flag, not per thread, so threads forwarding at once
    share one setting: the first to enter turns cuDNN attention off, the last to leave puts
    back what it found. Code outside itif that runs SDPA while a forward is in flight (a
    Hugging Face baseline in another thread) sees it off too."""
    if device.type != "cuda" or cudnn_attention_allowed():
        yield
        return
    with _sdpa_lock:
        if _sdpa_state["users"] == 0:
            _sdpa_state["saved"] = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _sdpa_state["users"] += 1
    try:
        yield
    finally:
        with _sdpa_lock:
            _sdpa_state["users"] -= 1
            if _sdpa_state["users"] == 0:
                torch.backends.cuda.enable_cudnn_sdp(_sdpa_state["saved"])


class ThreadSwitch:
    """A kernel's per-thread off switch (``itif.runtime.cpu_gemm``, ``cpu_linear``): the cost
    model calibrates MKL's backends alone this way, while forwards on other threads are
    unaffected."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def off(self) -> bool:
        return getattr(self._local, "off", False)

    @contextlib.contextmanager
    def suspended(self, off: bool = True) -> Iterator[None]:
        """In this thread only, the kernel stays off (``off``; ``suspended(False)`` lets it run
        again inside a suspended stretch)."""
        old = self.off
        self._local.off = off
        try:
            yield
        finally:
            self._local.off = old
