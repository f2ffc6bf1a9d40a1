"""The CPU's many-rows linear: oneDNN matmuls with the bias, activation or residual fused in.

Issue 65: on the 2-core AMD EPYC (AVX-512, AVX512-BF16) these sessions run on, vLLM's CPU build
classifies short requests with a BERT faster than itif did, with the same model and the same
FLOPs. vLLM's CPU ``Linear`` is a oneDNN matmul with the bias in the same primitive
(``ops.onednn_mm``); itif ran MKL's ``mm`` and then one more pass over the output for the
bias, one for the activation and, before LayerNorm, one for the residual. PyTorch ships the
same oneDNN primitive as ``torch.ops.mkldnn._linear_pointwise`` (the op Inductor's CPU freezing
fuses linears into): the bias, an activation (GELU erf or tanh, ReLU, SiLU, tanh) or a residual
add ride on the matmul's output tile while it is still in cache, computed in float32 on the
accumulator and rounded once to the storage type.

Measured on that machine (interleaved, best of 6, 13,591 rows, 2 threads): [256 -> 768]
float32 ``addmm`` 64 ms, oneDNN 55; + GELU 88 against 72; [512 -> 256] + residual 64 against
40; bfloat16 ``addmm`` + GELU 48 against 32 (oneDNN's native AVX512-BF16 kernels; MKL's bf16
``addmm`` is slower). Handing oneDNN the plain ``[N, K]`` weight costs the same as a weight
reordered ahead (``_reorder_linear_weight``) at these row counts, so weights are read in place
from the store's buffers, as every other backend reads them: nothing to keep in sync when a
tenant's weights change.

:func:`usable` says when a product goes here: a CPU tensor in float32 or bfloat16 (bfloat16
only where oneDNN has native kernels for it), PyTorch built with oneDNN, segments long enough
that one primitive call per segment beats MKL (:data:`MIN_ROWS` rows on average; shorter ones,
decode steps, stay with ``run_gemm`` and the few-rows kernel of ``itif.runtime.cpu_gemm``) and
at most :data:`MAX_SEGMENTS` of them. ``ITIF_CPU_ONEDNN=0`` turns it off.

Every segment in one parallel region (``kernels/seg_linear_cpu.cpp``, built once like the other
C++ kernels, ``ITIF_CPU_SEG_LINEAR=0`` turns it off): one oneDNN call per segment, then
``torch.cat``, then (before LayerNorm) a ``layer_norm`` per segment and another ``cat`` made an
8-tenant forward run 3-4 OpenMP regions a segment where one tenant ran one a product, and on
this machine's 2 shared vCPUs each region's closing barrier waits for a thread the host has
parked. The kernel cuts every segment in chunks of about :data:`CHUNK` rows that the threads
take as they come (a thread the host holds up leaves its chunks to the other), runs the same
oneDNN primitive on each chunk single-threaded, LayerNorm on it while it is in cache where one
follows (the residual LayerNorms of a post-LN encoder), and writes it in place: no
concatenation. The answers are the same to the bit (the same primitive on the same rows).
Measured, 13,040 rows [256 -> 768] + residual + LayerNorm, float32, 2 threads, load 3 (another
engineer's test suite on the same cores), median of 9 (``bench/cpu_peer_forward.py`` shows the
whole forward): 8 segments 259 ms per segment + cat against 68 ms here; one segment 67
against 68. One segment longer than :data:`CHUNK` stays one multi-threaded oneDNN call (it is one
region already, and measured up to 15% faster than its chunks in bfloat16 on a quiet machine).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from itif.platform import ThreadSwitch
from itif.runtime import cpu_gemm

log = logging.getLogger("itif.runtime")

__all__ = ["ACTS", "CHUNK", "MAX_SEGMENTS", "MIN_ROWS", "enabled", "ensure", "ensure_for",
           "layer_norm", "linear", "norm_args", "seg_state", "seg_suspended", "usable"]

#: Average rows a segment needs before a product goes to oneDNN (below this a call's fixed
#: cost shows and decode-sized products have their own kernel, ``cpu_gemm``). 64 made the
#: serving path's forwards 1.5x dearer (bench/frontend_cost.py at 600 req/s, bert-tiny x16,
#: segments of 64-300 rows: 932-1018 us a request against 634-652 without oneDNN); at 512
#: they are at par (625 against 671) and the offline peer workload keeps its gain
#: (segments of 1,600-13,000 rows: itif one model 1.92x HF with oneDNN, 1.41x without).
MIN_ROWS = 512
#: At most this many segments (one primitive call each; more go to ``run_gemm``'s backends).
MAX_SEGMENTS = 64
#: Rows a chunk of the one-region kernel takes at most (segments are cut in equal pieces of at
#: most this many). Same benchmark as the module docstring's, 8 segments: 128 rows 72 ms, 256
#: 68, 512 73 (fewer chunks balance the two threads worse; more pay oneDNN's call more often).
CHUNK = 256
#: One segment of this many rows up to :data:`CHUNK` also goes to the one-region kernel: one
#: chunk, run on the calling thread alone (from CHUNK + 1 to MIN_ROWS - 1 rows it stays off
#: oneDNN). A 1-tenant classifier's last layer (its [CLS] rows only, 256 in the peer workload)
#: otherwise ran MKL's product and four passes of under 1 ms of work each, every one waking the
#: second OpenMP thread: under load (another engineer's suite on the 2 vCPUs) 8-16 ms each, 150
#: of 890 ms of the forward (torch.profiler).
ONE_CHUNK_MIN_ROWS = 128

#: itif's activation names -> oneDNN's post-op (attr, algorithm) as ``_linear_pointwise`` takes
#: them; an activation not listed runs after the product (``ops.bias_act``).
ACTS = {
    "none": ("none", ""),
    "gelu": ("gelu", "none"),  # erf, as HF's "gelu"
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "tanh": ("tanh", ""),
}

_state: dict = {}
_switch = ThreadSwitch()
#: ``with suspended():`` this thread's products stay off oneDNN (as ``cpu_gemm.suspended``: the
#: cost model's calibration and its tests price MKL's backends, which it knows).
suspended = _switch.suspended

_seg_lock = threading.Lock()
_seg_switch = ThreadSwitch()
seg_state: dict = {"module": None, "why_not": None, "build_s": None}
#: ``with seg_suspended():`` this thread's products go per segment and are concatenated, as
#: before the one-region kernel (``bench/cpu_peer_forward.py --off seglinear`` compares them).
seg_suspended = _seg_switch.suspended


def ensure() -> bool:
    """Build (or load) the one-region kernel now if this process may use it; True if usable."""
    return cpu_gemm.ensure_kernel(seg_state, _seg_lock, "ITIF_CPU_SEG_LINEAR",
                                  "itif_seg_linear_cpu", "seg_linear_cpu.cpp",
                                  "the CPU one-region segment linear",
                                  "a oneDNN call per segment, then a concatenation")


def ensure_for(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`ensure` for an engine on ``device`` in ``dtype``, built when the engine starts (not
    mid-run) where its products can come here; False (nothing built) otherwise."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and enabled(dtype) and ensure())


def _one_region(plan=None) -> bool:
    """The kernel is built and not suspended (and, given a plan, runs it: several segments, or
    one of at most :data:`CHUNK` rows. One longer segment stays one multi-threaded oneDNN
    call: on a quiet machine that measured 5-15% faster than its chunks, 13,040 rows [256 ->
    768], float32 and bfloat16, and it is already one region)."""
    if seg_state["module"] is None or _seg_switch.off:
        return False
    return plan is None or len(plan.segs) > 1 or plan.rows <= CHUNK


def norm_args(plan, gamma, beta, dtype: torch.dtype):
    """LayerNorm's parameters as :func:`linear` takes them, ``(gamma buffer, its slot per
    segment, beta buffer, its slots)``, when the one-region kernel can apply it after the
    product of ``plan`` (gamma and beta ``RotParam`` s whose segments are the product's, 2-D
    buffers in ``dtype``); None otherwise (the caller runs LayerNorm after the product)."""
    if not _one_region(plan):
        return None
    pg, pb = gamma.plan, beta.plan
    if (pg is None or pb is None or gamma.buf.dim() != 2 or beta.buf.dim() != 2
            or gamma.buf.dtype != dtype or beta.buf.dtype != dtype):
        return None
    segs = plan.segs
    for p, buf in ((pg, gamma.buf), (pb, beta.buf)):
        if (p.segs.start, p.segs.end) != (segs.start, segs.end) or max(p.segs.slot) >= len(buf):
            return None
    return gamma.buf, pg.segs.slot, beta.buf, pb.segs.slot


def enabled(dtype: torch.dtype) -> bool:
    """oneDNN can run CPU products in ``dtype`` here (checked once per dtype)."""
    ok = _state.get(dtype)
    if ok is None:
        ok = (os.environ.get("ITIF_CPU_ONEDNN", "1") != "0"
              and torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_linear_pointwise")
              and (dtype == torch.float32
                   or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))
        _state[dtype] = ok
        if dtype == torch.bfloat16:  # issue 65: say what bfloat16 products run on
            log.info("CPU bfloat16 products: %s", "oneDNN (native AVX512-BF16 / AMX kernels)"
                     if ok else "MKL / PyTorch (no native oneDNN bfloat16 here, or "
                     "ITIF_CPU_ONEDNN=0)")
    return ok


def usable(x: torch.Tensor, w: torch.Tensor, plan) -> bool:
    """Whether the product of ``x`` [rows, K] with the weight buffer ``w`` [capacity, N, K]
    over ``plan``'s segments goes to oneDNN (see the module docstring)."""
    n = len(plan.segs)
    one_chunk = n == 1 and ONE_CHUNK_MIN_ROWS <= plan.rows <= CHUNK and _one_region(plan)
    return (x.device.type == "cpu" and x.dtype == w.dtype and enabled(x.dtype)
            and not _switch.off
            and 0 < n <= MAX_SEGMENTS and (plan.rows >= MIN_ROWS * n or one_chunk)
            and x.is_contiguous() and w.is_contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, plan, bias: torch.Tensor | None = None,
           bias_slots=None, act: str = "none", residual: torch.Tensor | None = None,
           norm=None, eps: float = 1e-12) -> torch.Tensor:
    """``act(x[s:e] @ w[slot].T + bias[bias_slot]) (+ residual[s:e])`` for every segment
    ``(s, e, slot)`` of ``plan``, a new [rows, N] tensor; with ``norm`` (:func:`norm_args`: only
    where the one-region kernel runs) then LayerNorm with those parameters and ``eps``.

    ``bias_slots``: the bias slot of each segment (None: the weight's slots). ``residual`` only
    with ``act`` "none" (the residual add is oneDNN's binary post-op). ``act`` must be in
    :data:`ACTS`. Every segment in one parallel region where the kernel is built (see the module
    docstring); else one primitive call per segment, several segments' outputs concatenated.
    """
    attr, algo = ACTS[act]
    if residual is not None and attr != "none":
        raise ValueError(f"a residual add cannot follow the activation {act!r} in one call")
    segs = plan.segs
    bslots = segs.slot if bias_slots is None else bias_slots
    if _one_region(plan):
        g, gs, b_, bs = norm if norm is not None else (None, (), None, ())
        return seg_state["module"].seg_linear(
            x, w, list(segs.start), list(segs.end), list(segs.slot), bias, list(bslots), attr,
            algo, residual, g, b_, list(gs), list(bs), float(eps), CHUNK)
    if norm is not None:
        raise ValueError("LayerNorm inside the product needs the one-region kernel (norm_args)")
    outs = []
    for s, e, k, bk in zip(segs.start, segs.end, segs.slot, bslots):
        xi = x if len(segs) == 1 else x[s:e]
        b = None if bias is None else bias[bk]
        if residual is not None:
            r = residual if len(segs) == 1 else residual[s:e]
            outs.append(torch.ops.mkldnn._linear_pointwise.binary(xi, r, w[k], b, "add"))
        else:
            outs.append(torch.ops.mkldnn._linear_pointwise(xi, w[k], b, attr, [], algo))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def layer_norm(x: torch.Tensor, plan, norm, eps: float) -> torch.Tensor:
    """LayerNorm of each segment of ``plan`` over ``x`` [rows, H] with ``norm``'s parameters
    (:func:`norm_args`, so only where the one-region kernel runs), in one parallel region, a
    new tensor: a text encoder's embedding LayerNorm, otherwise a call per segment and a
    concatenation (``reference._layernorm_segments``)."""
    g, gs, b, bs = norm
    segs = plan.segs
    return seg_state["module"].seg_layer_norm(x, list(segs.start), list(segs.end), g, b,
                                              list(gs), list(bs), float(eps), CHUNK)
