"""The CPU's variable-length attention (``kernels/varlen_attn_cpu.cpp``): one call a layer.

Issue 65: torch's CPU attention runs a batch of short requests of many lengths as length
groups (``itif.ops.reference.attention``): each group gathered into a padded block, masked,
through PyTorch's CPU flash-attention kernel, and scattered back. On the peer workload (256
requests of 2-100 tokens: 17 groups, 13,591 rows, BERT hidden 256, 4 heads) that was about
half of the forward, though attention is about 6% of its FLOPs. The kernel here reads each
sequence's rows in place over the batch's boundaries (``PreparedBatch.varlen_L``, "varlen.cu",
the same boundaries a GPU's variable-length kernel takes), with no gather, padding or mask, one
task per (sequence, head) spread dynamically over the threads.

The forward (``itif.runtime.forward._encode_cpu``) sends a layer here when the batch has
boundaries (several attention groups), qkv is float32 or bfloat16 and the kernel loaded; else
``itif.ops.dispatch.attention`` runs the groups as before. The kernel is built like
``itif.runtime.cpu_gemm``'s (``cpu_gemm.load_kernel``: about 30 s the first time in an
environment, cached after); :func:`ensure` builds it synchronously when an engine starts, so a
forward never changes attention path halfway. Without a compiler, without AVX2/FMA, or with
``ITIF_CPU_ATTENTION=0``, the groups run (the reason is logged once and kept in :data:`state`).
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from itif.platform import ThreadSwitch
from itif.runtime import cpu_gemm

log = logging.getLogger("itif.runtime")

__all__ = ["DTYPES", "MIN_ROWS", "applies", "attention", "ensure", "ensure_for", "state",
           "suspended"]

#: The dtypes the kernel takes (it computes in float32 and rounds the output once).
DTYPES = (torch.float32, torch.bfloat16)
#: Rows (tokens) a batch needs before its attention runs here. Serving batches are smaller and
#: the length groups' flash attention is cheaper on them (bert-tiny x16, ``Engine.infer`` of
#: 2-6 requests of 2-100 tokens, one torch thread: 1014-1092 us a request with this kernel,
#: 823-898 without; 20 and 40 requests: 20-40% dearer; 80 on two threads: 7% dearer); the
#: offline peer workload (256 requests, 13,000 rows) is where it wins (issue 65: 1.8x).
MIN_ROWS = 8192

_lock = threading.Lock()
_switch = ThreadSwitch()
state: dict = {"module": None, "why_not": None, "build_s": None}
#: ``with suspended():`` this thread's layers run the length groups (``ops.attention``), as
#: before this kernel: for comparisons and for tests of the group path.
suspended = _switch.suspended


def ensure() -> bool:
    """Build (or load) the kernel now if this process may use it; True when it is usable."""
    return cpu_gemm.ensure_kernel(state, _lock, "ITIF_CPU_ATTENTION", "itif_varlen_attn_cpu",
                                  "varlen_attn_cpu.cpp",
                                  "the CPU variable-length attention kernel",
                                  "attention runs by length groups")


def ensure_for(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`ensure` for an engine on ``device`` in ``dtype``: built now (not mid-run) when its
    layers can come here; False (nothing built) otherwise."""
    return torch.device(device).type == "cpu" and dtype in DTYPES and ensure()


def applies(qkv: torch.Tensor) -> bool:
    """Whether a layer with this ``qkv`` (and boundaries) runs here."""
    return (state["module"] is not None and not _switch.off and qkv.device.type == "cpu"
            and qkv.dtype in DTYPES and qkv.is_contiguous() and qkv.shape[0] >= MIN_ROWS)


def attention(qkv: torch.Tensor, cu: torch.Tensor, heads: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Self-attention of every sequence ``[cu[s], cu[s+1])`` within itself: ``qkv`` [T, 3H]
    (Q, K, V side by side, bias added), ``cu`` the ascending boundaries (any integer dtype);
    returns ``out`` [T, H] (new if None), rows outside every sequence left as they were.
    Scale ``1/sqrt(d)``, no mask (a sequence is its rows, padding runs are sequences of their
    own), as ``itif.ops.reference.attention`` over the same sequences."""
    T, H3 = qkv.shape
    H = H3 // 3
    if out is None:
        out = torch.zeros(T, H, dtype=qkv.dtype)
    state["module"].varlen_attention(qkv, cu.to(torch.int64).contiguous(), heads,
                                     1.0 / math.sqrt(H // heads), out)
    return out
