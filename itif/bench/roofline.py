"""Roofline lower bound of a fused forward: max(FLOPs / peak FLOP/s, weight bytes / bandwidth).

Peaks come from the vendors' public spec sheets for known GPUs (dense, no sparsity; the tensor
core figure for float16/bfloat16, TF32 for float32 when torch allows TF32 matmuls, the FP32
figure otherwise), and are measured for the CPU and for GPUs not in the table (a large matmul
for FLOP/s, a large tensor copy for bandwidth). Every peak says which it is (``source``).

FLOPs count the work the requests need (no padding): per request of L rows and per layer,
2*L*H*(4H + 2I) for the four GEMMs and 4*L^2*H for attention (QK^T and PV), plus the ALBERT
embedding projection or the ViT patch projection, the pooler and the head. Bytes count every
distinct weight tensor the batch reads once (shared tensors once; embedding tables only by the
rows gathered), a lower bound: ALBERT reads its one layer set 24 times, which caches may or
may not absorb.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from itif.backbones.spec import BackboneSpec

# (pattern on torch.cuda.get_device_name, label, TFLOP/s fp16/bf16 tensor, tf32 tensor, fp32,
#  TB/s). Dense figures: the spec sheets' sparse figures halved.
GPU_PEAKS: tuple[tuple[str, str, float, float, float, float], ...] = (
    (r"H200 NVL", "NVIDIA H200 NVL", 835.5, 417.5, 60.0, 4.8),
    (r"H200", "NVIDIA H200 SXM", 989.4, 494.7, 66.9, 4.8),
    (r"H100.*NVL", "NVIDIA H100 NVL", 835.5, 417.5, 60.0, 3.9),
    (r"H100.*PCIe", "NVIDIA H100 PCIe", 756.5, 378.0, 51.2, 2.0),
    (r"H100", "NVIDIA H100 SXM", 989.4, 494.7, 66.9, 3.35),
    (r"A100.*(80GB.*PCIe|PCIE.*80GB)", "NVIDIA A100 80GB PCIe", 312.0, 156.0, 19.5, 1.935),
    (r"A100.*80GB", "NVIDIA A100 80GB SXM", 312.0, 156.0, 19.5, 2.039),
    (r"A100", "NVIDIA A100 40GB", 312.0, 156.0, 19.5, 1.555),
    (r"RTX A5000", "NVIDIA RTX A5000", 111.1, 55.6, 27.8, 0.768),
)

_GATHERED = ("emb.word", "emb.pos", "emb.type")  # read by the rows gathered, not whole


@dataclass(frozen=True)
class Peak:
    device: str
    flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    source: str  # "spec sheet: ..." or "measured: ..."

    def as_dict(self) -> dict:
        return asdict(self)


def spec_sheet_peak(name: str, dtype: torch.dtype) -> Peak | None:
    """The table's peak for a GPU name, or None when the GPU is not in the table."""
    for pattern, label, f16, tf32, f32, tbs in GPU_PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            if dtype in (torch.float16, torch.bfloat16):
                tf, kind = f16, "fp16/bf16 tensor core, dense"
            elif torch.backends.cuda.matmul.allow_tf32:
                tf, kind = tf32, "TF32 tensor core, dense"
            else:
                tf, kind = f32, "FP32"
            return Peak(name, tf * 1e12, tbs * 1e12,
                        f"spec sheet: {label}, {tf:g} TFLOP/s {kind}, {tbs:g} TB/s")
    return None


def _best_s(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


#: the longest one matmul of the measured peak may take: where a dtype's matmuls are emulated
#: (bfloat16 on a CPU without AVX512-BF16 or AMX, ~0.3 GFLOP/s) a 2048^3 one takes a minute
MM_BUDGET_S = 0.5
_PROBE_N = 256


def _mm_side(target: int, dtype: torch.dtype, device: torch.device, sync) -> int:
    """``target``, or less (a multiple of :data:`_PROBE_N`) when a ``target``-sided matmul
    would take over :data:`MM_BUDGET_S` at the rate a warm ``_PROBE_N``-sided one runs."""
    ab = [torch.randn(_PROBE_N, _PROBE_N, device=device).to(dtype) for _ in range(2)]
    rate = 2 * _PROBE_N**3 / _best_s(lambda: torch.mm(*ab), 1, sync)
    fits = int((MM_BUDGET_S * rate / 2) ** (1 / 3)) // _PROBE_N * _PROBE_N
    return max(_PROBE_N, min(target, fits))


def measure_peak(device: torch.device, dtype: torch.dtype, quick: bool = False) -> Peak:
    """Measured peak: best of a few ``n x n`` matmuls (``n`` as large as
    :data:`MM_BUDGET_S` allows) and a large copy (read + write)."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    n = _mm_side((4096 if quick else 8192) if cuda else (768 if quick else 2048),
                 dtype, device, sync)
    ab = [torch.randn(n, n, device=device).to(dtype) for _ in range(2)]
    s = _best_s(lambda: torch.mm(*ab), 3 if quick else 5, sync)
    flops = 2 * n**3 / s
    ab.clear()
    numel = (1 << 26 if quick else 1 << 28) if cuda else (1 << 22 if quick else 1 << 26)
    x = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    s = _best_s(lambda: y.copy_(x), 3 if quick else 5, sync)
    bw = 2 * x.numel() * x.element_size() / s
    from itif.platform import device_name  # noqa: PLC0415

    return Peak(device_name(device), flops, bw,
                f"measured: torch.mm {n}x{n} {str(dtype).removeprefix('torch.')} "
                f"{flops / 1e9:.0f} GFLOP/s, copy {x.numel() * 4 >> 20} MiB {bw / 1e9:.1f} GB/s")


_COPY_BW: dict[tuple[str, int], tuple[float, str]] = {}
COPY_BYTES_CUDA = 2 << 30  # one 2 GiB tensor copied into another (4 GiB of device memory)
COPY_BYTES_CPU = 256 << 20
COPY_BYTES_CPU_QUICK = 64 << 20


def copy_bandwidth(device: torch.device, nbytes: int | None = None,
                   repeats: int = 5) -> tuple[float, str]:
    """Measured device-to-device copy bandwidth (bytes read + written per second, best of
    ``repeats`` copies of one ``nbytes`` tensor into another) and how it was measured; cached per
    process and device. The spec sheet's figure is a peak no copy reaches; this is the rate a
    weight-streaming forward can actually hope for."""
    cuda = device.type == "cuda"
    if nbytes is None:
        nbytes = COPY_BYTES_CUDA if cuda else COPY_BYTES_CPU
    key = (str(device), int(nbytes))
    if key in _COPY_BW:
        return _COPY_BW[key]
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    s = _best_s(lambda: y.copy_(x), repeats, sync)
    bw = 2 * x.numel() * 4 / s
    x = y = None  # free the buffers (the timed lambda still names them: no del)
    if cuda:
        torch.cuda.empty_cache()
    src = (f"measured: copy of {nbytes / 2**30:g} GiB on {device}, best of {repeats}, "
           f"{bw / 1e9:.1f} GB/s read+written")
    _COPY_BW[key] = (bw, src)
    return bw, src


def weight_bound(weight_bytes: int, latency_ms: float, bandwidth: float) -> dict:
    """Time to stream the forward's distinct weights once at the measured copy bandwidth, and
    the share of the measured latency it is (1.0: the run is as fast as reading its weights)."""
    ms = weight_bytes / bandwidth * 1e3
    return dict(weight_bound_ms=round(ms, 4),
                weight_bound_fraction=round(ms / latency_ms, 4) if latency_ms > 0 else None)


def device_peak(device: torch.device, dtype: torch.dtype, quick: bool = False) -> Peak:
    if device.type == "cuda":
        peak = spec_sheet_peak(torch.cuda.get_device_name(device), dtype)
        if peak is not None:
            return peak
    return measure_peak(device, dtype, quick)


def forward_flops(spec: BackboneSpec, lengths, num_labels: int = 2) -> float:
    """FLOPs of one forward over requests of ``lengths`` rows each (no padding)."""
    L = np.asarray(lengths, dtype=np.float64)
    H, I = spec.hidden, spec.intermediate  # noqa: E741 (I: the intermediate width, as in the papers)
    per_layer = 2.0 * L.sum() * H * (4 * H + 2 * I) + 4.0 * (L**2).sum() * H
    total = spec.layers * per_layer
    if spec.family == "albert":
        total += 2.0 * L.sum() * spec.emb_width * H
    if spec.family == "vit":
        total += 2.0 * (L - 1).sum() * spec.num_channels * spec.patch_size**2 * H
    total += L.size * (2.0 * H * H * spec.is_text + 2.0 * H * num_labels)
    return float(total)


def batch_weight_bytes(engine, tenants, tokens: int) -> int:
    """Distinct weight bytes a batch of ``tenants`` reads on ``engine`` (shared slots once)."""
    view = engine.store.view
    seen = set()
    total = 0
    elem = torch.empty((), dtype=engine.dtype).element_size()
    for t in tenants:
        for name, (kind, slot) in view.tenants[t].slots.items():
            if (kind, slot) in seen:
                continue
            seen.add((kind, slot))
            shape = kind[1]
            if name in _GATHERED:
                total += min(tokens, shape[0]) * int(np.prod(shape[1:])) * elem
            else:
                total += int(np.prod(shape)) * elem
    return total


def roofline(flops: float, weight_bytes: int, measured_ms: float, peak: Peak) -> dict:
    """The bound (ms), what bounds it, and the fraction of it the measurement achieves."""
    compute_ms = flops / peak.flops * 1e3
    memory_ms = weight_bytes / peak.bandwidth * 1e3
    bound = max(compute_ms, memory_ms)
    return dict(flops=flops, weight_bytes=int(weight_bytes), bound_ms=round(bound, 4),
                bound_by="compute" if compute_ms >= memory_ms else "memory",
                achieved_tflops=round(flops / (measured_ms / 1e3) / 1e12, 4),
                roofline_fraction=round(bound / measured_ms, 4) if measured_ms > 0 else None)
