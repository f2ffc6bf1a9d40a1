"""Engine: the public face of the fused multi-tenant instance.

    engine = itif.Engine("bert-base", device="cpu", dtype="float32")
    engine.add_tenant("acme", "acme/model.safetensors")
    res = engine.infer([itif.Request(tenant="acme", input_ids=[101, 7592, 102])])
    res[0].logits  # numpy [num_labels]

``infer`` validates every request (vectorised over the batch), plans the batch into a Layout
(``itif.batching.strategies``), prepares the index tensors once and runs one fused forward over
all tenants against one WeightStore snapshot, then slices each request's outputs.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from itif.backbones.hf import CanonicalWeights, load_tenant_weights
from itif.backbones.spec import BackboneSpec, load_spec
from itif.batching.layout import Layout
from itif.batching.strategies import DEFAULT_STRATEGY, plan
from itif.config.fields import decoder_refusal
from itif.errors import InvalidConfig, InvalidRequest, InvalidWeights, TenantNotFound, shown
from itif.platform import resolve_device, resolve_dtype, tune_host_malloc
from itif.requests import OUTPUTS, Request, Result, check_token_rows  # noqa: F401 - re-exported
from itif.runtime import cpu_attention, cpu_gemm, cpu_linear, forward
from itif.runtime.batch import PreparedBatch, SlotTables, StructureCache, prepare, slot_tables
from itif.runtime.engine_columns import ColumnsMixin
from itif.runtime.graphs import GraphCache
from itif.weights import delta
from itif.weights.delta import DeltaReport, DeltaWeights
from itif.weights.store import WeightStore

log = logging.getLogger("itif.engine")


@dataclass(frozen=True)
class TenantInfo:
    tenant: str
    num_labels: int | None
    has_pooler: bool
    bytes: int  # bytes of weights the tenant reads
    exclusive_bytes: int  # bytes only this tenant holds (what removing it frees)


@dataclass
class _Inputs:
    tenant_idx: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray | None = None
    types: np.ndarray | None = None
    pixels: torch.Tensor | None = None  # [n, C, H, W] float32, pinned on CUDA
    wants: list[tuple[str, ...]] = field(default_factory=list)


_PROBES = itertools.count()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _known_tenants(view, names) -> tuple[str, ...]:
    """The distinct tenants of ``names`` in first-seen order; TenantNotFound for one the store
    view lacks."""
    uniq = tuple(dict.fromkeys(names))
    for t in uniq:
        if t not in view.tenants:
            raise TenantNotFound(f"tenant {t!r} not found")
    return uniq


class Engine(ColumnsMixin):
    """The fused engine; ``infer_columns`` (rows as numpy columns) is ``ColumnsMixin``'s."""

    def __init__(
        self,
        backbone: str | os.PathLike | BackboneSpec,
        device: str = "cpu",
        dtype: str = "float32",
        max_weight_bytes: int | None = None,
        strategy: str = DEFAULT_STRATEGY,
        max_seq_len: int | None = None,
        cuda_graphs: str | bool = "auto",
    ) -> None:
        try:
            self.spec = load_spec(backbone)
        except InvalidConfig as e:  # a decoder: the refusal names the engine that serves it
            why = decoder_refusal(backbone)
            if why is None:
                raise
            raise InvalidConfig(why) from e
        self.max_seq_len = min(max_seq_len or self.spec.seq_len_max, self.spec.seq_len_max)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        cpu_gemm.ensure_for(self.device, self.dtype)  # small batches' few-rows GEMMs, built now
        cpu_attention.ensure_for(self.device, self.dtype)  # ragged batches' attention, ditto
        cpu_linear.ensure_for(self.device, self.dtype)  # long products, one region each: ditto
        tune_host_malloc(self.device)  # large batches' activations: no page faults per forward
        self.store = WeightStore(self.device, self.dtype, max_bytes=max_weight_bytes)
        self.strategy = strategy
        self.tokenizer = _load_tokenizer(self.spec.source_dir)
        self._tables: OrderedDict[tuple, SlotTables] = OrderedDict()
        self._tables_lock = threading.Lock()
        self.cost_model = None  # itif.batching.layer_cost.CostModel, profiled on first DP plan
        self._graphs = GraphCache(self.device) if self.device.type == "cuda" else None
        self._structures = StructureCache()
        self._signatures: dict[tuple[str, int], tuple] = {}  # (tenant, generation) -> slots
        self._backbone_names = [p.name for p in self.spec.params(pooler=False)]
        self.cuda_graphs = cuda_graphs  # type: ignore[assignment] - the setter parses it

    @property
    def cuda_graphs(self) -> bool:
        """Whether forwards may replay CUDA graphs, one per batch structure; always False on the
        CPU. Settable with "on" / "off" / "auto", which also pick when a structure is captured:
        "auto" (the default) once the eager forwards it cost reach what a capture costs (a
        serving load's ever-new structures stay eager), "on" on first sight (a workload that
        repeats one structure); see ``itif.runtime.graphs``. A bool switches graphs on or off
        and keeps that choice."""
        return self._use_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, value: str | bool) -> None:
        if isinstance(value, str):
            if value not in ("on", "off", "auto"):
                raise ValueError(f"cuda_graphs {value!r} is not 'on', 'off' or 'auto'")
            if self._graphs is not None and value != "off":
                with self._graphs.lock:
                    self._graphs.policy = "rent" if value == "auto" else "first"
            value = value != "off"
        self._use_graphs = bool(value) and self._graphs is not None

    def graph_stats(self) -> dict | None:
        """The CUDA graph cache's counters (policy, graphs held, captures, replays, eager
        forwards, the measured capture/eager ratio); None on the CPU."""
        return None if self._graphs is None else self._graphs.stats()

    # ---- tenants ---------------------------------------------------------------------------
    def load_weights(self,
                     source: str | os.PathLike | Mapping[str, torch.Tensor]) -> CanonicalWeights:
        """Read and validate a checkpoint against the backbone without adding it: names,
        shapes, finite values, and finite still once cast to the serving dtype."""
        weights = load_tenant_weights(self.spec, source)
        if self.spec.is_text and weights.num_labels and not weights.has_pooler:
            raise InvalidWeights("a text classification head needs the pooler (pooler.dense.*)")
        for name, t in weights.tensors.items():
            if t.dtype == self.dtype or not t.is_floating_point():
                continue
            bad = ~torch.isfinite(t.to(self.dtype))
            if bad.any():
                top = torch.finfo(self.dtype).max
                raise InvalidWeights(
                    f"tensor {name!r}: {int(bad.sum())} values overflow {_dtype_name(self.dtype)} "
                    f"(largest magnitude {float(t.abs().max()):.4g}; "
                    f"{_dtype_name(self.dtype)} holds up to {top:.4g})")
        return weights

    def probe(self, weights: CanonicalWeights, base: str | None = None, digests=None) -> None:
        """Run ``weights`` once, alone, on a fixed input and raise :class:`InvalidWeights` if
        an output is not finite (finite weights can still overflow inside the forward, e.g.
        1e30 in a dense layer). The weights are added under a name no tenant id can take and
        removed again; budget as for ``add_tenant``. ``base``: as for ``add_tenant``."""
        name = f"~probe-{next(_PROBES)}"  # tenant ids start with [a-z0-9]
        self._check_shapes(weights)
        base = None if isinstance(weights, DeltaWeights) else base  # W_hat is whole
        self.store.add(name, weights, digests, base=base)  # ``digests``: check_budget's
        try:
            outputs = ("pooled", "last_hidden_state") + (("logits",) if weights.num_labels else ())
            if self.spec.is_text:
                n = min(8, self.max_seq_len)
                req = Request(name, input_ids=np.arange(n) % self.spec.vocab_size, outputs=outputs)
            else:
                shape = (self.spec.num_channels, self.spec.image_size, self.spec.image_size)
                pixels = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
                req = Request(name, pixel_values=pixels, outputs=outputs)
            (res,) = self.infer([req])
        finally:
            self.store.remove(name)
        for key, value in res.as_dict().items():
            if not np.isfinite(value).all():
                raise InvalidWeights(
                    f"these weights produce non-finite {key} ({int((~np.isfinite(value)).sum())} "
                    f"of {value.size} values NaN/Inf) on a probe input in {_dtype_name(self.dtype)}"
                )

    def add_tenant(self, tenant: str,
                   source: str | os.PathLike | Mapping[str, torch.Tensor] | CanonicalWeights,
                   base: str | None = None, compress: str | None = None,
                   tag: str = "") -> TenantInfo:
        """Add (or atomically replace) a tenant's weights: a safetensors file, a checkpoint
        directory, a dict of Hugging Face-named tensors, or already-validated weights. With
        ``base``: a PEFT LoRA adapter directory (or ``(adapter_config dict, tensors)``, or
        what ``load_lora`` returned) on that stored tenant (``itif.backbones.lora_tenants``). With
        ``base`` and ``compress`` ("int8" or "sign"): a full checkpoint stored as that base
        plus a compressed delta and served as W_hat (``itif.weights.delta``; or what
        ``load_delta`` returned). ``tag``: names these weights in every Result they produce
        (``Result.weights``; the daemon gives their file's sha256)."""
        if isinstance(source, DeltaWeights) or (compress not in (None, "none")):
            weights = source if isinstance(source, DeltaWeights) else self.load_delta(
                source, base, compress)[0]
            base = None  # W_hat is whole: what equals the base's is shared by the store's dedup
        elif base is not None:
            weights = (
                source if isinstance(source, CanonicalWeights) else self.load_lora(source, base)
            )
        else:
            weights = source if isinstance(source, CanonicalWeights) else self.load_weights(source)
        self._check_shapes(weights)
        self.store.add(tenant, weights, base=base, tag=tag)
        return self.tenant_info(tenant)

    def _check_shapes(self, weights: CanonicalWeights) -> None:
        """InvalidWeights unless every tensor named in the backbone's table has its shape. The
        store files a tensor by name and shape, and the forward reads a name's slot from the
        buffer of the table's shape: a tensor of another shape would have this tenant read
        another tenant's slot. The loaders check what they read; this holds whatever the path."""
        table = {p.name: tuple(p.shape) for p in self.spec.params(weights.num_labels)}
        for name, t in weights.tensors.items():
            want = table.get(name)
            if want is not None and tuple(t.shape) != want:
                raise InvalidWeights(f"tensor {name!r} has shape {list(t.shape)}; the "
                                     f"{self.spec.family} backbone expects {list(want)}")

    def load_lora(self, source, base: str) -> CanonicalWeights:
        """Read and validate a LoRA adapter for stored tenant ``base`` without adding it."""
        from itif.backbones.lora_tenants import load_lora, read_adapter  # noqa: PLC0415

        config, tensors = (source if isinstance(source, tuple) else read_adapter(source))
        view = self.store.view
        if base not in view.tenants:
            raise TenantNotFound(f"base tenant {shown(base)} not found")
        heads = {}
        for name in view.tenants[base].slots:
            if name.startswith(("pooler.", "head.")):
                buf, slot = view.param(base, name)
                heads[name] = buf[slot].detach().to("cpu", torch.float32)
        return load_lora(self.spec, config, tensors, heads)

    def _tensors_of(self, tenant: str, prefixes: tuple[str, ...] | None = None) -> dict:
        """A stored tenant's canonical tensors (those starting with ``prefixes``; all when
        None) as float32 CPU copies (copies even on a float32 CPU store, where ``to`` would
        return views of its slots: a delta's W_hat is built from them, and the base may be
        evicted, its slots reused, before W_hat is added)."""
        view = self.store.view
        if tenant not in view.tenants:
            raise TenantNotFound(f"base tenant {shown(tenant)} not found")
        out = {}
        for name in view.tenants[tenant].slots:
            if prefixes is None or name.startswith(prefixes):
                buf, slot = view.param(tenant, name)
                out[name] = buf[slot].detach().to("cpu", torch.float32, copy=True)
        return out

    def load_delta(self, source, base: str, compress: str,
                   base_sha256: str = "") -> tuple[DeltaWeights, DeltaReport]:
        """Read and validate a full checkpoint, compress it against stored tenant ``base``
        (``compress``: "int8" or "sign"), and measure what that costs: the probe batch
        (``delta.probe_requests``) run through the exact weights and through W_hat on this
        engine's device and dtype (a scratch engine: the store and its budget are untouched);
        the report holds the max abs difference of the logits (pooled output without a head)
        and the byte counts. ``base_sha256`` is recorded in the blob (applied to that base only)."""
        if compress not in delta.METHODS:
            raise InvalidRequest(f"compress {compress!r} is not one of {delta.METHODS}")
        if base is None:
            raise InvalidRequest("compress needs base: the tenant the delta is taken against")
        exact = source if isinstance(source, CanonicalWeights) else self.load_weights(source)
        base_t = self._tensors_of(base)
        blob, table = delta.compress(exact, base_t, compress)
        meta = delta.make_meta(exact, table, compress, base, base_sha256)
        w_hat = delta.decompress(self.spec, base_t, blob, meta)
        output = "logits" if exact.num_labels else "pooled"
        scratch = Engine(self.spec, device=str(self.device), dtype=_dtype_name(self.dtype),
                         max_seq_len=self.max_seq_len, cuda_graphs="off")  # packed: no profiling
        scratch.add_tenant("exact", exact)
        scratch.add_tenant("delta", w_hat)
        reqs = delta.probe_requests(self.spec, self.max_seq_len, "exact", output)
        reqs += [Request("delta", **{k: getattr(r, k) for k in ("input_ids", "pixel_values")},
                         outputs=(output,)) for r in reqs]
        res = scratch.infer(reqs)
        n = len(reqs) // 2
        error = max(float(np.max(np.abs(getattr(a, output) - getattr(b, output))))
                    for a, b in zip(res[:n], res[n:]))
        meta["max_abs_error"], meta["error_output"] = repr(error), output
        report = delta.report_of(blob, meta, error, output)
        weights = delta.DeltaWeights(w_hat.tensors, w_hat.num_labels, w_hat.has_pooler,
                                     blob=blob, meta=meta, report=report)
        return weights, report

    def load_delta_blob(self, source, base: str, base_sha256: str | None = None) -> DeltaWeights:
        """W_hat of a stored delta blob (what ``delta.to_bytes`` wrote) on stored tenant
        ``base``; ``base_sha256``: the base's current sha256, which must be the one the delta
        was taken against (InvalidWeights otherwise, saying to upload the fine-tune again)."""
        blob, meta = delta.read_blob(source)
        if base_sha256 is not None:
            delta.check_base(meta, base, base_sha256)
        w_hat = delta.decompress(self.spec, self._tensors_of(base), blob, meta)
        return delta.DeltaWeights(w_hat.tensors, w_hat.num_labels, w_hat.has_pooler,
                                  blob=blob, meta=meta, report=delta.report_of(blob, meta))

    def remove_tenant(self, tenant: str) -> None:
        self.store.remove(tenant)

    def tenant_info(self, tenant: str, sizes: bool = True) -> TenantInfo:
        """The tenant's head and bytes; ``sizes=False`` leaves both byte counts 0 (a walk over
        every slot of the tenant under the store's lock that a per-call caller does not need)."""
        entry = self.store.view.tenants.get(tenant)
        if entry is None:
            raise TenantNotFound(f"tenant {shown(tenant)} not found")
        total, exclusive = self.store.tenant_bytes(tenant) if sizes else (0, 0)
        return TenantInfo(tenant, entry.num_labels, entry.has_pooler, total, exclusive)

    def tenants(self) -> list[str]:
        return self.store.tenants()

    @property
    def weight_bytes(self) -> int:
        """Bytes held by the weight store (each shared tensor once)."""
        return self.store.weight_bytes

    # ---- inference -------------------------------------------------------------------------
    def infer(self, requests: Sequence[Request], strategy: str | None = None, *,
              on_plan: Callable[[Layout], None] | None = None,
              layout: Layout | None = None) -> list[Result]:
        """Run every request in one fused forward; results in request order. ``on_plan`` is
        called with the batch's Layout once planned (the daemon's metrics read its padding);
        ``layout``, a plan of these very requests, runs instead of planning (the calibration
        times given layouts)."""
        if not requests:
            return []
        with self.store.read() as view:
            tenants = self.batch_tenants(view, [r.tenant for r in requests])
            inputs = self._validate(requests, tenants, view, pin=self.device.type == "cuda")
            if layout is None:
                layout = self.plan(inputs.tenant_idx, inputs.lengths, strategy)
            if on_plan is not None:
                on_plan(layout)
            out = self._run(view, tenants, layout, inputs)
            # which weights each result is of: this view's, whatever was uploaded since
            tags = {t: view.tenants[t].tag for t in tenants}
            return self._results(requests, tags, layout, inputs, out)

    def check(self, requests: Sequence[Request]) -> None:
        """Validate requests exactly as ``infer`` would, without running them. Reads metadata
        only (no buffers, so no snapshot is held) and skips the batch's tenant ordering: the
        daemon runs this once per call, on its front end."""
        if requests:
            view = self.store.view
            self._validate(requests, _known_tenants(view, [r.tenant for r in requests]), view)

    def request_tokens(self, request: Request) -> int:
        """Rows a request occupies in the token buffer (its length; patches + CLS for ViT)."""
        if self.spec.is_text:
            return len(request.input_ids)
        return self.spec.num_patches + 1

    def plan(self, tenant_idx: np.ndarray, lengths: np.ndarray,
             strategy: str | None = None) -> Layout:
        """Plan a batch: ``tenant_idx`` [n] batch-tenant indices, ``lengths`` [n] rows each."""
        name = strategy or self.strategy
        cost = self.get_cost_model() if name in ("itif_two_stage", "turbo_dp") else self.cost_model
        return plan(name, tenant_idx, lengths, cost, self.spec.layers)

    def get_cost_model(self, quick: bool = True):
        """The profiled per-layer cost model for this device, backbone and dtype (cached on
        disk; profiled on first use: quick by default, ``itif plan --full`` for the full grid)."""
        if self.cost_model is None:
            from itif.batching.layer_cost import CostModel, LayerShape  # noqa: PLC0415

            shape = LayerShape(self.spec.hidden, self.spec.intermediate, self.spec.heads)
            self.cost_model = CostModel.cached(shape, device=self.device, dtype=self.dtype,
                                               quick=quick)
        return self.cost_model

    def batch_tenants(self, view, names: list[str]) -> tuple[str, ...]:
        """The distinct tenants of a batch whose rows are of ``names`` (TenantNotFound for one
        ``view`` does not hold), ordered so tenants sharing slots are adjacent (their rows then
        merge into one GEMM segment): the batch-tenant order ``plan`` indexes and ``prepare``
        takes (the calibration code builds batches the way :meth:`infer` does with it)."""
        uniq = _known_tenants(view, names)
        sigs = self._signatures
        if len(sigs) > 4 * len(view.tenants) + 64:  # forget tenants removed or re-uploaded
            sigs.clear()

        def signature(t: str) -> tuple:
            entry = view.tenants[t]
            sig = sigs.get((t, entry.generation))
            if sig is None:
                names = self._backbone_names
                sig = sigs[(t, entry.generation)] = tuple(entry.slots[n][1] for n in names) + (t,)
            return sig

        return tuple(sorted(uniq, key=signature))

    def slot_tables(self, view, tenants: tuple[str, ...]) -> SlotTables:
        """The ``SlotTables`` of ``tenants`` (in :meth:`batch_tenants`' order) in ``view``:
        which weight slot each batch tenant reads per parameter, what ``prepare`` needs. Cached
        by the tenants and their weights' generations (the last 256 batches' sets)."""
        key = tuple((t, view.tenants[t].generation) for t in tenants)
        with self._tables_lock:
            tables = self._tables.get(key)
            if tables is not None:
                self._tables.move_to_end(key)
                return tables
        tables = slot_tables(self.spec, view, tenants)
        with self._tables_lock:
            self._tables[key] = tables
            while len(self._tables) > 256:
                self._tables.popitem(last=False)
        return tables

    def _validate(self, requests: Sequence[Request], tenants: tuple[str, ...], view,
                  pin: bool = False) -> _Inputs:
        """The batch's inputs, checked; ``pin``: ViT pixels land in pinned host memory (a batch
        about to be uploaded to the GPU)."""
        spec = self.spec
        index = {t: i for i, t in enumerate(tenants)}
        tenant_idx = np.fromiter((index[r.tenant] for r in requests), np.int32, count=len(requests))
        wants = []
        for i, r in enumerate(requests):
            entry = view.tenants[r.tenant]
            outs = (
                tuple(r.outputs)
                if r.outputs
                else (("logits",) if entry.num_labels else ("pooled",))
            )
            for o in outs:
                if o not in OUTPUTS:
                    raise InvalidRequest(
                        f"request {i}: unknown output {o!r}; choose from {OUTPUTS}"
                    )
            if "logits" in outs and not entry.num_labels:
                raise InvalidRequest(f"request {i}: tenant {r.tenant!r} has no classification head")
            wants.append(outs)
        if spec.is_text:
            return self.validate_text(requests, tenant_idx, wants)
        return self.validate_pixels(requests, tenant_idx, wants, pin)

    def validate_text(self, requests, tenant_idx, wants) -> _Inputs:
        """The token inputs of ``requests`` of a text backbone, checked (InvalidRequest naming
        the request and field: ids, lengths against ``max_seq_len``, the vocabulary, token
        types). ``tenant_idx``/``wants``: each request's batch tenant and outputs, carried
        through. Needs no tenant's weights: the weight tiers check requests of a tenant that is
        not resident with it (``itif.daemon_tiers.check``)."""
        spec = self.spec
        ids_list = []
        for i, r in enumerate(requests):
            if r.pixel_values is not None:
                raise InvalidRequest(
                    f"request {i}: a {spec.family} backbone takes input_ids, not pixel_values"
                )
            if r.input_ids is None:
                raise InvalidRequest(f"request {i}: input_ids is required")
            a = np.asarray(r.input_ids)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise InvalidRequest(
                    f"request {i}: input_ids must be a 1-D list of integers, "
                    f"got shape {a.shape} {a.dtype}"
                )
            ids_list.append(a.astype(np.int64, copy=False))
        lengths = np.fromiter((a.size for a in ids_list), np.int32, count=len(ids_list))
        ids = ids_list[0] if len(ids_list) == 1 else np.concatenate(ids_list)
        check_token_rows(lengths, ids, self.max_seq_len, spec.vocab_size)
        types = None
        if any(r.token_type_ids is not None for r in requests):
            tt = []
            for i, r in enumerate(requests):
                if r.token_type_ids is None:
                    tt.append(np.zeros(lengths[i], np.int64))
                    continue
                a = np.asarray(r.token_type_ids)
                if a.shape != (lengths[i],) or (a.size and a.dtype.kind not in "iu"):
                    raise InvalidRequest(
                        f"request {i}: token_type_ids must be {int(lengths[i])} integers "
                        "like input_ids, "
                        f"got shape {a.shape}"
                    )
                tt.append(a.astype(np.int64, copy=False))
            types = np.concatenate(tt)
            if types.min() < 0 or types.max() >= spec.type_vocab_size:
                raise InvalidRequest(f"token_type_ids must lie in [0, {spec.type_vocab_size})")
        return _Inputs(tenant_idx, lengths, ids=ids, types=types, wants=wants)

    def validate_pixels(self, requests, tenant_idx, wants, pin: bool = False) -> _Inputs:
        """As :meth:`validate_text`, for an image backbone: each request's ``pixel_values``
        checked (shape, finite values) into one batch buffer; ``pin``: in pinned host memory
        (a batch about to be uploaded to the GPU)."""
        spec = self.spec
        shape = (spec.num_channels, spec.image_size, spec.image_size)
        # Each request's pixels go once, straight into the batch's host buffer (pinned for the
        # upload on CUDA), and are checked there while still in cache: on an H100's host the
        # stacked copy, the boolean isfinite mask and the copy into pinned memory took 4 ms of
        # a 9 ms ViT-base forward of 32 images (bench/results/gpu-h100-2026-11-26).
        buf = torch.empty((len(requests), *shape), dtype=torch.float32, pin_memory=pin)
        dst = buf.numpy()
        for i, r in enumerate(requests):
            if r.input_ids is not None:
                raise InvalidRequest(
                    f"request {i}: a vit backbone takes pixel_values, not input_ids"
                )
            if r.pixel_values is None:
                raise InvalidRequest(f"request {i}: pixel_values is required")
            a = np.asarray(r.pixel_values)
            if a.dtype != np.float32:
                a = a.astype(np.float32)
            if a.shape != shape:
                raise InvalidRequest(
                    f"request {i}: pixel_values has shape {a.shape}; expected {shape}"
                )
            d = dst[i]
            np.copyto(d, a)
            # min and max are NaN when any value is, and infinite when any value is
            if not (np.isfinite(d.min()) and np.isfinite(d.max())):
                raise InvalidRequest(f"request {i}: pixel_values contain NaN or Inf")
        lengths = np.full(len(requests), spec.num_patches + 1, np.int32)
        return _Inputs(tenant_idx, lengths, pixels=buf, wants=wants)

    def _run(self, view, tenants, layout: Layout,
             inputs: _Inputs) -> tuple[PreparedBatch, np.ndarray]:
        """One forward; returns the batch and its flat float32 output, on the host."""
        batch = prepare(self.spec, layout, tenants, view, self.slot_tables(view, tenants),
                        self.device, self.dtype, ids=inputs.ids, types=inputs.types,
                        pixels=inputs.pixels,
                        want_pooled=any("pooled" in w for w in inputs.wants),
                        want_logits=any("logits" in w for w in inputs.wants),
                        want_hidden=any("last_hidden_state" in w for w in inputs.wants),
                        cache=self._structures)
        if self._use_graphs:
            with self._graphs.lock:  # the output may live in a graph's memory: read it here
                return batch, self._graphs.run(self.spec, batch).cpu().numpy()
        ints, floats = batch.upload(self.device)
        out = forward.run(self.spec, batch, ints, floats)
        return batch, out.cpu().numpy()

    def _results(self, requests, tags: Mapping[str, str], layout: Layout, inputs: _Inputs,
                 out: tuple[PreparedBatch, np.ndarray]) -> list[Result]:
        batch, flat = out
        n, H = len(requests), self.spec.hidden
        n_logits, n_pooled, _ = batch.out_sizes
        logits = flat[:n_logits].reshape(n, batch.max_labels) if n_logits else None
        pooled = flat[n_logits : n_logits + n_pooled].reshape(n, H) if n_pooled else None
        hidden = flat[n_logits + n_pooled :].reshape(batch.rows, H) if batch.want_hidden else None
        cls_pos = np.empty(n, np.int64)
        cls_pos[batch.cls_order] = np.arange(n)
        head_pos = np.empty(n, np.int64)
        head_pos[batch.head_order] = np.arange(n)
        labels = batch.labels
        results = []
        for i, r in enumerate(requests):
            res = Result(tenant=r.tenant, weights=tags[r.tenant])
            wants = inputs.wants[i]
            if "logits" in wants:
                res.logits = logits[head_pos[i], : labels[layout.tenant[i]]].copy()
            if "pooled" in wants:
                res.pooled = pooled[cls_pos[i]]
            if "last_hidden_state" in wants:
                o = int(layout.offset[i])
                res.last_hidden_state = hidden[o : o + int(layout.length[i])]
            results.append(res)
        return results


def _load_tokenizer(source_dir: Path | None) -> Any:
    """The backbone's tokenizer.json through the ``tokenizers`` package, when it ships one."""
    if source_dir is None or not (source_dir / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(source_dir / "tokenizer.json"))
    except Exception as e:  # a broken tokenizer must not stop id-based serving
        log.warning("cannot load %s/tokenizer.json: %s", source_dir, e)
        return None
    # Checkpoints often ship a tokenizer configured to pad (and truncate) to a fixed length for
    # training; a request must carry exactly its own tokens, and an over-long text must be an
    # error (INVALID_ARGUMENT) rather than silently cut.
    tok.no_padding()
    tok.no_truncation()
    return tok


__all__ = ["Engine", "Request", "Result", "TenantInfo"]
