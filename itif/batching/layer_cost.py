"""Per-layer cost tables for the batching planner, profiled offline (the other cost models:
``calibration.batch_cost`` prices a whole fused forward, ``calibration.batch_timing`` times it,
``scheduler.estimate`` learns run times online).

A profiled cost model of one encoder layer's compute-bound work.

The planner (``itif.batching.dp``) needs two tables, as in the ITIF thesis §4.1:

* ``A[len][batch]`` -- :meth:`CostModel.single`: predicted milliseconds of one encoder layer's
  GEMMs (QKV ``[3H, H]``, out-projection ``[H, H]``, FFN ``[I, H]`` and ``[H, I]``) plus
  scaled-dot-product attention, for ONE mini-batch of ``batch`` requests padded to ``len``, run
  with one tenant's weights.
* ``B[len][n][batch]`` -- :meth:`CostModel.batched`: the same work for ``n`` equally shaped
  mini-batches of different tenants, run as one batched-GEMM group (``torch.bmm`` over ``n``
  stacked weight matrices; attention is weight-free, so it runs as one call over ``n * batch``).

Both are measured on a geometric grid of ``len``, ``batch`` (and ``n``: 1, 2, 4, ...) and
interpolated multilinearly in the raw coordinates inside each grid cell. Raw rather than log
coordinates because a layer costs about ``overhead + c * len * batch`` (+ attention's ``len^2``
term), which is exactly bilinear in (len, batch): against that analytic cost, interpolating in
log(len), log(batch) is off by up to 13 % on a factor-2 grid and 60 % on the quick factor-4 grid,
raw coordinates by under 0.3 %. Beyond the grid the cost grows in proportion to the extra tokens
(or members); below it, the smallest grid point's cost is used because fixed launch overhead
dominates there.

Tables are made monotone non-decreasing along every axis on construction, so timing noise can
never make a bigger batch look cheaper -- the planner's optimality argument (see ``dp``) relies on
that. Interpolation preserves it up to float rounding (a few ulps); the dense integer table the
planner reads (:meth:`CostModel.single_table`) is monotone exactly.

Noise on a timing is one-sided (contention, preemption and clock drops only add time), so the
repair is a suffix minimum -- each point becomes the cheapest of itself and every larger point --
not a prefix maximum: both give a monotone table, but a prefix maximum copies one slow outlier
into every larger point (observed on a shared 2-core CPU: one 72 ms sample at a 0.5 ms point
inflated six of nine quick-grid points), while the suffix minimum is still an upper bound on the
true cost because the true cost of a smaller shape is at most the true cost of a larger one.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

_FORMAT_VERSION = 1

# quick=True grid: a handful of points, enough for tests and smoke runs; everything else is
# inter-/extrapolated. On 2 (shared) CPU cores it takes about 0.5 s for a test-sized layer
# (H=32..64) and 3-4 s for MiniLM or BERT-base.
_QUICK_LENS = (4, 16, 64)
_QUICK_BATCHES = (1, 4, 16)
_QUICK_NS = (1, 2, 4)


@dataclass(frozen=True)
class LayerShape:
    """What one encoder layer multiplies: hidden size H, FFN size I, attention heads."""

    hidden: int
    intermediate: int
    heads: int

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerShape.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def flops(self, seq_len: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """FLOPs of one layer's GEMMs + attention for mini-batches of shape (seq_len, batch).

        seq_len, batch: broadcastable arrays. Returns float64 of the broadcast shape.
        """
        tokens = np.asarray(seq_len, dtype=np.float64) * np.asarray(batch, dtype=np.float64)
        gemm = 2.0 * tokens * self.hidden * (4 * self.hidden + 2 * self.intermediate)
        # QK^T and PV: each 2 * len * len * head_dim per head, i.e. 2 * len^2 * H per sequence.
        attention = 4.0 * tokens * np.asarray(seq_len, dtype=np.float64) * self.hidden
        return gemm + attention


@dataclass(frozen=True)
class _Timing:
    """How hard to measure one grid point."""

    warmup: int  # untimed calls; the last one also sizes the inner loop
    repeats: int  # timed samples, the median is kept
    budget_s: float  # stop sampling a point after this long (at least one sample is taken)
    min_sample_s: float  # repeat tiny ops inside one sample so timer and launch jitter amortise


_QUICK_TIMING = _Timing(warmup=1, repeats=3, budget_s=0.02, min_sample_s=0.0005)
_FULL_TIMING = _Timing(warmup=3, repeats=9, budget_s=1.0, min_sample_s=0.005)


def _measure_ms(fn: Callable[[], None], sync: Callable[[], None], timing: _Timing) -> float:
    """Median wall time of ``fn()`` in milliseconds; ``sync`` drains the device queue."""
    for _ in range(timing.warmup - 1):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    estimate = time.perf_counter() - start
    inner = int(min(100, max(1, timing.min_sample_s / max(estimate, 1e-9))))
    samples = []
    deadline = time.perf_counter() + timing.budget_s
    while len(samples) < timing.repeats:
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner)
        if time.perf_counter() > deadline:
            break
    return statistics.median(samples) * 1e3


def _geom_grid(hi: int) -> np.ndarray:
    """1, 2, 4, ... up to and including ``hi``."""
    if hi < 1:
        raise ValueError(f"grid maximum must be >= 1, got {hi}")
    points = [1 << k for k in range(hi.bit_length()) if (1 << k) <= hi]
    if points[-1] != hi:
        points.append(hi)
    return np.asarray(points, dtype=np.int64)


def _capped_grid(points: tuple[int, ...], hi: int) -> np.ndarray:
    if hi < 1:
        raise ValueError(f"grid maximum must be >= 1, got {hi}")
    return np.unique(np.minimum(np.asarray(points, dtype=np.int64), hi))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def timing_device_name(device: torch.device) -> str:
    """What timings depend on: the GPU model, or the CPU kind and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"cpu-{cpu}-{torch.get_num_threads()}t"


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _randn(*size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Real values, not torch.empty: uninitialised memory may hold denormals/NaNs that slow CPUs.
    return torch.randn(*size, device=device, dtype=dtype)


def _single_weights(
    shape: LayerShape, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """One tenant's layer weights in torch's ``[out, in]`` layout: QKV, out-proj, FFN in, out."""
    h, i = shape.hidden, shape.intermediate
    kw = {"device": device, "dtype": dtype}
    return _randn(3 * h, h, **kw), _randn(h, h, **kw), _randn(i, h, **kw), _randn(h, i, **kw)


def _stacked_weights(
    shape: LayerShape, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """``n`` tenants' weights stacked for bmm: ``[n, H, 3H]``, ``[n, H, H]``, ``[n, H, I]``,
    ``[n, I, H]``."""
    h, i = shape.hidden, shape.intermediate
    kw = {"device": device, "dtype": dtype}
    return (_randn(n, h, 3 * h, **kw), _randn(n, h, h, **kw), _randn(n, h, i, **kw),
            _randn(n, i, h, **kw))


def _single_op(
    weights: tuple[torch.Tensor, ...], shape: LayerShape, seq_len: int, batch: int
) -> Callable[[], None]:
    """One layer's GEMMs + attention for one mini-batch of ``batch`` x ``seq_len`` tokens."""
    h, i, heads, d = shape.hidden, shape.intermediate, shape.heads, shape.head_dim
    tokens = seq_len * batch
    kw = {"device": weights[0].device, "dtype": weights[0].dtype}
    w_qkv, w_o, w_1, w_2 = weights
    x, x_ffn = _randn(tokens, h, **kw), _randn(tokens, i, **kw)
    q, k, v = (_randn(batch, heads, seq_len, d, **kw) for _ in range(3))

    def run() -> None:
        F.linear(x, w_qkv)
        F.scaled_dot_product_attention(q, k, v)
        F.linear(x, w_o)
        F.linear(x, w_1)
        F.linear(x_ffn, w_2)

    return run


def _batched_op(
    stacked: tuple[torch.Tensor, ...], shape: LayerShape, seq_len: int, n: int, batch: int
) -> Callable[[], None]:
    """The same work for ``n`` mini-batches against ``n`` tenants' stacked weights.

    stacked: from :func:`_stacked_weights` for at least ``n`` tenants.
    """
    h, i, heads, d = shape.hidden, shape.intermediate, shape.heads, shape.head_dim
    tokens = seq_len * batch
    kw = {"device": stacked[0].device, "dtype": stacked[0].dtype}
    w_qkv, w_o, w_1, w_2 = (w[:n] for w in stacked)
    x, x_ffn = _randn(n, tokens, h, **kw), _randn(n, tokens, i, **kw)
    q, k, v = (_randn(n * batch, heads, seq_len, d, **kw) for _ in range(3))

    def run() -> None:
        torch.bmm(x, w_qkv)
        F.scaled_dot_product_attention(q, k, v)
        torch.bmm(x, w_o)
        torch.bmm(x, w_1)
        torch.bmm(x_ffn, w_2)

    return run


def place_on_grid(grid: np.ndarray, x: np.ndarray,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Place ``x`` on one grid axis.

    Returns ``(i0, i1, w, scale)``, all shaped like ``x``: x lies between grid[i0] and grid[i1]
    with weight ``w`` on i1 (w is exactly 0 or 1 on a grid point, so grid values are reproduced
    bit-exactly), and ``scale`` >= 1 is the proportional growth beyond the last grid point.
    """
    x = np.asarray(x, dtype=np.float64)
    top = float(grid[-1])
    scale = np.maximum(x / top, 1.0)
    if grid.size == 1:
        zero = np.zeros(x.shape, dtype=np.int64)
        return zero, zero, np.zeros(x.shape), scale
    g = grid.astype(np.float64)
    xc = np.clip(x, g[0], top)
    i0 = np.clip(np.searchsorted(g, xc, side="right") - 1, 0, grid.size - 2)
    w = (xc - g[i0]) / (g[i0 + 1] - g[i0])
    return i0, i0 + 1, w, scale


def interp_grid(table: np.ndarray, axes: list[tuple[np.ndarray, ...]]) -> np.ndarray:
    """Multilinear interpolation of ``table`` (one dimension per axis) at the placed points."""
    out = 0.0
    for corner in itertools.product((0, 1), repeat=len(axes)):
        index = tuple(ax[c] for ax, c in zip(axes, corner))  # ax[0] / ax[1]: lower / upper index
        weight = 1.0
        for ax, c in zip(axes, corner):
            weight = weight * (ax[2] if c else 1.0 - ax[2])
        out = out + weight * table[index]
    scale = 1.0
    for ax in axes:
        scale = scale * ax[3]
    return out * scale


def _as_counts(name: str, x: np.ndarray | int) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be numeric, got dtype {x.dtype}")
    if np.any(x < 1):
        raise ValueError(f"{name} must be >= 1, got min {x.min()}")
    return x


class CostModel:
    """Interpolated per-layer cost tables ``A`` (single GEMM) and ``B`` (batched GEMM), in ms.

    Attributes (read-only numpy arrays):
        lens: ``[L]`` ascending sequence-length grid.
        batches: ``[Bt]`` ascending batch-size grid.
        ns: ``[N]`` ascending batched-group-size grid.
        single_ms: ``[L, Bt]`` table A at the grid points.
        batched_ms: ``[L, N, Bt]`` table B at the grid points.

    Metadata: ``device`` (torch device string), ``dtype`` (e.g. "float32"), ``device_name`` (what
    the cache is keyed on), ``quick``, ``source`` ("profiled", "analytic", ...). Build with
    :meth:`profile`, :meth:`cached`, :meth:`analytic` or :meth:`load`; the constructor takes
    grid tables directly and repairs them to be monotone.
    """

    def __init__(
        self,
        shape: LayerShape,
        lens: Iterable[int],
        batches: Iterable[int],
        ns: Iterable[int],
        single_ms: np.ndarray,
        batched_ms: np.ndarray,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        device_name: str = "",
        quick: bool = False,
        source: str = "profiled",
    ) -> None:
        self.shape = shape
        self.lens, self.batches, self.ns = (self._grid(g, name) for g, name in
                                            ((lens, "lens"), (batches, "batches"), (ns, "ns")))
        self.single_ms = self._table(single_ms, (self.lens.size, self.batches.size), "single_ms")
        self.batched_ms = self._table(
            batched_ms, (self.lens.size, self.ns.size, self.batches.size), "batched_ms"
        )
        self.device, self.dtype, self.device_name = device, dtype, device_name
        self.quick, self.source = quick, source
        self._dense: np.ndarray | None = None

    @staticmethod
    def _grid(values: Iterable[int], name: str) -> np.ndarray:
        grid = np.asarray(list(values), dtype=np.int64)
        if grid.ndim != 1 or grid.size == 0 or grid[0] < 1 or np.any(np.diff(grid) <= 0):
            raise ValueError(f"{name} must be a non-empty strictly ascending grid of ints >= 1")
        grid.flags.writeable = False
        return grid

    @staticmethod
    def _table(values: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
        table = np.array(values, dtype=np.float64)
        if table.shape != shape:
            raise ValueError(f"{name} has shape {table.shape}, the grid needs {shape}")
        if not np.all(np.isfinite(table)) or np.any(table < 0):
            raise ValueError(f"{name} must hold finite non-negative milliseconds")
        # Suffix minimum (see the module docstring for why not a prefix maximum), one axis at a
        # time: each pass keeps the order earlier passes established along the other axes,
        # because the suffix minimum of a pointwise smaller row is pointwise smaller.
        for axis in range(table.ndim):
            flipped = np.flip(table, axis=axis)
            table = np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)
        table.flags.writeable = False
        return table

    # -- queries ------------------------------------------------------------------------------

    def single(self, seq_len: int, batch: int) -> float:
        """A[seq_len][batch]: ms of one layer for one mini-batch with one tenant's weights."""
        return float(self.single_v(np.asarray([seq_len]), np.asarray([batch]))[0])

    def batched(self, seq_len: int, n: int, batch: int) -> float:
        """B[seq_len][n][batch]: ms of one layer for n same-shaped mini-batches as one group."""
        return float(
            self.batched_v(np.asarray([seq_len]), np.asarray([n]), np.asarray([batch]))[0]
        )

    def single_v(self, seq_len: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`single`. seq_len, batch: broadcastable, >= 1. Returns float64 ms."""
        seq_len, batch = np.broadcast_arrays(_as_counts("seq_len", seq_len),
                                             _as_counts("batch", batch))
        axes = [place_on_grid(self.lens, seq_len), place_on_grid(self.batches, batch)]
        return np.asarray(interp_grid(self.single_ms, axes), dtype=np.float64)

    def batched_v(self, seq_len: np.ndarray, n: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`batched`. All arguments broadcastable, >= 1. Returns float64 ms."""
        seq_len, n, batch = np.broadcast_arrays(
            _as_counts("seq_len", seq_len), _as_counts("n", n), _as_counts("batch", batch)
        )
        axes = [place_on_grid(self.lens, seq_len), place_on_grid(self.ns, n),
                place_on_grid(self.batches, batch)]
        return np.asarray(interp_grid(self.batched_ms, axes), dtype=np.float64)

    def single_table(self, max_len: int, max_batch: int) -> np.ndarray:
        """Dense read-only ``T`` with ``T[len, batch] == single(len, batch)``, row/column 0 zero.

        Shape is at least ``[max_len + 1, max_batch + 1]``. The planner indexes it instead of
        interpolating per candidate; it is computed once and regrown (to powers of two, so
        growth is amortised) only when a plan needs a longer sequence or a bigger batch.
        Entries equal :meth:`single` up to a few ulps and are exactly monotone in both axes.
        """
        dense = self._dense
        if dense is None or dense.shape[0] <= max_len or dense.shape[1] <= max_batch:
            rows = 1 << max(max_len, 1, 0 if dense is None else dense.shape[0] - 1).bit_length()
            cols = 1 << max(max_batch, 1, 0 if dense is None else dense.shape[1] - 1).bit_length()
            dense = np.zeros((rows, cols))
            dense[1:, 1:] = self.single_v(np.arange(1, rows)[:, None], np.arange(1, cols)[None, :])
            # Interpolation rounding can leave a neighbour a few ulps below its predecessor; a
            # prefix maximum only moves values by those ulps, as the grid table is monotone.
            dense = np.maximum.accumulate(np.maximum.accumulate(dense, axis=0), axis=1)
            dense.flags.writeable = False
            self._dense = dense
        return dense

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def profile(
        cls,
        shape: LayerShape,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        quick: bool = False,
        max_len: int = 512,
        max_batch: int = 64,
        max_n: int = 8,
        progress: bool = True,
    ) -> CostModel:
        """Measure A and B with real torch ops on ``device``.

        Full grids are 1, 2, 4, ... up to ``max_len`` / ``max_batch`` / ``max_n``; ``quick``
        measures only lens (4, 16, 64), batches (1, 4, 16), n (1, 2, 4) (capped at the maxima)
        with fewer repeats. The largest batched point holds ``max_n * max_batch * max_len``
        tokens of activations -- lower the maxima on small devices and on CPUs.
        """
        dev = torch.device(device)
        if quick:
            lens = _capped_grid(_QUICK_LENS, max_len)
            batches = _capped_grid(_QUICK_BATCHES, max_batch)
            ns = _capped_grid(_QUICK_NS, max_n)
        else:
            lens, batches, ns = _geom_grid(max_len), _geom_grid(max_batch), _geom_grid(max_n)
        timing = _QUICK_TIMING if quick else _FULL_TIMING
        sync = _sync_for(dev)
        single = np.empty((lens.size, batches.size))
        batched = np.empty((lens.size, ns.size, batches.size))
        with torch.inference_mode():
            weights = _single_weights(shape, dev, dtype)
            stacked = _stacked_weights(shape, int(ns[-1]), dev, dtype)
            # The first ops on a device pay one-off costs (thread pool spin-up, CUDA context and
            # cuBLAS handles, SDPA backend choice) that would land on the first grid point.
            for op in (_single_op(weights, shape, int(lens[0]), int(batches[0])),
                       _batched_op(stacked, shape, int(lens[0]), int(ns[-1]), int(batches[0]))):
                for _ in range(3):
                    op()
                sync()
            bar = tqdm(total=single.size + batched.size, desc="profiling cost model",
                       unit="pt", disable=quick or not progress)
            with bar:
                for li, seq_len in enumerate(lens.tolist()):
                    for bi, batch in enumerate(batches.tolist()):
                        single[li, bi] = _measure_ms(
                            _single_op(weights, shape, seq_len, batch), sync, timing
                        )
                        bar.update()
                        for ni, n in enumerate(ns.tolist()):
                            batched[li, ni, bi] = _measure_ms(
                                _batched_op(stacked, shape, seq_len, n, batch), sync, timing
                            )
                            bar.update()
        return cls(shape, lens, batches, ns, single, batched, device=str(dev),
                   dtype=_dtype_name(dtype), device_name=timing_device_name(dev), quick=quick)

    @classmethod
    def analytic(
        cls,
        shape: LayerShape,
        *,
        flops_per_ms: float = 1e10,
        overhead_ms: float = 0.02,
        bmm_efficiency: float = 0.9,
        max_len: int = 512,
        max_batch: int = 64,
        max_n: int = 8,
    ) -> CostModel:
        """Deterministic model for tests: ``overhead_ms + flops / throughput`` on the full grid.

        A batched group pays the overhead once and runs at ``bmm_efficiency`` of the single-GEMM
        throughput.
        """
        if flops_per_ms <= 0 or overhead_ms < 0 or bmm_efficiency <= 0:
            raise ValueError("need flops_per_ms > 0, overhead_ms >= 0, bmm_efficiency > 0")
        lens, batches, ns = _geom_grid(max_len), _geom_grid(max_batch), _geom_grid(max_n)
        flops = shape.flops(lens[:, None], batches[None, :])  # [L, Bt]
        single = overhead_ms + flops / flops_per_ms
        batched = overhead_ms + ns[None, :, None] * flops[:, None, :] / (
            flops_per_ms * bmm_efficiency
        )
        return cls(shape, lens, batches, ns, single, batched, device="cpu", dtype="float32",
                   device_name="analytic", source="analytic")

    # -- persistence --------------------------------------------------------------------------

    def cache_key(self) -> dict:
        """What a cached profile must match to be reused."""
        return {"device_name": self.device_name, "shape": asdict(self.shape),
                "dtype": self.dtype, "quick": self.quick}

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temp file + rename), creating parent folders."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "version": _FORMAT_VERSION,
            **self.cache_key(),
            "device": self.device,
            "source": self.source,
            "lens": self.lens.tolist(),
            "batches": self.batches.tolist(),
            "ns": self.ns.tolist(),
            "single_ms": self.single_ms.tolist(),
            "batched_ms": self.batched_ms.tolist(),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostModel:
        """Read a model written by :meth:`save`. Raises ValueError on a foreign or old file."""
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or doc.get("version") != _FORMAT_VERSION:
            raise ValueError(f"{path}: not a cost model of format version {_FORMAT_VERSION}")
        try:
            return cls(LayerShape(**doc["shape"]), doc["lens"], doc["batches"], doc["ns"],
                       doc["single_ms"], doc["batched_ms"], device=doc["device"],
                       dtype=doc["dtype"], device_name=doc["device_name"], quick=doc["quick"],
                       source=doc["source"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: malformed cost model ({exc!r})") from exc

    @classmethod
    def cached(
        cls,
        shape: LayerShape,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        cache_dir: str | os.PathLike | None = None,
        quick: bool = False,
    ) -> CostModel:
        """Load the profile for (device model, shape, dtype, quick) or measure and store it.

        The folder is ``cache_dir``, else ``$ITIF_CACHE_DIR/costmodel``, else
        ``~/.cache/itif/costmodel`` (the environment is read on each call; the folder keeps the
        module's old name, so profiles cached before the rename stay valid). An unreadable or
        mismatching file is re-profiled and overwritten.
        """
        dev = torch.device(device)
        if cache_dir is None:
            root = os.environ.get("ITIF_CACHE_DIR") or Path.home() / ".cache" / "itif"
            cache_dir = Path(root) / "costmodel"
        key = {"device_name": timing_device_name(dev), "shape": asdict(shape),
               "dtype": _dtype_name(dtype), "quick": quick}
        stem = (f"{key['device_name']}-h{shape.hidden}-i{shape.intermediate}-a{shape.heads}"
                f"-{key['dtype']}-{'quick' if quick else 'full'}")
        path = Path(cache_dir) / (re.sub(r"[^A-Za-z0-9._-]+", "_", stem) + ".json")
        try:
            model = cls.load(path)
            if model.cache_key() == key:
                return model
        except (OSError, ValueError):
            pass  # missing, unreadable or foreign: measure afresh
        model = cls.profile(shape, device=dev, dtype=dtype, quick=quick)
        model.save(path)
        return model

    # -- validation ---------------------------------------------------------------------------

    def report(self, samples: Iterable[tuple[int, int]]) -> list[dict]:
        """Re-measure A at ``(seq_len, batch)`` points on this model's device and dtype.

        Returns one row per sample: ``{"seq_len", "batch", "predicted_ms", "measured_ms",
        "rel_err"}`` with ``rel_err = (predicted - measured) / measured`` (positive: the model
        overestimates).
        """
        dev, dtype = torch.device(self.device), _torch_dtype(self.dtype)
        timing = _QUICK_TIMING if self.quick else _FULL_TIMING
        sync = _sync_for(dev)
        rows = []
        with torch.inference_mode():
            weights = _single_weights(self.shape, dev, dtype)
            for seq_len, batch in samples:
                seq_len, batch = int(seq_len), int(batch)
                measured = _measure_ms(_single_op(weights, self.shape, seq_len, batch), sync,
                                       timing)
                predicted = self.single(seq_len, batch)
                rows.append({"seq_len": seq_len, "batch": batch, "predicted_ms": predicted,
                             "measured_ms": measured,
                             "rel_err": (predicted - measured) / measured})
        return rows
