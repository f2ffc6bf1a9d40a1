"""LoRA in the fused forward: the low-rank update of the rows whose tenant has an adapter.

A linear layer's base product runs once over every row (``run_gemm``; tenants on one base share
its slot, so that is one GEMM for all of them). Then, for each adapter shape of that layer
present in the batch (tenants of one rank share a weight kind), the rows of the tenants that
have one are gathered, multiplied by their tenant's ``A`` and then ``B`` (two planned grouped
products over the gathered rows, one segment per tenant: Punica's SGMV, on the same GEMM
backends as the base) and added back in place. No loop over tenants; on the host, everything is
decided when the batch is prepared (``lora_tables`` once per tenant set, ``plan_lora`` per
batch structure), so the forward stays free of host reads and capturable in a CUDA graph.

Weights: ``layers.{i}.{kind}.lora_a`` ``[R, in]`` and ``.lora_b`` ``[out, R]`` (the scale folded
into ``B``), see ``itif.backbones.lora_tenants``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from itif.runtime.gemm import GemmPlan, plan_gemm, run_gemm, segments_for, tenant_runs

__all__ = ["LoraGroup", "apply_lora", "lora_tables", "plan_lora"]


@dataclass(frozen=True)
class LoraTable:
    """Tenants of a batch with one adapter kind on one linear: member mask and slots."""

    a_kind: object
    b_kind: object
    member: np.ndarray  # [n_tenants] bool
    a_slot: np.ndarray  # [n_tenants] int64 (0 for non-members: never read)
    b_slot: np.ndarray


@dataclass(frozen=True)
class LoraGroup:
    """One adapter kind of one linear in a prepared batch: the packed names of its gathered
    rows (``{name}.rows``) and grouped offsets, and the plans of its two products."""

    name: str
    a_kind: object
    b_kind: object
    plan_a: GemmPlan
    plan_b: GemmPlan


def lora_tables(entries) -> dict[str, tuple[LoraTable, ...]]:
    """Per linear weight name (``layers.{i}.{kind}.weight``): the adapter kinds of a batch's
    tenants (store entries in batch-tenant order). One pass over the tenants; cache it."""
    n = len(entries)
    found: dict[tuple[str, object, object], list[tuple[int, int, int]]] = {}
    for t, e in enumerate(entries):
        for name, (a_kind, a_slot) in e.slots.items():
            if name.endswith(".lora_a"):
                stem = name[: -len(".lora_a")]
                b_kind, b_slot = e.slots[stem + ".lora_b"]
                found.setdefault((stem, a_kind, b_kind), []).append((t, a_slot, b_slot))
    out: dict[str, list[LoraTable]] = {}
    for (stem, a_kind, b_kind), members in found.items():
        member = np.zeros(n, bool)
        a_slot = np.zeros(n, np.int64)
        b_slot = np.zeros(n, np.int64)
        for t, sa, sb in members:
            member[t], a_slot[t], b_slot[t] = True, sa, sb
        out.setdefault(stem + ".weight", []).append(LoraTable(a_kind, b_kind, member, a_slot,
                                                              b_slot))
    return {k: tuple(v) for k, v in out.items()}


def plan_lora(tables: dict[str, tuple[LoraTable, ...]], row_tenant: np.ndarray, pk, device,
              dtype) -> dict[str, tuple[LoraGroup, ...]]:
    """Plans of a batch's LoRA products; packs each group's row indices (and grouped-mm
    offsets) into ``pk``."""
    out: dict[str, tuple[LoraGroup, ...]] = {}
    for weight, kinds in tables.items():
        groups = []
        for tab in kinds:
            rows = np.flatnonzero(tab.member[row_tenant])
            if rows.size == 0:
                continue
            runs = tenant_runs(row_tenant[rows])
            plan_a = plan_gemm(segments_for(runs, tab.a_slot), rows.size, device, dtype)
            plan_b = plan_gemm(segments_for(runs, tab.b_slot), rows.size, device, dtype)
            name = f"lora{len(pk.slices)}"
            pk.add(name + ".rows", rows)
            for which, plan in (("a", plan_a), ("b", plan_b)):
                if plan.backend == "grouped_mm":
                    pk.add(f"{name}.offs_{which}", plan.offs)
            groups.append(LoraGroup(name, tab.a_kind, tab.b_kind, plan_a, plan_b))
        if groups:
            out[weight] = tuple(groups)
    return out


def apply_lora(y: torch.Tensor, x: torch.Tensor, groups: tuple[LoraGroup, ...], buffers, get,
               offs) -> torch.Tensor:
    """Each adapted row's low-rank update, added in place: Punica's SGMV, as two planned
    grouped products (``run_gemm``) over the rows gathered per group.

    Semantics:
        y[t, n] += sum_r (sum_k x[t, k] A[a_slot(t), r, k]) B[b_slot(t), n, r]

    for every row t of every group (``{g.name}.rows``), where A and B are the group's kind
    buffers and ``a_slot(t)``, ``b_slot(t)`` the slots of row t's tenant (``plan_a.segs``,
    ``plan_b.segs``; the scale is folded into B). Other rows are left as they are. Returns y.

    Args:
        y: Shape: [T, N], the base product. DType: float. Written in place and returned.
        x: Shape: [T, K], the base product's input. DType: y's. Read only.
        groups: Type: tuple of ``LoraGroup`` (``plan_lora``), one per adapter kind present.
        buffers: Type: mapping kind -> buffer, the store view's: A [C, R, K] and B [C, N, R]
            in y's dtype (read only).
        get: Type: callable, packed name -> device tensor (``{name}.rows``: [rows] int64).
        offs: Type: callable, packed name -> its int32 form (grouped_mm plans' offsets).
    """
    for g in groups:
        rows = get(g.name + ".rows")
        xs = x.index_select(0, rows)
        oa = offs(g.name + ".offs_a") if g.plan_a.backend == "grouped_mm" else None
        h = run_gemm(xs, buffers[g.a_kind], g.plan_a, oa)
        ob = offs(g.name + ".offs_b") if g.plan_b.backend == "grouped_mm" else None
        y.index_add_(0, rows, run_gemm(h, buffers[g.b_kind], g.plan_b, ob))
    return y
