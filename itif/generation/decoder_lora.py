"""PEFT LoRA adapters on a decoder's base tenant: read, checked, stacked, and applied to the
rows of many adapters in one grouped product per projection.

A LoRA tenant is a stored base tenant (a full or int8-delta tenant of the GenEngine) plus an
adapter: ``y = x W^T + b + s (x A^T) B^T`` on the linears it adapts, with ``A [r, in]``,
``B [out, r]`` and ``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``; ``alpha_pattern``
and ``rank_pattern`` per module), exactly as ``PeftModel`` computes it. In the weight store the
tenant is its base's slots, shared (``WeightStore.add(base=)``: nothing copied); its adapter
lives in the engine's :class:`LoraBank`.

The adapter is read as PEFT loads it, with the encoder's checks (``itif.backbones.lora_tenants``:
the config's fields, which modules ``target_modules`` / ``exclude_modules`` /
``layers_to_transform`` select, each module's rank and scale): the llama family's ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; GPT-2's ``c_attn``,
``c_proj``, ``c_fc`` (PEFT adapts GPT-2's ``Conv1D`` with ``fan_in_fan_out``: its ``A`` and ``B``
have the same orientation as a linear's, so the product is the same). Refused with InvalidWeights
naming the field: what the encoder refuses, ``modules_to_save`` (a decoder's heads and embeddings
are not per adapter), LoRA on ``lm_head`` or ``embed_tokens``, and a base that is itself a LoRA
tenant.

Fused kinds: Q, K and V are one ``qkv`` product (gate and up one ``gate_up``), so an adapter's
parts are packed into one pair per canonical projection: ``A`` stacks the parts' ``A`` (rank =
the sum of their ranks) and ``B`` places each part's ``B`` (scale folded in) in the part's own
output columns (Q's first ``heads x d``, then K's and V's ``kv_heads x d``: grouped-query
widths), zero elsewhere, so the delta of ``k_proj`` lands in K's columns of the fused output.

The bank (Punica's BGMV / SGMV with padded batched products): per projection, ``A [slots, R,
in]`` and ``B [slots, out, R]`` stacked over adapters, ``R`` the largest packed rank registered
(smaller ranks zero-padded: their extra columns add exact zeros). A batch's rows of LoRA
tenants are cut into segments (the runs of one tenant, padded to the longest, or one segment
per row when padding would cost more); each segment's ``A`` and ``B`` are gathered by its
adapter slot and two ``torch.bmm`` compute every segment's delta at once, added back with one
``index_add_``: a constant number of launches per projection, however many adapters the batch
draws. Registering an adapter writes its slot's rows (the buffers grow by doubling), and the
store entry shares its base's slots: no work proportional to the adapters already there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from itif.backbones.lora_tenants import (
    PATTERN_BUDGET_S,
    check_config,
    module_rank,
    module_scale,
    read_adapter,
    selection_fields,
    targeted_modules,
)
from itif.errors import InvalidWeights, TenantNotFound, shown
from itif.generation.spec import DecoderSpec

if TYPE_CHECKING:
    from itif.generation.engine import GenEngine

__all__ = ["LoraAdapter", "LoraBank", "LoraRows", "adapter_modules", "load_adapter",
           "read_lora"]

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class _Module:
    """Where one Hugging Face linear lands: its canonical projection (``dec.{i}.qkv.weight``),
    the first of its output columns there, its width and its input width."""

    proj: str
    offset: int
    width: int
    fan_in: int


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: per canonical projection, ``(A [R, in], B [out, R])`` float32 on the
    CPU, the scale folded into ``B``; and the base tenant it was read for."""

    base: str
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_modules(spec: DecoderSpec) -> dict[str, _Module]:
    """The full Hugging Face module name (as PEFT matches ``target_modules``) of every linear
    an adapter may adapt -> where it lands in the canonical table."""
    H, I, A, G = spec.hidden, spec.ffn, spec.q_width, spec.kv_width  # noqa: E741 (I: the intermediate width, as in the papers)
    out: dict[str, _Module] = {}
    for i in range(spec.dec_layers):
        p = f"dec.{i}."
        if spec.family == "llama":
            sa, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            parts = [(sa + "q_proj", "qkv", 0, A, H), (sa + "k_proj", "qkv", A, G, H),
                     (sa + "v_proj", "qkv", A + G, G, H), (sa + "o_proj", "attn_out", 0, H, A),
                     (mlp + "gate_proj", "gate_up", 0, I, H), (mlp + "up_proj", "gate_up", I, I, H),
                     (mlp + "down_proj", "ffn_out", 0, H, I)]
        elif spec.family == "gpt2":
            h = f"transformer.h.{i}."
            parts = [
                (h + "attn.c_attn", "qkv", 0, 3 * H, H),
                (h + "attn.c_proj", "attn_out", 0, H, H),
                (h + "mlp.c_fc", "ffn_in", 0, I, H),
                (h + "mlp.c_proj", "ffn_out", 0, H, I),
            ]
        else:
            raise InvalidWeights(f"LoRA adapters are served on llama-family and gpt2 decoders; "
                                 f"the backbone {spec.name!r} is {spec.family}")
        for name, kind, off, width, fan_in in parts:
            out[name] = _Module(p + kind + ".weight", off, width, fan_in)
    return out


def _config_for(spec: DecoderSpec, config: Mapping[str, Any]) -> dict:
    """The adapter config as the encoder's checks read it. GPT-2's ``Conv1D`` is adapted with
    ``fan_in_fan_out`` (PEFT sets it, warning), which changes only how PEFT merges, not the
    product: accepted there."""
    cfg = dict(config)
    if cfg.get("modules_to_save"):
        raise InvalidWeights(f"adapter_config modules_to_save={cfg['modules_to_save']!r} is not "
                             "supported on decoders (heads and embeddings are the base's)")
    if spec.family == "gpt2":
        cfg.pop("fan_in_fan_out", None)
    return cfg


def read_lora(spec: DecoderSpec, config: Mapping[str, Any],
              tensors: Mapping[str, torch.Tensor], base: str) -> LoraAdapter:
    """The packed pairs of a PEFT adapter (module docstring), checked as PEFT loads it: what
    PEFT refuses is refused, and so is what it would leave unused or at its initial values."""
    if not isinstance(config, Mapping):
        raise InvalidWeights("adapter_config is not a JSON object")
    cfg = _config_for(spec, config)
    check_config(cfg)
    deadline = time.monotonic() + PATTERN_BUDGET_S
    modules = adapter_modules(spec)
    src: dict[str, torch.Tensor] = {}
    given: dict[str, str] = {}
    for name, t in tensors.items():
        key = name.removeprefix(_PREFIX)
        for ab in ("lora_A", "lora_B"):  # PEFT's names with the adapter's: ".lora_A.default."
            if f".{ab}." in key and not key.endswith(f".{ab}.weight"):
                key = key.split(f".{ab}.")[0] + f".{ab}.weight"
        given[key] = name
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InvalidWeights(f"adapter tensor {name!r} is not a float tensor")
        if not torch.isfinite(t).all():
            raise InvalidWeights(f"adapter tensor {name!r} holds non-finite values")
        src[key] = t.detach().to("cpu", torch.float32)
    targeted = targeted_modules(cfg, spec, {m: m for m in modules}, deadline)
    by_proj: dict[str, list[tuple[_Module, torch.Tensor, torch.Tensor]]] = {}
    used: set[str] = set()
    for key in sorted(k for k in src if k.endswith(_A)):
        module = key.removesuffix(_A)
        a, b = src[key], src.get(module + _B)
        if module not in modules:
            raise InvalidWeights(
                f"adapter module {given[key].removesuffix(_A)!r} is not a linear of the "
                f"{spec.family} backbone {spec.name!r} an adapter may adapt ("
                f"{', '.join(sorted({m.rsplit('.', 1)[-1] for m in modules}))})")
        if module not in targeted:
            raise InvalidWeights(f"adapter tensor {given[key]!r}: its adapter_config does not "
                                 f"adapt {module!r} ({selection_fields(cfg)}): PEFT would "
                                 "leave it unused")
        if b is None:
            raise InvalidWeights(f"adapter has {given[key]!r} without its lora_B")
        used.update((key, module + _B))
        if a.dim() != 2 or b.dim() != 2:
            raise InvalidWeights(f"adapter module {module!r}: lora_A {list(a.shape)} and "
                                 f"lora_B {list(b.shape)} are not matrices")
        rank, field = module_rank(cfg, module, deadline)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidWeights(
                f"adapter module {module!r}: its tensors have rank {a.shape[0]} / {b.shape[1]} "
                f"(lora_A {list(a.shape)}, lora_B {list(b.shape)}) but adapter_config {field} "
                f"is {rank}")
        m = modules[module]
        if a.shape[1] != m.fan_in or b.shape[0] != m.width:
            raise InvalidWeights(
                f"adapter module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                f"do not fit its weight [{m.width}, {m.fan_in}] (lora_A is [r, in_features], "
                "lora_B [out_features, r])")
        scale = module_scale(cfg, module, rank, deadline)
        by_proj.setdefault(m.proj, []).append((m, a, b * scale))
    missing = sorted(m for m in targeted if m + _A not in src)
    if missing:
        raise InvalidWeights(
            f"adapter_config adapts {missing[0]!r} ({selection_fields(cfg)}) but the adapter has "
            f"no lora_A/lora_B for it ({len(missing)} such modules): PEFT would leave them at "
            "their initial values")
    extra = sorted(set(src) - used)
    if extra:
        raise InvalidWeights(f"unexpected adapter tensor {given[extra[0]]!r}: not a LoRA pair "
                             f"of a decoder linear ({len(extra)} in all)")
    shapes = dict(spec.params())
    pairs = {}
    for proj, parts in by_proj.items():
        out, fan_in = shapes[proj]
        rank = sum(a.shape[0] for _, a, _ in parts)
        A, B = torch.zeros(rank, fan_in), torch.zeros(out, rank)
        col = 0
        for m, a, b in sorted(parts, key=lambda p: p[0].offset):  # Q, K, V; gate, up
            r = a.shape[0]
            A[col:col + r] = a
            B[m.offset:m.offset + m.width, col:col + r] = b
            col += r
        pairs[proj] = (A, B)
    return LoraAdapter(base, pairs)


def load_adapter(eng: "GenEngine", source, base: str) -> LoraAdapter:
    """An adapter (a PEFT adapter directory, a file ``itif.backbones.lora_tenants.pack_adapter``
    wrote, ``(adapter_config dict, tensors)``, or a LoraAdapter) for stored tenant ``base``,
    checked; nothing is added."""
    if base not in eng.store:
        raise TenantNotFound(f"base tenant {shown(base)} not found")
    if eng.lora.has(base):
        raise InvalidWeights(f"base tenant {shown(base)} is itself a LoRA tenant: an adapter's "
                             "base is a full (or delta) tenant")
    if isinstance(source, LoraAdapter):
        return LoraAdapter(base, source.pairs)
    config, tensors = source if isinstance(source, tuple) else read_adapter(source)
    return read_lora(eng.spec, config, tensors, base)


class LoraBank:
    """Every LoRA tenant's adapter of one GenEngine, stacked per projection (module
    docstring). Written under the engine's step lock; read by the forward (``LoraRows``)."""

    def __init__(self, spec: DecoderSpec, device: torch.device, dtype: torch.dtype,
                 capacity: int = 8) -> None:
        self.device, self.dtype = device, dtype
        self.shapes = {n: s for n, s in spec.params() if n.endswith(".weight") and len(s) == 2}
        self.capacity = capacity
        self.A: dict[str, torch.Tensor] = {}  # projection -> [capacity, R, in]
        self.B: dict[str, torch.Tensor] = {}  # projection -> [capacity, out, R]
        self.slot_of: dict[str, int] = {}  # tenant -> its slot
        self.base_of: dict[str, str] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def has(self, tenant: str) -> bool:
        return tenant in self.slot_of

    def _grow(self, proj: str, rank: int) -> None:
        """Room for ``self.capacity`` slots of rank ``rank`` in ``proj``'s buffers."""
        out, fan_in = self.shapes[proj]
        old_a = self.A.get(proj)
        if old_a is not None and old_a.shape[0] == self.capacity and old_a.shape[1] >= rank:
            return
        r = max(rank, 0 if old_a is None else old_a.shape[1])
        kw = dict(device=self.device, dtype=self.dtype)
        a, b = torch.zeros(self.capacity, r, fan_in, **kw), torch.zeros(self.capacity, out, r, **kw)
        if old_a is not None:
            n, r0 = old_a.shape[0], old_a.shape[1]
            a[:n, :r0] = old_a
            b[:n, :, :r0] = self.B[proj]
        self.A[proj], self.B[proj] = a, b

    def write(self, adapter: LoraAdapter) -> int:
        """Write ``adapter`` into a free slot (bound to no tenant yet: :meth:`put`)."""
        if not self._free:  # double: the copy is amortised over as many registrations
            old = self.capacity
            self.capacity *= 2
            self._free = list(range(self.capacity - 1, old - 1, -1))
            for proj in list(self.A):
                self._grow(proj, 0)
        slot = self._free.pop()
        try:
            for proj, (a, _) in adapter.pairs.items():
                self._grow(proj, a.shape[0])
            for proj in self.A:
                pair = adapter.pairs.get(proj)
                self.A[proj][slot].zero_()
                self.B[proj][slot].zero_()
                if pair is not None:
                    r = pair[0].shape[0]
                    self.A[proj][slot, :r].copy_(pair[0])
                    self.B[proj][slot, :, :r].copy_(pair[1])
        except BaseException:
            self._free.append(slot)
            raise
        return slot

    def put(self, tenant: str, adapter: LoraAdapter | None, add: Callable[[], Any]) -> None:
        """``tenant``'s adapter (None: it has none any more) around ``add()``, the store's
        change: written to a fresh slot first (the old one may still be read until ``add``
        publishes), bound after, the slot freed if ``add`` raises."""
        if adapter is None:
            add()
            self.unbind(tenant)
            return
        slot = self.write(adapter)
        try:
            add()
        except BaseException:
            self._free.append(slot)
            raise
        self.unbind(tenant)
        self.slot_of[tenant], self.base_of[tenant] = slot, adapter.base

    def unbind(self, tenant: str) -> None:
        """``tenant`` is no LoRA tenant any more (removed, or replaced by full weights)."""
        slot = self.slot_of.pop(tenant, None)
        self.base_of.pop(tenant, None)
        if slot is not None:
            self._free.append(slot)

    def slots_for(self, ids: Mapping[str, int], n: int) -> np.ndarray | None:
        """Per stable tenant id (``SlotMatrix``'s), its adapter slot or -1; None without
        LoRA tenants."""
        if not self.slot_of:
            return None
        out = np.full(n, -1, np.int64)
        for t, s in self.slot_of.items():
            i = ids.get(t)
            if i is not None and i < n:
                out[i] = s
        return out


class LoraRows:
    """The LoRA segments of one forward's rows (built once per batch structure, like its GEMM
    plans): ``gather`` [segments x L] rows of ``x`` (padding repeats the segment's first row),
    ``seg_slot`` each segment's adapter slot, and where the valid products go (``valid`` flat
    positions, ``dest`` rows)."""

    def __init__(self, bank: LoraBank, row_slot: np.ndarray, device: torch.device) -> None:
        self.bank = bank
        rows = np.flatnonzero(row_slot >= 0)
        # rows ordered by adapter (stable: a prompt's rows stay in order), so a segment is every
        # row of one adapter and its weights are gathered once a step, not once a row
        order = np.argsort(row_slot[rows], kind="stable")
        rows = rows[order]
        slots = row_slot[rows]
        cut = np.flatnonzero(np.diff(slots)) + 1 if rows.size else np.zeros(0, np.int64)
        starts = np.concatenate([[0], cut]).astype(np.int64)
        lens = np.diff(np.concatenate([starts, [rows.size]])).astype(np.int64)
        r = max((a.shape[1] for a in bank.A.values()), default=1)
        # padded runs cost segments x (longest + R) row-products, one segment per row
        # rows x (1 + R): take the cheaper (decode rows of many adapters are rows apart)
        if rows.size and lens.size * (int(lens.max()) + r) > rows.size * (1 + r):
            starts, lens = np.arange(rows.size, dtype=np.int64), np.ones(rows.size, np.int64)
        L = int(lens.max()) if rows.size else 1
        cols = np.arange(L)[None, :]
        ok = cols < lens[:, None]
        idx = starts[:, None] + np.where(ok, cols, 0)
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
        self.n, self.L = int(lens.size), L
        self.gather = t(rows[idx].reshape(-1))
        self.seg_slot = t(slots[starts])
        flat_ok = ok.reshape(-1)
        self.valid = None if flat_ok.all() else t(np.flatnonzero(flat_ok))
        self.dest = t(rows[idx].reshape(-1)[flat_ok])

    def apply(self, y: torch.Tensor, x: torch.Tensor, proj: str) -> torch.Tensor:
        """``y[row] += (x[row] A_row^T) B_row^T`` for every row of a LoRA tenant, each with its
        own adapter: a constant number of launches (three gathers, two batched products, one
        scatter-add) whatever the number of adapters."""
        A = self.bank.A.get(proj)
        if A is None or self.n == 0:
            return y
        xs = x.index_select(0, self.gather).view(self.n, self.L, x.shape[1])
        a = A.index_select(0, self.seg_slot)  # [segments, R, in]
        b = self.bank.B[proj].index_select(0, self.seg_slot)  # [segments, out, R]
        d = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))
        d = d.view(self.n * self.L, d.shape[2])
        if self.valid is not None:
            d = d.index_select(0, self.valid)
        return y.index_add_(0, self.dest, d.to(y.dtype))

