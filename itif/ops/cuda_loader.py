"""Loader of the CUDA RawKernels: finds ``kernels/*.cu``, builds them with CuPy, launches them.

It reads each ``.cu`` file, prepends ``#define`` lines (the storage type ``T_STORE`` and any
extra constants), builds a ``cupy.RawModule(code=...)`` (NVRTC) and caches its functions per
(device, storage dtype, defines).

Where the sources come from (``kernel_dir``): the package's own ``itif/kernels/`` (package data
of a wheel; in the repository a symlink to the root ``kernels/``, the single source), else the
repository's ``kernels/`` next to the package.

Headers: the kernels include ``cuda_fp16.h`` and ``cuda_bf16.h``. NVRTC as CuPy drives it
usually finds them (CuPy passes the toolkit's include folder); where it does not, the build is
retried with ``-I`` the first folder of ``cuda_include_candidates()`` that holds both (CuPy's
``cupy/_core/include``, the ``nvidia-cuda-runtime`` / ``nvidia-cuda-nvrtc`` wheels, ``CUDA_PATH``,
``CUDA_HOME``, ``/usr/local/cuda``), and a ``KernelBuildError`` lists every folder looked in when
none does.

Launches go on torch's current stream of the module's device. The CuPy stream object is made
once per torch stream (``cupy.cuda.Stream.from_external`` where CuPy has it, CuPy >= 14; else
``cupy.cuda.ExternalStream``) and cached, and the device is switched only when it is not already
the current one, so a launch costs a dict look-up and the driver call.

CuPy is imported lazily through ``itif.platform.cupy_module()``; importing this module is safe on
machines without CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from itif.ops.launch import DeviceInfo, Occupancy
from itif.platform import cupy_module

SUPPORTED_DTYPES: Mapping[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
}

# Activation name (reference._ACT) -> kernel code; keep in sync with ACT_* in rotation.cu.
ACT_CODES: Mapping[str, int] = {
    "none": 0,
    "gelu": 1,
    "gelu_new": 2,
    "gelu_pytorch_tanh": 2,
    "relu": 3,
    "silu": 4,
    "tanh": 5,
}

COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17",)
CUDA_HEADERS: tuple[str, ...] = ("cuda_fp16.h", "cuda_bf16.h")


class KernelBuildError(RuntimeError):
    """The kernel sources could not be found or compiled (dispatch falls back on this)."""


# ---------------------------------------------------------------------------------------------
# sources


def kernel_dir_candidates() -> tuple[Path, ...]:
    """Where ``kernel_dir`` looks, in order: the package's ``kernels/`` (installed copies), then
    the repository's root ``kernels/`` (a source checkout)."""
    here = Path(__file__).resolve()
    return (here.parents[1] / "kernels", here.parents[2] / "kernels")


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` sources (see ``kernel_dir_candidates``)."""
    candidates = kernel_dir_candidates()
    for c in candidates:
        if c.is_dir() and any(c.glob("*.cu")):
            return c.resolve()
    raise KernelBuildError(
        f"no kernels/*.cu found (looked in {', '.join(str(c) for c in candidates)})"
    )


def kernel_files() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s+)?'
    r"(?:void\s+)?([A-Za-z_]\w*)\s*\("
)


def kernel_names(source: str) -> list[str]:
    """The ``extern "C" __global__`` entry points a source defines."""
    return _ENTRY.findall(source)


def kernel_source(
    path: Path, storage: str, defines: Mapping[str, str | int | float] | None = None
) -> str:
    """The exact text handed to the compiler: ``#define`` lines, then the file."""
    lines = [f"#define T_STORE {storage}"]
    for k, v in (defines or {}).items():
        if not re.fullmatch(r"[A-Za-z_]\w*", k):
            raise ValueError(f"define name {k!r} is not an identifier")
        lines.append(f"#define {k} {v}")
    lines.append(f'#line 1 "{path.name}"')
    return "\n".join(lines) + "\n" + path.read_text()


# ---------------------------------------------------------------------------------------------
# CUDA headers for NVRTC


def cuda_include_candidates() -> list[Path]:
    """Folders that may hold ``cuda_fp16.h`` / ``cuda_bf16.h``, in the order they are tried."""
    out: list[Path] = []
    try:
        spec = importlib.util.find_spec("cupy")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        out.append(Path(spec.origin).parent / "_core" / "include")
    try:
        nv = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        nv = None
    for root in (nv.submodule_search_locations or []) if nv is not None else []:
        for sub in ("cuda_runtime", "cuda_nvrtc", "cu13", "cu12"):
            out.append(Path(root) / sub / "include")
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            out.append(Path(os.environ[var]) / "include")
    out.append(Path("/usr/local/cuda/include"))
    seen, unique = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


def find_cuda_include(headers: Sequence[str] = CUDA_HEADERS) -> tuple[Path | None, list[Path]]:
    """(the first candidate folder holding every header, or None; the folders looked in)."""
    looked = cuda_include_candidates()
    for d in looked:
        if all((d / h).is_file() for h in headers):
            return d, looked
    return None, looked


_MISSING_HEADER = re.compile(r"cannot open source file|could not open source file|"
                             r"No such file|file not found", re.IGNORECASE)


def _missing_header(err: BaseException) -> bool:
    msg = str(err)
    return bool(_MISSING_HEADER.search(msg)) and any(h in msg for h in CUDA_HEADERS)


_extra_options: tuple[str, ...] = ()  # the -I option found necessary by an earlier build


def _compile(cp, src: str, name: str, storage: str, device_index: int):
    """Build one source; on a missing CUDA header retry with ``-I`` a folder that has them."""
    global _extra_options
    try:
        mod = cp.RawModule(code=src, options=COMPILE_OPTIONS + _extra_options)
        mod.compile()
        return mod
    except Exception as e:  # CompileException, or a driver error loading it
        first = e
    where = f"building {name} for {storage} on cuda:{device_index} failed"
    if not _missing_header(first):
        raise KernelBuildError(f"{where}: {first}") from first
    inc, looked = find_cuda_include()
    if inc is None or f"-I{inc}" in _extra_options:
        raise KernelBuildError(
            f"{where}: NVRTC cannot find the CUDA headers {', '.join(CUDA_HEADERS)}, and no "
            f"folder holds them (looked in {', '.join(map(str, looked))}); install the "
            f"nvidia-cuda-runtime wheel or set CUDA_PATH to a CUDA toolkit. NVRTC said: {first}"
        ) from first
    options = (f"-I{inc}",)
    try:
        mod = cp.RawModule(code=src, options=COMPILE_OPTIONS + options)
        mod.compile()
    except Exception as e:
        raise KernelBuildError(f"{where}, also with -I{inc}: {e}") from e
    _extra_options = options
    return mod


# ---------------------------------------------------------------------------------------------
# streams


class _StreamHandle:
    """A raw ``cudaStream_t`` seen through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(cp, handle: int, device_index: int):
    """A CuPy stream object for the raw stream ``handle`` (no deprecation warning on CuPy 14)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(handle, device_index)


_raw_stream_fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(device_index: int) -> int:
    """torch's current stream on ``device_index``, as the raw ``cudaStream_t`` value."""
    if _raw_stream_fn is not None:
        return _raw_stream_fn(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# ---------------------------------------------------------------------------------------------
# modules


class _Module:
    """Every kernel of every source file, built for one (device, storage, defines)."""

    def __init__(self, cp, device_index: int, storage: str, defines: tuple) -> None:
        self.cp = cp
        self.device_index = device_index
        self.functions: dict[str, object] = {}
        self._occupancy: dict[tuple[str, int, int], int] = {}
        self._streams: dict[int, object] = {}  # raw cudaStream_t -> CuPy stream object
        with cp.cuda.Device(device_index):
            for path in kernel_files():
                src = kernel_source(path, storage, dict(defines))
                mod = _compile(cp, src, path.name, storage, device_index)
                try:
                    for name in kernel_names(src):
                        self.functions[name] = mod.get_function(name)
                except Exception as e:  # a driver error loading it
                    raise KernelBuildError(
                        f"building {path.name} for {storage} on cuda:{device_index} failed: {e}"
                    ) from e
        props = cp.cuda.runtime.getDeviceProperties(device_index)
        self.info = DeviceInfo(
            sms=int(props["multiProcessorCount"]),
            max_threads_per_sm=int(props["maxThreadsPerMultiProcessor"]),
            max_blocks_per_sm=int(props.get("maxBlocksPerMultiProcessor", 16)),
            smem_per_sm=int(props.get("sharedMemPerMultiprocessor", 64 * 1024)),
        )
        self._get_device = cp.cuda.runtime.getDevice

    def occupancy(self, name: str) -> Occupancy:
        """R for kernel ``name``: the driver's count of its resident blocks per SM."""
        return functools.partial(self._resident, name)

    def _resident(self, name: str, threads: int, smem: int) -> int | None:
        key = (name, threads, smem)
        r = self._occupancy.get(key)
        if r is None:
            try:
                with self.cp.cuda.Device(self.device_index):
                    r = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        self.functions[name].kernel.ptr, threads, smem)
            except Exception:  # noqa: BLE001 - fall back to the thread/smem estimate
                r = 0
            self._occupancy[key] = r
        return r if r > 0 else None

    def stream(self):
        """The CuPy stream object for torch's current stream on this device (cached)."""
        raw = current_raw_stream(self.device_index)
        s = self._streams.get(raw)
        if s is None:
            s = self._streams[raw] = cupy_stream(self.cp, raw, self.device_index)
        return s

    def launch(self, name: str, grid: int, block: int, args: tuple, shared_mem: int = 0) -> None:
        fn = self.functions[name]
        stream = self.stream()
        if self._get_device() == self.device_index:
            fn((grid,), (block,), args, shared_mem=shared_mem, stream=stream)
        else:
            with self.cp.cuda.Device(self.device_index):
                fn((grid,), (block,), args, shared_mem=shared_mem, stream=stream)


_modules: dict[tuple, _Module] = {}
_by_device: dict[tuple, _Module] = {}  # (torch.device with an index, dtype) -> module, no defines
_modules_lock = threading.Lock()


def module_for(
    device: torch.device, dtype: torch.dtype, defines: Mapping[str, str | int | float] | None = None
) -> _Module:
    """The built kernels for ``device`` and ``dtype`` (compiled on first use, then cached)."""
    if defines is None:
        mod = _by_device.get((device, dtype))
        if mod is not None:
            return mod
    cp = cupy_module()
    if cp is None:
        raise KernelBuildError("CuPy is unavailable (see itif.platform.cupy_module)")
    if dtype not in SUPPORTED_DTYPES:
        raise KernelBuildError(f"no kernels for dtype {dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, SUPPORTED_DTYPES[dtype], tuple(sorted((defines or {}).items())))
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                mod = _modules[key] = _Module(cp, index, key[1], key[2])
    if defines is None and device.index is not None:
        _by_device[(device, dtype)] = mod
    return mod


__all__ = [
    "ACT_CODES",
    "COMPILE_OPTIONS",
    "CUDA_HEADERS",
    "KernelBuildError",
    "SUPPORTED_DTYPES",
    "cuda_include_candidates",
    "cupy_stream",
    "current_raw_stream",
    "find_cuda_include",
    "kernel_dir",
    "kernel_dir_candidates",
    "kernel_files",
    "kernel_names",
    "kernel_source",
    "module_for",
]
