"""Launch configuration of the CUDA RawKernels: the policy, the device figures and Eq. 4.3-4.4.

Pure host code (no CuPy): it runs, and is tested, without a GPU.

* elementwise ops (``bias_act``, ``bias_residual``, ``embed_text``): ``"rows"`` follows the
  thesis (Eq. 4.3-4.4): threads = min(width, 1024) rounded up to a warp multiple, blocks =
  min(R x SM, rows), grid-stride over rows; ``"flat"`` runs one thread per 16-byte pack, 256
  threads a block, grid-stride over all packs.
* ``bias_residual_layernorm``: ``"block"`` (Eq. 4.3-4.4, one block per row) or ``"warp"`` (one
  warp per row, ``warps_per_block`` rows per block); ``"auto"`` takes the warp form for
  hidden <= 1024, where a block per row would leave most of its threads idle in the reductions.

``R`` (resident blocks per SM) is the driver's occupancy figure for the kernel at that block size
and shared memory (registers included); where that is unavailable, min(max blocks per SM, max
threads per SM // threads, shared memory per SM // the block's).

``cached_config`` memoises a configuration per (module, kernel, form, rows, width, shared memory,
warps), so a launch on the hot path costs one dict look-up instead of the arithmetic and the
occupancy query.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal


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
# memoised configurations

ConfigForm = Literal["rows", "flat", "warp"]
_CONFIGS_MAX = 4096  # distinct (kernel, rows, width, ...) keys kept; the cache is cleared beyond
_configs: dict[tuple, tuple[int, int]] = {}


def cached_config(mod, name: str, form: ConfigForm, rows: int, units: int, smem: int = 0,
                  warps: int = 0) -> tuple[int, int]:
    """(blocks, threads) of kernel ``name`` of module ``mod`` (anything with ``info`` and
    ``occupancy(name)``, e.g. ``itif.ops.cuda_loader._Module``), computed once per key.

    ``"rows"``: ``rows_config(units, rows, smem)``; ``"flat"``: ``flat_config(rows * units)``;
    ``"warp"``: ``warp_config(rows, warps, smem)``. The module is part of the key (it is held,
    so its id is never reused while the entry lives): two devices never share an entry.
    """
    key = (mod, name, form, rows, units, smem, warps)
    cfg = _configs.get(key)
    if cfg is None:
        occ = mod.occupancy(name)
        if form == "rows":
            cfg = rows_config(units, rows, mod.info, smem, occ)
        elif form == "flat":
            cfg = flat_config(rows * units, mod.info, occupancy=occ)
        elif form == "warp":
            cfg = warp_config(rows, mod.info, warps, smem, occ)
        else:
            raise ValueError(f"launch form {form!r} is not 'rows', 'flat' or 'warp'")
        if len(_configs) >= _CONFIGS_MAX:
            _configs.clear()
        _configs[key] = cfg
    return cfg


def clear_config_cache() -> None:
    _configs.clear()


__all__ = [
    "DeviceInfo",
    "LaunchPolicy",
    "Occupancy",
    "cached_config",
    "clear_config_cache",
    "flat_config",
    "get_policy",
    "launch_policy",
    "resident_blocks",
    "rows_config",
    "warp_config",
    "warp_round",
]
