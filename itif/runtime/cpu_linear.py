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
"""

from __future__ import annotations

import logging
import os

import torch

from itif.platform import ThreadSwitch

log = logging.getLogger("itif.runtime")

__all__ = ["ACTS", "MAX_SEGMENTS", "MIN_ROWS", "enabled", "linear", "usable"]

#: Average rows a segment needs before a product goes to oneDNN (below this a call's fixed
#: cost shows and decode-sized products have their own kernel, ``cpu_gemm``). 64 made the
#: serving path's forwards 1.5x dearer (bench/frontend_cost.py at 600 req/s, bert-tiny x16,
#: segments of 64-300 rows: 932-1018 us a request against 634-652 without oneDNN); at 512
#: they are at par (625 against 671) and the offline peer workload keeps its gain
#: (segments of 1,600-13,000 rows: itif one model 1.92x HF with oneDNN, 1.41x without).
MIN_ROWS = 512
#: At most this many segments (one primitive call each; more go to ``run_gemm``'s backends).
MAX_SEGMENTS = 64

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
    return (x.device.type == "cpu" and x.dtype == w.dtype and enabled(x.dtype)
            and not _switch.off
            and 0 < n <= MAX_SEGMENTS and plan.rows >= MIN_ROWS * n
            and x.is_contiguous() and w.is_contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, plan, bias: torch.Tensor | None = None,
           bias_slots=None, act: str = "none", residual: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``act(x[s:e] @ w[slot].T + bias[bias_slot]) (+ residual[s:e])`` for every segment
    ``(s, e, slot)`` of ``plan``, a new [rows, N] tensor.

    ``bias_slots``: the bias slot of each segment (None: the weight's slots). ``residual`` only
    with ``act`` "none" (the residual add is oneDNN's binary post-op). ``act`` must be in
    :data:`ACTS`. One primitive call per segment; several segments' outputs are concatenated.
    """
    attr, algo = ACTS[act]
    if residual is not None and attr != "none":
        raise ValueError(f"a residual add cannot follow the activation {act!r} in one call")
    segs = plan.segs
    bslots = segs.slot if bias_slots is None else bias_slots
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
