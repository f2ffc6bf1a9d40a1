"""CUDA RawKernel backend of the memory-bound ops: ``kernels/*.cu`` built through CuPy.

One loader: it reads each ``kernels/*.cu`` file, prepends ``#define`` lines (the storage type
``T_STORE`` and any extra constants), builds a ``cupy.RawModule(code=...)`` and caches its
functions per (device, storage dtype, defines). The wrappers below have exactly the signatures
of ``itif.ops.reference`` (the spec and test oracle), validate every argument before a launch
(a RawKernel checks nothing) and launch on torch's current stream.

Launch configurations (``LaunchPolicy``, switchable for measurement):

* elementwise ops (``bias_act``, ``bias_residual``, ``embed_text``): ``"rows"`` follows the
  thesis (Eq. 4.3-4.4): threads = min(width, 1024) rounded up to a warp multiple, blocks =
  min(R x SM, rows), grid-stride over rows; ``"flat"`` runs one thread per 16-byte pack, 256
  threads a block, grid-stride over all packs.
* ``bias_residual_layernorm``: ``"block"`` (Eq. 4.3-4.4, one block per row) or ``"warp"`` (one
  warp per row, ``warps_per_block`` rows per block); ``"auto"`` takes the warp form for
  hidden <= 1024, where a block per row would leave most of its threads idle in the reductions.

``R`` (resident blocks per SM) is the driver's occupancy figure for the kernel at that block size
and shared memory (registers included); where that is unavailable, min(max blocks per SM, max
threads per SM // threads, shared memory per SM // the block's). Vectorised 16-byte accesses are used when the row
width is a multiple of the pack and every pointer is 16-byte aligned.

CuPy is imported lazily through ``itif.platform.cupy_module()``; importing this module is safe on
machines without CUDA (the validators and launch-config helpers run anywhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from itif.ops import reference
from itif.ops.reference import AttnGroup, RotParam
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
_SMEM_DEFAULT_LIMIT = 48 * 1024  # bytes of dynamic shared memory a block gets without opt-in
_INT32_MAX = 2**31 - 1


class KernelBuildError(RuntimeError):
    """The kernel sources could not be found or compiled (dispatch falls back on this)."""


# ---------------------------------------------------------------------------------------------
# launch policy


@dataclass(frozen=True)
class LaunchPolicy:
    """How the wrappers launch; change it with ``launch_policy(...)`` to measure alternatives."""

    elementwise: Literal["rows", "flat"] = "rows"
    layernorm: Literal["auto", "block", "warp"] = "auto"
    vectorize: bool = True
    ln_smem_cache: bool = True  # cache the pre-norm sum in shared memory (else re-read it)
    warps_per_block: int = 4  # warp-per-row kernels: rows per block
    attention: Literal["auto", "sdpa", "softmax_bmm"] = "auto"

    def __post_init__(self) -> None:
        if self.elementwise not in ("rows", "flat"):
            raise ValueError(f"elementwise {self.elementwise!r} is not 'rows' or 'flat'")
        if self.layernorm not in ("auto", "block", "warp"):
            raise ValueError(f"layernorm {self.layernorm!r} is not 'auto', 'block' or 'warp'")
        if self.attention not in ("auto", "sdpa", "softmax_bmm"):
            raise ValueError(f"attention {self.attention!r} is not 'auto', 'sdpa', 'softmax_bmm'")
        if not 1 <= self.warps_per_block <= 32:
            raise ValueError(f"warps_per_block {self.warps_per_block} is not in [1, 32]")


_policy = LaunchPolicy()


def get_policy() -> LaunchPolicy:
    return _policy


@contextlib.contextmanager
def launch_policy(**changes) -> Iterator[LaunchPolicy]:
    """Temporarily change the launch policy (tests, benchmarks). Not thread-safe by design."""
    global _policy
    old = _policy
    _policy = dataclasses.replace(old, **changes)
    try:
        yield _policy
    finally:
        _policy = old


@dataclass(frozen=True)
class DeviceInfo:
    sms: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int


def resident_blocks(info: DeviceInfo, threads: int, smem: int = 0) -> int:
    """R of Eq. 4.4: blocks of ``threads`` threads and ``smem`` bytes one SM holds at once."""
    r = min(info.max_blocks_per_sm, info.max_threads_per_sm // threads)
    if smem > 0:
        r = min(r, info.smem_per_sm // smem)
    return max(1, r)


def warp_round(n: int) -> int:
    return max(32, (n + 31) // 32 * 32)


Occupancy = Callable[[int, int], "int | None"]  # (threads, smem bytes) -> resident blocks


def _resident(info: DeviceInfo, threads: int, smem: int, occupancy: Occupancy | None) -> int:
    r = occupancy(threads, smem) if occupancy is not None else None
    return r if r is not None else resident_blocks(info, threads, smem)


def rows_config(units: int, rows: int, info: DeviceInfo, smem: int = 0,
                occupancy: Occupancy | None = None) -> tuple[int, int]:
    """Eq. 4.3-4.4: (blocks, threads) for one block per row of ``units`` work items.

    ``occupancy`` (the driver's occupancy calculator for the kernel, when available) gives R
    exactly, registers included; without it R comes from ``resident_blocks``.
    """
    threads = min(warp_round(units), 1024)
    blocks = min(_resident(info, threads, smem, occupancy) * info.sms, rows)
    return max(1, blocks), threads


def flat_config(total: int, info: DeviceInfo, threads: int = 256,
                occupancy: Occupancy | None = None) -> tuple[int, int]:
    """(blocks, threads) for one thread per work item, grid-stride, capped at R x SM blocks."""
    blocks = min(_resident(info, threads, 0, occupancy) * info.sms, -(-total // threads))
    return max(1, blocks), threads


def warp_config(rows: int, info: DeviceInfo, warps: int, smem: int = 0,
                occupancy: Occupancy | None = None) -> tuple[int, int]:
    """(blocks, threads) for one warp per row, ``warps`` rows per block."""
    threads = 32 * warps
    blocks = min(_resident(info, threads, smem, occupancy) * info.sms, -(-rows // warps))
    return max(1, blocks), threads


# ---------------------------------------------------------------------------------------------
# loader


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` sources: the repo's ``kernels/``, else an installed copy."""
    here = Path(__file__).resolve()
    candidates = (here.parents[2] / "kernels", here.parents[1] / "kernels")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.cu")):
            return c
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


class _Module:
    """Every kernel of every source file, built for one (device, storage, defines)."""

    def __init__(self, cp, device_index: int, storage: str, defines: tuple) -> None:
        self.cp = cp
        self.device_index = device_index
        self.functions: dict[str, object] = {}
        self._occupancy: dict[tuple[str, int, int], int] = {}
        with cp.cuda.Device(device_index):
            for path in kernel_files():
                src = kernel_source(path, storage, dict(defines))
                try:
                    mod = cp.RawModule(code=src, options=COMPILE_OPTIONS)
                    mod.compile()
                    for name in kernel_names(src):
                        self.functions[name] = mod.get_function(name)
                except Exception as e:  # CompileException, or a driver error loading it
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

    def launch(self, name: str, grid: int, block: int, args: tuple, shared_mem: int = 0) -> None:
        cp = self.cp
        stream = torch.cuda.current_stream(self.device_index)
        ext = cp.cuda.ExternalStream(stream.cuda_stream, self.device_index)
        with cp.cuda.Device(self.device_index):
            self.functions[name]((grid,), (block,), args, shared_mem=shared_mem, stream=ext)


_modules: dict[tuple, _Module] = {}
_modules_lock = threading.Lock()


def module_for(
    device: torch.device, dtype: torch.dtype, defines: Mapping[str, str | int | float] | None = None
) -> _Module:
    """The built kernels for ``device`` and ``dtype`` (compiled on first use, then cached)."""
    cp = cupy_module()
    if cp is None:
        raise KernelBuildError("CuPy is unavailable (see itif.platform.cupy_module)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, SUPPORTED_DTYPES[dtype], tuple(sorted((defines or {}).items())))
    mod = _modules.get(key)
    if mod is None:
        with _modules_lock:
            mod = _modules.get(key)
            if mod is None:
                mod = _modules[key] = _Module(cp, index, key[1], key[2])
    return mod


# ---------------------------------------------------------------------------------------------
# validation (pure host code: runs, and is tested, without a GPU)


def _fail(op: str, msg: str):
    raise ValueError(f"{op}: {msg}")


def _check_main(op: str, name: str, t, ndim: int, require_cuda: bool) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if require_cuda and not t.is_cuda:
        _fail(op, f"{name} is on {t.device}, but the CUDA kernels need a CUDA tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(op, f"{name} has dtype {t.dtype}; supported: {sorted(map(str, SUPPORTED_DTYPES))}")
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_like(op: str, name: str, t, like: torch.Tensor, like_name: str, shape=None) -> None:
    """``t`` on ``like``'s device, of its dtype, contiguous, of ``shape`` (if given)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != like.device:
        _fail(op, f"{name} is on {t.device} but {like_name} is on {like.device}")
    if t.dtype != like.dtype:
        _fail(op, f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} has shape {tuple(t.shape)} but {like_name} needs {tuple(shape)}")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_index(op: str, name: str, t, rows: int, device: torch.device, rows_of: str) -> None:
    """A per-row int64 index vector (slots, token ids, positions) of ``rows`` entries."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but {rows_of} is on {device}")
    if t.dtype != torch.int64:
        _fail(op, f"{name} has dtype {t.dtype} but must be torch.int64")
    if t.dim() != 1:
        _fail(op, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        _fail(op, f"{name} has {t.shape[0]} entries but {rows_of} has {rows} rows")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got strides {t.stride()}")


def _check_rot(op: str, name: str, p, rows: int, row_shape: tuple, like: torch.Tensor,
               like_name: str) -> None:
    """A RotParam whose buffer is [capacity, *row_shape] and whose slot has one entry a row."""
    if not (isinstance(p, tuple) and len(p) in (2, 3)):
        _fail(op, f"{name} must be a RotParam(buf, slot), got {type(p).__name__}")
    buf, slot = p[0], p[1]
    _check_like(op, f"{name}.buf", buf, like, like_name)
    if buf.dim() != 1 + len(row_shape) or tuple(buf.shape[1:]) != tuple(row_shape):
        _fail(op, f"{name}.buf has shape {tuple(buf.shape)} but {like_name} needs "
                  f"[capacity, {', '.join(map(str, row_shape))}]")
    if buf.shape[0] < 1:
        _fail(op, f"{name}.buf has capacity 0")
    _check_index(op, f"{name}.slot", slot, rows, like.device, like_name)


def _check_width(op: str, name: str, n: int) -> None:
    if n > _INT32_MAX:
        _fail(op, f"{name} width {n} exceeds {_INT32_MAX}")


def validate_bias_act(x, bias, act, *, require_cuda: bool = True) -> None:
    op = "bias_act"
    _check_main(op, "x", x, 2, require_cuda)
    if act not in ACT_CODES:
        _fail(op, f"act {act!r} is not one of {sorted(ACT_CODES)}")
    _check_width(op, "x", x.shape[1])
    _check_rot(op, "bias", bias, x.shape[0], (x.shape[1],), x, "x")


def validate_bias_residual(x, bias, residual, *, require_cuda: bool = True) -> None:
    op = "bias_residual"
    _check_main(op, "x", x, 2, require_cuda)
    _check_width(op, "x", x.shape[1])
    _check_rot(op, "bias", bias, x.shape[0], (x.shape[1],), x, "x")
    _check_like(op, "residual", residual, x, "x", shape=x.shape)


def validate_bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum, *,
                                     require_cuda: bool = True) -> None:
    op = "bias_residual_layernorm"
    _check_main(op, "x", x, 2, require_cuda)
    t, h = x.shape
    _check_width(op, "x", h)
    if bias is not None:
        _check_rot(op, "bias", bias, t, (h,), x, "x")
    if residual is not None:
        _check_like(op, "residual", residual, x, "x", shape=x.shape)
    _check_rot(op, "gamma", gamma, t, (h,), x, "x")
    _check_rot(op, "beta", beta, t, (h,), x, "x")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) \
            or eps < 0:
        _fail(op, f"eps {eps!r} must be a finite number >= 0")
    if not isinstance(keep_sum, bool):
        _fail(op, f"keep_sum {keep_sum!r} must be a bool")


def validate_embed_text(word, pos, type_, ids, positions, types, *,
                        require_cuda: bool = True) -> None:
    op = "embed_text"
    if not (isinstance(word, tuple) and len(word) in (2, 3)):
        _fail(op, f"word must be a RotParam(buf, slot), got {type(word).__name__}")
    wbuf = word[0]
    _check_main(op, "word.buf", wbuf, 3, require_cuda)
    e = wbuf.shape[2]
    _check_width(op, "word.buf", e)
    _check_index(op, "ids", ids, ids.shape[0] if isinstance(ids, torch.Tensor) else -1,
                 wbuf.device, "word.buf")
    t = ids.shape[0]
    _check_index(op, "positions", positions, t, wbuf.device, "ids")
    _check_index(op, "types", types, t, wbuf.device, "ids")
    _check_rot(op, "word", word, t, tuple(wbuf.shape[1:]), wbuf, "word.buf")
    for name, p in (("pos", pos), ("type_", type_)):
        if not (isinstance(p, tuple) and len(p) in (2, 3) and isinstance(p[0], torch.Tensor)):
            _fail(op, f"{name} must be a RotParam(buf, slot)")
        if p[0].dim() != 3 or p[0].shape[2] != e:
            _fail(op, f"{name}.buf has shape {tuple(p[0].shape)} but word.buf has width {e}: "
                      f"needs [capacity, rows, {e}]")
        _check_rot(op, name, p, t, tuple(p[0].shape[1:]), wbuf, "word.buf")


def validate_masked_softmax(scores, rows_per_seq, lengths, key_mask, scale, *,
                            require_cuda: bool = True) -> None:
    op = "masked_softmax"
    _check_main(op, "scores", scores, 2, require_cuda)
    rows, L = scores.shape
    _check_width(op, "scores", L)
    if isinstance(rows_per_seq, bool) or not isinstance(rows_per_seq, int) or rows_per_seq < 1:
        _fail(op, f"rows_per_seq {rows_per_seq!r} must be a positive int")
    if rows % rows_per_seq:
        _fail(op, f"scores has {rows} rows, not a multiple of rows_per_seq {rows_per_seq}")
    n = rows // rows_per_seq
    if lengths is not None:
        _check_index(op, "lengths", lengths, n, scores.device, "scores (sequences)")
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
            _fail(op, f"key_mask must be a bool tensor, got "
                      f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}")
        if key_mask.device != scores.device:
            _fail(op, f"key_mask is on {key_mask.device} but scores is on {scores.device}")
        if key_mask.numel() != n * L or key_mask.shape[0] != n or key_mask.shape[-1] != L:
            _fail(op, f"key_mask has shape {tuple(key_mask.shape)} but scores needs "
                      f"[{n}, ..., {L}] ({n} sequences of {L} keys)")
        if not key_mask.is_contiguous():
            _fail(op, f"key_mask must be contiguous, got strides {key_mask.stride()}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail(op, f"scale {scale!r} must be a finite number")


def validate_attention(qkv, groups, heads, out, *, require_cuda: bool = True) -> None:
    op = "attention"
    _check_main(op, "qkv", qkv, 2, require_cuda)
    t, h3 = qkv.shape
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        _fail(op, f"heads {heads!r} must be a positive int")
    if h3 % 3 or (h3 // 3) % heads:
        _fail(op, f"qkv width {h3} is not 3 x hidden with hidden a multiple of heads {heads}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.device != qkv.device
                            or out.dtype != qkv.dtype or tuple(out.shape) != (t, h3 // 3)):
        _fail(op, f"out must be a [{t}, {h3 // 3}] {qkv.dtype} tensor on {qkv.device}, got "
                  f"{getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))} on "
                  f"{getattr(out, 'device', None)}")
    for i, g in enumerate(groups):
        if not isinstance(g, AttnGroup):
            _fail(op, f"groups[{i}] is a {type(g).__name__}, not an AttnGroup")
        if g.n < 0 or g.L < 1:
            _fail(op, f"groups[{i}] has n={g.n}, L={g.L}")
        if g.rows is None:
            if g.start < 0 or g.start + g.n * g.L > t:
                _fail(op, f"groups[{i}] rows {g.start}:{g.start + g.n * g.L} exceed qkv's {t}")
        else:
            for name in ("rows", "valid", "dest"):
                v = getattr(g, name)
                if not isinstance(v, torch.Tensor) or v.device != qkv.device \
                        or v.dtype != torch.int64:
                    _fail(op, f"groups[{i}].{name} must be an int64 tensor on {qkv.device}, got "
                              f"{getattr(v, 'dtype', type(v).__name__)} on "
                              f"{getattr(v, 'device', None)}")
            if tuple(g.rows.shape) != (g.n, g.L):
                _fail(op, f"groups[{i}].rows has shape {tuple(g.rows.shape)} but n, L = "
                          f"{g.n}, {g.L}")
            if g.valid.shape != g.dest.shape:
                _fail(op, f"groups[{i}].valid has shape {tuple(g.valid.shape)} but dest has "
                          f"{tuple(g.dest.shape)}")
        if g.key_mask is not None:
            m = g.key_mask
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool \
                    or m.device != qkv.device or tuple(m.shape) != (g.n, 1, 1, g.L):
                _fail(op, f"groups[{i}].key_mask must be a bool [{g.n}, 1, 1, {g.L}] tensor on "
                          f"{qkv.device}, got {getattr(m, 'dtype', None)} "
                          f"{tuple(getattr(m, 'shape', ()))} on {getattr(m, 'device', None)}")


# ---------------------------------------------------------------------------------------------
# launch helpers


def _vec_width(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _ptr(t: torch.Tensor | None):
    """A kernel pointer argument: the address, or None for a null pointer."""
    return None if t is None else t.data_ptr()


def _elementwise(x: torch.Tensor, bias: RotParam, residual: torch.Tensor | None, act: int) -> None:
    rows, n = x.shape
    if rows == 0 or n == 0:
        return
    mod = module_for(x.device, x.dtype)
    pol = _policy
    v = _vec_width(x.dtype)
    vec = pol.vectorize and n % v == 0 and _aligned(x, bias.buf, residual)
    units = n // v if vec else n
    flat = pol.elementwise == "flat"
    occ = mod.occupancy("bias_act")
    grid, block = (flat_config(rows * units, mod.info, occupancy=occ) if flat
                   else rows_config(units, rows, mod.info, occupancy=occ))
    mod.launch("bias_act", grid, block, (
        x.data_ptr(), bias.buf.data_ptr(), bias.slot.data_ptr(), np.int64(bias.buf.shape[0]),
        _ptr(residual), np.int64(rows), np.int32(n), np.int32(act), np.int32(vec),
        np.int32(flat),
    ))


# ---------------------------------------------------------------------------------------------
# the ops (signatures of itif.ops.reference)


def bias_act(x: torch.Tensor, bias: RotParam, act: str = "none") -> torch.Tensor:
    """``x = act(x + bias[row])``. x: [T, N], modified in place and returned."""
    validate_bias_act(x, bias, act)
    _elementwise(x, bias, None, ACT_CODES[act])
    return x


def bias_residual(x: torch.Tensor, bias: RotParam, residual: torch.Tensor) -> torch.Tensor:
    """``x = x + bias[row] + residual``, in place. x, residual: [T, N]."""
    validate_bias_residual(x, bias, residual)
    _elementwise(x, bias, residual, ACT_CODES["none"])
    return x


def bias_residual_layernorm(
    x: torch.Tensor,
    bias: RotParam | None,
    residual: torch.Tensor | None,
    gamma: RotParam,
    beta: RotParam,
    eps: float,
    keep_sum: bool = False,
) -> torch.Tensor:
    """``LayerNorm(x + bias[row] + residual) * gamma[row] + beta[row]``, a new [T, H] tensor.

    With ``keep_sum`` the pre-norm sum is also written into ``x``; otherwise x is unchanged.
    """
    validate_bias_residual_layernorm(x, bias, residual, gamma, beta, eps, keep_sum)
    rows, h = x.shape
    y = torch.empty_like(x)
    if rows == 0 or h == 0:
        return y
    mod = module_for(x.device, x.dtype)
    pol = _policy
    v = _vec_width(x.dtype)
    vec = pol.vectorize and h % v == 0 and _aligned(
        x, None if bias is None else bias.buf, residual, gamma.buf, beta.buf, y)
    units = h // v if vec else h
    warp = pol.layernorm == "warp" or (pol.layernorm == "auto" and h <= 1024)
    occ = mod.occupancy("bias_residual_layernorm")
    row_bytes = 4 * h
    if warp:
        warps = pol.warps_per_block
        cached = pol.ln_smem_cache and row_bytes <= _SMEM_DEFAULT_LIMIT
        if cached:
            warps = max(1, min(warps, _SMEM_DEFAULT_LIMIT // row_bytes))
        smem = warps * row_bytes if cached else 0
        grid, block = warp_config(rows, mod.info, warps, smem, occ)
    else:
        cached = pol.ln_smem_cache and row_bytes <= _SMEM_DEFAULT_LIMIT
        smem = row_bytes if cached else 0
        grid, block = rows_config(units, rows, mod.info, smem, occ)
    b_buf, b_slot, b_cap = (None, None, 1) if bias is None else (
        bias.buf, bias.slot, bias.buf.shape[0])
    mod.launch("bias_residual_layernorm", grid, block, (
        x.data_ptr(), _ptr(b_buf), _ptr(b_slot), np.int64(b_cap), _ptr(residual),
        gamma.buf.data_ptr(), gamma.slot.data_ptr(), np.int64(gamma.buf.shape[0]),
        beta.buf.data_ptr(), beta.slot.data_ptr(), np.int64(beta.buf.shape[0]),
        y.data_ptr(), np.int64(rows), np.int32(h), np.float32(eps), np.int32(keep_sum),
        np.int32(vec), np.int32(warp), np.int32(cached),
    ), shared_mem=smem)
    return y


def embed_text(
    word: RotParam, pos: RotParam, type_: RotParam,
    ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor,
) -> torch.Tensor:
    """``word[slot, id] + pos[slot, p] + type[slot, t]`` -> a new [T, E] tensor.

    A row whose slot or index is out of range comes out NaN (no out-of-bounds read); token ids
    are validated against the vocabulary upstream (InvalidRequest), not here: that needs a sync.
    """
    validate_embed_text(word, pos, type_, ids, positions, types)
    wbuf = word.buf
    rows, e = ids.shape[0], wbuf.shape[2]
    out = torch.empty(rows, e, dtype=wbuf.dtype, device=wbuf.device)
    if rows == 0 or e == 0:
        return out
    mod = module_for(wbuf.device, wbuf.dtype)
    pol = _policy
    v = _vec_width(wbuf.dtype)
    vec = pol.vectorize and e % v == 0 and _aligned(wbuf, pos.buf, type_.buf, out)
    units = e // v if vec else e
    flat = pol.elementwise == "flat"
    occ = mod.occupancy("embed_text")
    grid, block = (flat_config(rows * units, mod.info, occupancy=occ) if flat
                   else rows_config(units, rows, mod.info, occupancy=occ))
    mod.launch("embed_text", grid, block, (
        out.data_ptr(),
        wbuf.data_ptr(), word.slot.data_ptr(), ids.data_ptr(),
        np.int64(wbuf.shape[0]), np.int64(wbuf.shape[1]),
        pos.buf.data_ptr(), pos.slot.data_ptr(), positions.data_ptr(),
        np.int64(pos.buf.shape[0]), np.int64(pos.buf.shape[1]),
        type_.buf.data_ptr(), type_.slot.data_ptr(), types.data_ptr(),
        np.int64(type_.buf.shape[0]), np.int64(type_.buf.shape[1]),
        np.int64(rows), np.int32(e), np.int32(vec), np.int32(flat),
    ))
    return out


def masked_softmax(
    scores: torch.Tensor,
    rows_per_seq: int,
    lengths: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """In place: each row of ``scores`` [n * rows_per_seq, L] becomes softmax(scale * row) over
    its sequence's live keys (j < lengths[b] and key_mask[b, j]); dead keys get 0, and a row
    with no live key is all zeros. b = row // rows_per_seq. lengths: [n] int64 or None (all L);
    key_mask: bool with n * L elements ([n, L] or [n, 1, 1, L]) or None.

    (No torch reference in ``itif.ops.reference``: it is an internal step of the CUDA attention
    path, not an op of its own; the GPU tests hold its oracle.)
    """
    validate_masked_softmax(scores, rows_per_seq, lengths, key_mask, scale)
    rows, L = scores.shape
    if rows == 0 or L == 0:
        return scores
    mod = module_for(scores.device, scores.dtype)
    warps = _policy.warps_per_block
    grid, block = warp_config(rows, mod.info, warps, 0, mod.occupancy("masked_softmax"))
    mod.launch("masked_softmax", grid, block, (
        scores.data_ptr(), _ptr(lengths), _ptr(key_mask), np.int64(rows), np.int32(L),
        np.int64(rows_per_seq), np.float32(scale),
    ))
    return scores


def _sdpa_takes(dtype: torch.dtype, d: int) -> bool:
    """Whether torch's fused SDPA kernels (flash / memory-efficient) accept this head shape;
    when they do not, SDPA runs its unfused math path."""
    return d % 8 == 0 and d <= 256 and dtype in (torch.float16, torch.bfloat16, torch.float32)


def _softmax_bmm_group(qkv: torch.Tensor, g: AttnGroup, heads: int, out: torch.Tensor) -> None:
    """One group through bmm -> masked_softmax kernel -> bmm (the fallback path)."""
    H = qkv.shape[1] // 3
    d = H // heads
    n, L = g.n, g.L
    if n == 0:
        return
    if g.rows is None:
        block = qkv[g.start : g.start + n * L].view(n, L, 3, heads, d)
    else:
        block = qkv.index_select(0, g.rows.reshape(-1)).view(n, L, 3, heads, d)
    q, k, v = (t.reshape(n * heads, L, d) for t in block.permute(2, 0, 3, 1, 4).unbind(0))
    scores = torch.empty(n * heads, L, L, dtype=qkv.dtype, device=qkv.device)
    # alpha applies the 1/sqrt(d) scale inside the GEMM, in float32, before rounding.
    scores.baddbmm_(q, k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d))
    mask = None if g.key_mask is None else g.key_mask.reshape(n, L)
    masked_softmax(scores.view(n * heads * L, L), heads * L, None, mask, 1.0)
    o = torch.bmm(scores, v).view(n, heads, L, d).transpose(1, 2).reshape(n * L, H)
    if g.rows is None:
        out[g.start : g.start + n * L] = o
    else:
        out.index_copy_(0, g.dest, o.index_select(0, g.valid))


def attention(
    qkv: torch.Tensor, groups: list[AttnGroup], heads: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Multi-head self-attention strictly within each request; qkv [T, 3H] -> [T, H].

    Choice of kernel, per group: torch's ``scaled_dot_product_attention`` (flash or
    memory-efficient kernels, which read the strided Q/K/V views in place and never materialise
    the [L, L] scores) whenever those kernels accept the head size. The bmm + fused masked
    softmax path is used (policy ``"auto"``) only where SDPA would fall back to its unfused math
    path: a masked group whose head size its fused kernels refuse; there it saves the separate
    mask-add and softmax passes over the [n, heads, L, L] scores. ``launch_policy(attention=
    "sdpa" | "softmax_bmm")`` forces one path for measurement.
    """
    validate_attention(qkv, groups, heads, out)
    T, H3 = qkv.shape
    H = H3 // 3
    d = H // heads
    if out is None:
        out = torch.zeros(T, H, dtype=qkv.dtype, device=qkv.device)
    mode = _policy.attention
    for g in groups:
        if mode == "softmax_bmm" or (
            mode == "auto" and g.key_mask is not None and not _sdpa_takes(qkv.dtype, d)
        ):
            _softmax_bmm_group(qkv, g, heads, out)
        else:
            reference.attention(qkv, [g], heads, out)
    return out


def slots_in_range(p: RotParam) -> bool:
    """Debug helper (syncs): whether every slot indexes the buffer."""
    s = p.slot
    return bool(s.numel() == 0 or (int(s.min()) >= 0 and int(s.max()) < p.buf.shape[0]))


__all__: Sequence[str] = (
    "ACT_CODES",
    "SUPPORTED_DTYPES",
    "DeviceInfo",
    "KernelBuildError",
    "LaunchPolicy",
    "attention",
    "bias_act",
    "bias_residual",
    "bias_residual_layernorm",
    "embed_text",
    "flat_config",
    "get_policy",
    "kernel_dir",
    "kernel_files",
    "kernel_names",
    "kernel_source",
    "launch_policy",
    "masked_softmax",
    "module_for",
    "rows_config",
    "validate_attention",
    "validate_bias_act",
    "validate_bias_residual",
    "validate_bias_residual_layernorm",
    "validate_embed_text",
    "validate_masked_softmax",
    "warp_config",
)
