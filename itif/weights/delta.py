"""Delta-compressed tenants (issue 14, item 3): a full fine-tune stored as its base tenant's
weights plus a compressed delta.

``tenants[].compress`` picks the format, per matrix (every weight of two or more dimensions,
rows = its first dimension); 1-D parameters (biases, LayerNorm, the ViT class token) are kept
exact, they are tiny:

``int8``
    ``delta = W - W_base``, one symmetric scale per output channel (row), ``max|row| / 127``,
    and int8 codes: about 1/4 of the float32 matrix.
``sign``
    BitDelta's format: one scale per matrix, ``mean |delta|``, and the sign of every delta
    element, packed 8 per byte: about 1/32 of the float32 matrix.

A tensor identical to the base's (delta all zero) is stored as nothing: the tenant reads the
base's tensor, which the weight store then shares (its usual dedup of identical tensors). A
tensor the base lacks, or holds with another shape (a head with another label count), is kept
exact.

The compressed form is ONE safetensors file (:func:`to_bytes`; tensors ``<name>:codes``,
``<name>:scale``, ``<name>:bits``, ``<name>:exact``, the table of every tensor and how it is
stored in the ``__metadata__``): the daemon stores it in the blob store instead of the
uploaded checkpoint, so disk bytes shrink by those factors on the matrices.

**Served as W_hat.** :func:`decompress` materialises ``W_hat = W_base + dequant(delta)`` in
float32, and the device slot holds W_hat: the forward is the plain fused forward, and a
delta tenant costs the device what a full tenant costs (less its tensors shared with the
base). Computing on the compressed delta inside the GEMM (DeltaZip-style: a base GEMM shared
by the tenants plus a low-bit delta GEMM per tenant) is future GPU work; the saving today is
disk bytes (and the upload's stored size). The host tier (``itif.weights.tiers``) keeps W_hat
as it keeps any evicted tenant.

The delta is taken against the base as the weight store holds it (in the serving dtype), and
the blob records the base's sha256: a stored delta is only ever applied to that same base. When
the base is re-uploaded with other weights the daemon marks its delta tenants FAILED ("upload
the fine-tune again"): a delta is not meaningful on another base, unlike a LoRA adapter.

The error is measured, not assumed: ``Engine.load_delta`` runs :func:`probe_requests` (a fixed
small batch) through the exact weights and through W_hat on the serving device and dtype and
reports the max abs difference of the logits (of the pooled output when the fine-tune has no
head) in a :class:`DeltaReport`; the daemon refuses an upload whose figure exceeds the
tenant's ``max_error``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from itif.backbones.hf import CanonicalWeights
from itif.backbones.spec import BackboneSpec
from itif.errors import InvalidWeights, shown
from itif.requests import Request

__all__ = ["FORMAT", "METHODS", "DeltaReport", "DeltaWeights", "check_error", "compress",
           "decompress", "make_meta", "probe_requests", "read_blob", "replace_upload",
           "report_of", "to_bytes"]

FORMAT = "itif-delta/1"
METHODS = ("int8", "sign")
_KINDS = ("base", "exact", "int8", "sign")
#: The probe batch's lengths (capped at the engine's max_seq_len) and seed.
PROBE_LENGTHS = (8, 16, 32, 5)
PROBE_SEED = 1234


@dataclass(frozen=True)
class DeltaReport:
    """What compressing a fine-tune measured."""

    compress: str
    base: str
    max_abs_error: float  # max |exact - W_hat| over the probe batch's ``output``
    output: str  # "logits" or "pooled"
    exact_bytes: int  # float32 bytes of the fine-tune's tensors
    stored_bytes: int  # bytes of the blob's tensors (what the disk keeps, less the header)
    matrix_exact_bytes: int  # float32 bytes of the compressed matrices
    matrix_stored_bytes: int  # their codes and scales
    shared: int  # tensors identical to the base's (stored as nothing)

    @property
    def matrix_ratio(self) -> float:
        """Compressed / exact bytes of the matrices (~1/4 int8, ~1/32 sign)."""
        return self.matrix_stored_bytes / max(self.matrix_exact_bytes, 1)

    def as_dict(self) -> dict:
        return {"compress": self.compress, "base": self.base,
                "max_abs_error": self.max_abs_error, "output": self.output,
                "exact_bytes": self.exact_bytes, "stored_bytes": self.stored_bytes,
                "matrix_ratio": round(self.matrix_ratio, 5), "shared": self.shared}


@dataclass(frozen=True)
class DeltaWeights(CanonicalWeights):
    """W_hat (``tensors``: canonical, float32, CPU) with its compressed form: ``blob`` and
    ``meta`` are what :func:`to_bytes` writes. The engine adds it as a full tenant (no slots
    inherited from the base: tensors equal to the base's are shared by the store's dedup)."""

    blob: Mapping[str, torch.Tensor] = field(default_factory=dict)
    meta: Mapping[str, str] = field(default_factory=dict)
    report: DeltaReport | None = None


# ---- compress / decompress ---------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def compress(exact: CanonicalWeights, base: Mapping[str, torch.Tensor], method: str,
             ) -> tuple[dict[str, torch.Tensor], list[list]]:
    """The blob tensors and the table ``[[name, shape, kind], ...]`` (kind: base, exact, int8,
    sign) of ``exact`` against ``base`` (canonical float32 CPU tensors)."""
    if method not in METHODS:
        raise ValueError(f"compress {method!r} is not one of {METHODS}")
    blob: dict[str, torch.Tensor] = {}
    table: list[list] = []
    for name, w in exact.tensors.items():
        b = base.get(name)
        w = w.to(torch.float32)
        if b is None or tuple(b.shape) != tuple(w.shape):
            kind = "exact"
        else:
            d = w - b.to(torch.float32)
            if not bool(d.any()):
                kind = "base"
            elif w.dim() < 2:
                kind = "exact"
            else:
                kind = method
        if kind == "exact":
            blob[f"{name}:exact"] = w.contiguous()
        elif kind == "int8":
            rows = _rows(d)
            scale = rows.abs().amax(dim=1) / 127.0
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
            blob[f"{name}:codes"] = codes.reshape(w.shape).contiguous()
            blob[f"{name}:scale"] = scale.contiguous()
        elif kind == "sign":
            flat = d.reshape(-1)
            blob[f"{name}:scale"] = flat.abs().mean().reshape(1)
            bits = np.packbits((flat > 0).numpy())
            blob[f"{name}:bits"] = torch.from_numpy(bits)
        table.append([name, list(w.shape), kind])
    return blob, table


def _expected(spec: BackboneSpec, num_labels: int | None, has_pooler: bool) -> dict:
    return {p.name: p.shape for p in spec.params(num_labels, pooler=has_pooler)}


def decompress(spec: BackboneSpec, base: Mapping[str, torch.Tensor],
               blob: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> CanonicalWeights:
    """W_hat = W_base + dequant(delta), validated against the backbone and the table (a stored
    blob is read with the hostile-input-safe reader; anything inconsistent is
    :class:`InvalidWeights` naming the tensor)."""
    if meta.get("format") != FORMAT:
        raise InvalidWeights(f"not an itif delta blob (format {meta.get('format')!r}, "
                             f"expected {FORMAT!r})")
    labels, has_pooler = head_of(meta)
    try:
        table = json.loads(meta["tensors"])
        if not isinstance(table, list) or not all(
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                and isinstance(e[1], list) and all(isinstance(n, int) for n in e[1])
                and e[2] in _KINDS for e in table):
            raise ValueError("bad table")
    except (KeyError, ValueError, TypeError) as e:
        raise InvalidWeights(f"delta blob metadata is corrupt ({e})") from None
    expected = _expected(spec, labels, has_pooler)
    names = [e[0] for e in table]
    if len(set(names)) != len(names) or set(names) != set(expected):
        missing, extra = set(expected) - set(names), set(names) - set(expected)
        raise InvalidWeights(f"delta blob tensors do not match backbone {spec.name!r}: missing "
                             f"{sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def part(name: str, suffix: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        key = f"{name}:{suffix}"
        t = blob.get(key)
        if t is None or t.dtype != dtype or tuple(t.shape) != shape:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise InvalidWeights(f"delta blob tensor {shown(key)}: expected {dtype} {shape}, "
                                 f"got {got}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidWeights(f"delta blob tensor {shown(key)} holds NaN/Inf")
        used.add(key)
        return t

    for name, shape, kind in table:
        shape = tuple(shape)
        if shape != tuple(expected[name]):
            raise InvalidWeights(f"delta blob tensor {shown(name)} has shape {shape}; backbone "
                                 f"{spec.name!r} expects {tuple(expected[name])}")
        b = base.get(name)
        if kind != "exact" and (b is None or tuple(b.shape) != shape):
            raise InvalidWeights(f"delta blob tensor {shown(name)} is a delta against a base "
                                 "tensor this base does not have (another base?)")
        if kind == "exact":
            out[name] = part(name, "exact", torch.float32, shape)
        elif kind == "base":
            out[name] = b
        elif kind == "int8":
            codes = part(name, "codes", torch.int8, shape)
            scale = part(name, "scale", torch.float32, (shape[0],))
            d = _rows(codes).to(torch.float32) * scale[:, None]
            out[name] = (b.to(torch.float32) + d.reshape(shape)).contiguous()
        else:
            n = math.prod(shape)
            bits = part(name, "bits", torch.uint8, ((n + 7) // 8,))
            scale = part(name, "scale", torch.float32, (1,))
            signs = np.unpackbits(bits.numpy(), count=n).astype(np.float32) * 2.0 - 1.0
            d = torch.from_numpy(signs).reshape(shape) * scale
            out[name] = (b.to(torch.float32) + d).contiguous()
    extra = set(blob) - used
    if extra:
        raise InvalidWeights(f"delta blob holds tensors its table does not name: "
                             f"{sorted(extra)[:3]}")
    return CanonicalWeights({n: out[n] for n in names}, labels, has_pooler)


def make_meta(exact: CanonicalWeights, table: list[list], method: str, base: str,
              base_sha256: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "compress": method,
        "base": base,
        "base_sha256": base_sha256,
        "num_labels": str(exact.num_labels or ""),
        "has_pooler": "1" if exact.has_pooler else "0",
        "tensors": json.dumps(table, separators=(",", ":")),
    }


def report_of(blob: Mapping[str, torch.Tensor], meta: Mapping[str, str],
              error: float | None = None, output: str | None = None) -> DeltaReport:
    """The report of a blob (``error``/``output``: measured now; else those its metadata
    recorded at upload)."""
    return _report({k: t.numel() * t.element_size() for k, t in blob.items()}, meta, error,
                   output)


def head_of(meta: Mapping[str, str]) -> tuple[int | None, bool]:
    """(num_labels, has_pooler) a blob's metadata records."""
    try:
        return (int(meta["num_labels"]) if meta["num_labels"] else None,
                meta["has_pooler"] == "1")
    except (KeyError, ValueError, TypeError) as e:
        raise InvalidWeights(f"delta blob metadata is corrupt ({e})") from None


def check_base(meta: Mapping[str, str], base: str, base_sha256: str) -> None:
    """InvalidWeights unless the blob was taken against ``base`` as it is now (its sha256)."""
    was = meta.get("base_sha256", "")
    if was != base_sha256:
        raise InvalidWeights(
            f"this delta was compressed against base {shown(base)} with sha256 {was[:12]}, "
            f"which now has {base_sha256[:12] or 'other weights'}: upload the fine-tune again")


def stored_report(path: str | os.PathLike) -> tuple[DeltaReport, dict[str, str]]:
    """(the report, the metadata) of a stored blob from its header alone (no tensor is read):
    what a tenant on disk shows before it is loaded, and the base sha256 it was taken against.
    InvalidWeights for a file that is not a delta blob or whose metadata is corrupt."""
    from itif.safetensors_io import read_header, read_metadata  # noqa: PLC0415

    meta = read_metadata(Path(path))
    if meta.get("format") != FORMAT:
        raise InvalidWeights(f"{Path(path).name} is not an itif delta blob")
    try:
        sizes = {n: info.nbytes for n, info in read_header(Path(path)).items()}
        return _report(sizes, meta), meta
    except (KeyError, ValueError, TypeError) as e:
        raise InvalidWeights(f"delta blob metadata is corrupt ({e})") from None


def _report(stored: Mapping[str, int], meta: Mapping[str, str], error: float | None = None,
            output: str | None = None) -> DeltaReport:
    table = json.loads(meta["tensors"])
    method = meta["compress"]
    nbytes = {n: math.prod(shape) * 4 for n, shape, _ in table}
    matrices = {n for n, _, k in table if k == method}
    if error is None:
        error, output = float(meta.get("max_abs_error", "nan")), meta.get("error_output", "")
    return DeltaReport(
        compress=method, base=meta["base"], max_abs_error=error, output=output or "",
        exact_bytes=sum(nbytes.values()), stored_bytes=sum(stored.values()),
        matrix_exact_bytes=sum(nbytes[n] for n in matrices),
        matrix_stored_bytes=sum(v for k, v in stored.items() if k.rsplit(":", 1)[0] in matrices),
        shared=sum(k == "base" for _, _, k in table))


# ---- the blob file ------------------------------------------------------------------------
def to_bytes(weights: DeltaWeights) -> bytes:
    """The blob as one safetensors file (the reference writer)."""
    from safetensors.torch import save  # noqa: PLC0415

    return save(dict(weights.blob), metadata=dict(weights.meta))


def read_blob(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a stored blob, through the hostile-input-safe reader."""
    from itif.safetensors_io import load_safetensors, read_metadata  # noqa: PLC0415

    meta = read_metadata(Path(path))
    if meta.get("format") != FORMAT:
        raise InvalidWeights(f"{Path(path).name} is not an itif delta blob (a compress tenant "
                             "stores its compressed form)")
    return load_safetensors(Path(path)), meta


def replace_upload(upload, weights: DeltaWeights) -> str:
    """Make a sealed upload (``itif.weights.blobstore.Upload``, the full checkpoint) commit the
    compressed blob instead: its temp file is rewritten (fsynced) and the digest the commit
    records is the blob's. Returns that digest (what the tenant's ``sha256`` reports)."""
    return upload.replace_content(to_bytes(weights))


# ---- measuring ------------------------------------------------------------------------------
def probe_requests(spec: BackboneSpec, max_seq_len: int, tenant: str, output: str) -> list[Request]:
    """The fixed probe batch the error is measured on (seeded; ids over the whole vocab)."""
    rng = np.random.default_rng(PROBE_SEED)
    if spec.is_text:
        return [Request(tenant, input_ids=rng.integers(0, spec.vocab_size, min(n, max_seq_len)),
                        outputs=(output,)) for n in PROBE_LENGTHS]
    shape = (spec.num_channels, spec.image_size, spec.image_size)
    return [Request(tenant, pixel_values=rng.standard_normal(shape).astype(np.float32),
                    outputs=(output,)) for _ in range(2)]


def check_error(tenant: str, report: DeltaReport, limit: float) -> None:
    """InvalidWeights when the measured error exceeds ``limit`` (the tenant's max_error)."""
    if not report.max_abs_error <= limit:  # NaN refused too
        raise InvalidWeights(
            f"tenant {tenant!r}: compress {report.compress} measured a max abs {report.output} "
            f"difference of {report.max_abs_error:.4g} on the probe batch, above its max_error "
            f"{limit:g}; nothing was stored (raise tenants[].max_error, or use compress: "
            f"{'int8' if report.compress == 'sign' else 'none'})")
