"""Cold first responses of ``itif bench --suites tenants`` (run by ``--scale-kinds daemon``
after the uploads; see ``itif.bench.tenant_scale``'s docstring for what is measured): tenants
registered on disk in a daemon with device and host tiers, one request at a time to tenants on
disk, on host and resident, each answer checked against PEFT / Hugging Face."""

from __future__ import annotations

import time

import numpy as np
import torch

from itif.backbones.spec import load_spec
from itif.bench.tenant_kinds import (
    COLD_SOURCES,
    Kind,
    ScaleSettings,
    log,
    lora_adapter,
    tenant_name,
)
from itif.bench.tenant_kinds import pct as _pct
from itif.bench.tenants import tenant_weights

__all__ = ["COLD_SOURCES", "run_cold", "run_colds"]



def _lat_stats(ms: list[float]) -> dict:
    return dict(n=len(ms), p50_ms=_pct(ms, 50), p99_ms=_pct(ms, 99),
                max_ms=round(float(max(ms)), 3) if ms else None)


def _cold_budgets(spec, kind: Kind, device_n: int, host_n: int) -> tuple[int, int]:
    """(device_weight_bytes, host_weight_bytes) that hold ``device_n`` / ``host_n`` tenants of
    ``kind`` (LoRA: the device budget holds the base too), measured on a scratch Engine: the
    first full tenant brings the tensors all of them share (the embeddings), which the store
    and the host tier hold once; half a tenant's bytes of slack."""
    from itif.runtime.engine import Engine  # noqa: PLC0415

    eng = Engine(spec, device="cpu", dtype="float32")
    kind.prepare(eng)
    before = eng.weight_bytes
    kind.add(eng, 0)
    first = eng.weight_bytes - before
    kind.add(eng, 1)
    per = eng.weight_bytes - before - first
    if kind.kind == "lora":
        return before + device_n * per + per // 2, host_n * per + per // 2
    return first + (device_n - 1) * per + per // 2, first + (host_n - 1) * per + per // 2


def run_cold(cfg: ScaleSettings, kind_name: str = "lora", tenants: int | None = None) -> dict:
    """One ``cold_<kind>`` row (module docstring): ``tenants`` (default ``cold_tenants``, or
    ``cold_full`` for ``full``) registered on disk in a daemon with tiers, then first responses
    from each source tier against the resident baseline."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from itif.backbones.lora_tenants import CONFIG_KEY  # noqa: PLC0415
    from itif.bench.tenants import to_hf  # noqa: PLC0415
    from itif.config import hash_token, parse_config  # noqa: PLC0415
    from itif.daemon import Daemon, Identity  # noqa: PLC0415
    from itif.metrics import Metrics  # noqa: PLC0415
    from itif.requests import Request  # noqa: PLC0415
    from itif.safetensors_io import save_safetensors  # noqa: PLC0415
    from itif.weights.tiers import Tier  # noqa: PLC0415

    spec = load_spec(cfg.model)
    n = tenants if tenants is not None else (cfg.cold_full if kind_name == "full"
                                             else cfg.cold_tenants)
    kind = Kind(kind_name, spec, cfg.lora_rank, base="base", base_mode="full")
    reference = kind.reference()
    rng = np.random.default_rng(cfg.seed + 1)
    dev_bytes, host_bytes = _cold_budgets(spec, kind, cfg.cold_device, cfg.cold_host)
    names = [tenant_name(kind_name, i) for i in range(n)]
    admin = Identity(None, admin=True)
    with tempfile.TemporaryDirectory(prefix="itif-bench-cold-") as tmp:
        tmp = Path(tmp)
        lines = ["server:", "  listen: 127.0.0.1:0", "  data_dir: ./data",
                 f"  admin_token_sha256: {hash_token('admin')}", "backbone:",
                 f"  config: {cfg.model}", f"  device: {cfg.device}", f"  dtype: {cfg.dtype}",
                 f"  device_weight_bytes: {dev_bytes}", f"  host_weight_bytes: {host_bytes}",
                 "scheduler:", "  max_wait_ms: 1", "tenants:"]
        if kind_name == "lora":
            lines.append(f"  - id: base\n    token_sha256: {hash_token('base')}\n    pinned: true")
        lines += [f"  - id: {t}\n    token_sha256: {hash_token('t-' + t)}"
                  + ("\n    base: base" if kind_name == "lora" else "") for t in names]
        d = Daemon(parse_config("\n".join(lines) + "\n", tmp))
        d.metrics = Metrics(d, nvml=None)

        def commit(name: str, tensors: dict, metadata=None) -> None:
            path = tmp / "blob.safetensors"
            save_safetensors(tensors, path, metadata=metadata)
            data = path.read_bytes()
            with d.blobs.begin_upload(name, hashlib.sha256(data).hexdigest(), len(data)) as up:
                up.write(data)
                up.commit()

        t0 = time.perf_counter()
        if kind_name == "lora":
            commit("base", to_hf(spec, tenant_weights(spec, 0, "full")))
        for i, t in enumerate(names):  # what a restart finds: every tenant's blob on disk
            if kind_name == "lora":
                config_i, tensors = lora_adapter(spec, i, cfg.lora_rank)
                commit(t, tensors, {CONFIG_KEY: json.dumps(config_i, sort_keys=True)})
            else:
                commit(t, to_hf(spec, tenant_weights(spec, i, "full")))
        blobs_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        d.start()
        start_s = time.perf_counter() - t0
        registry = d.metrics.registry

        def promoted(source: str) -> float:
            return registry.get_sample_value(
                "itif_tier_promotions_total", {"source": source, "result": "ok"}) or 0.0

        worst = [0.0]

        def ask(t: str) -> float:
            ids = rng.integers(0, spec.vocab_size, min(cfg.cold_length, spec.max_position))
            t0 = time.perf_counter()
            (res,) = d.infer(admin, t, [Request(t, input_ids=ids, outputs=("logits",))],
                             timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            want = reference(int(t[len(kind_name):]), torch.as_tensor(ids, dtype=torch.long)[None])
            worst[0] = max(worst[0], float(np.abs(res.logits - want).max()))
            return ms

        fresh = list(names)  # never asked: on disk
        rng.shuffle(fresh)
        asked: list[str] = []
        lat: dict[str, list[float]] = {s: [] for s in COLD_SOURCES}
        warm_after: list[float] = []
        cold = counted = 0
        try:
            # steady state first: the device tier full and the host tier filling (these first
            # responses are from disk too, checked and counted, not in the figures)
            for _ in range(min(cfg.cold_device + cfg.cold_host // 2, len(fresh) // 2)):
                t = fresh.pop()
                before, m0 = d.tiers.view(t), promoted("disk")
                ms = ask(t)
                asked.append(t)
                cold += 1
                counted += (d.tiers.view(t).promotions == before.promotions + 1
                            and promoted("disk") == m0 + 1)
                time.sleep(ms / 1e3)
            warmup = cold
            for _ in range(cfg.cold_samples * 20):
                if all(len(v) >= cfg.cold_samples for v in lat.values()):
                    break
                for src in COLD_SOURCES:
                    if len(lat[src]) >= cfg.cold_samples:
                        continue
                    if src == "disk" and fresh:
                        t = fresh.pop()
                    else:
                        there = [a for a in asked if d.tiers.view(a).tier is Tier(src)]
                        if not there:
                            continue
                        t = there[int(rng.integers(len(there)))]
                    before = d.tiers.view(t)
                    if before.tier is not Tier(src):
                        continue
                    m0 = promoted(src) if src != "device" else 0.0
                    ms = ask(t)
                    if t not in asked:
                        asked.append(t)
                    lat[src].append(ms)
                    if src == "device":
                        continue
                    cold += 1
                    counted += (d.tiers.view(t).promotions == before.promotions + 1
                                and promoted(src) == m0 + 1)
                    warm_after.append(ask(t))  # the same tenant again, resident now
                    time.sleep(ms / 1e3)  # the loader's duty cycle (loader_share 0.5) is over
            totals = d.tiers.totals()
            hist = {s: (registry.get_sample_value("itif_tier_promotion_seconds_sum", {"source": s}),
                        registry.get_sample_value("itif_tier_promotion_seconds_count",
                                                  {"source": s}))
                    for s in ("disk", "host")}
        finally:
            d.stop(0)
    first = {s: _lat_stats(v) for s, v in lat.items()}
    warm = first["device"]

    def ratio(src: str, q: str):
        a, b = first[src][q], warm[q]
        return round(a / b, 2) if a is not None and b else None

    row = dict(suite="tenants", model=cfg.model, kind=f"cold_{kind_name}", device=cfg.device,
               dtype=cfg.dtype, lora_rank=cfg.lora_rank if kind_name == "lora" else None,
               tenants=n, status="cold", device_weight_bytes=dev_bytes,
               host_weight_bytes=host_bytes, device_holds=cfg.cold_device,
               host_holds=cfg.cold_host, request_tokens=cfg.cold_length,
               blobs_s=round(blobs_s, 2), start_s=round(start_s, 2),
               first_response=first, warm_after_promotion=_lat_stats(warm_after),
               ratio_p50={s: ratio(s, "p50_ms") for s in ("disk", "host")},
               ratio_p99={s: ratio(s, "p99_ms") for s in ("disk", "host")},
               promotion_ms={s: dict(count=int(c or 0),
                                     mean_ms=round(1e3 * sm / c, 3) if c else None)
                             for s, (sm, c) in hist.items()},
               warmup_requests=warmup, cold_requests=cold, promotions_counted=int(counted),
               answers=sum(len(v) for v in lat.values()) + len(warm_after),
               max_abs_diff=worst[0],
               tiers_at_end={k: totals[k] for k in ("device_tenants", "host_tenants",
                                                    "disk_tenants", "device_bytes",
                                                    "host_bytes")})
    log.info("tenants cold_%s x%d: first response p50/p99 ms: disk %s/%s, host %s/%s, resident "
             "%s/%s (ratio p50 disk %s, host %s); %d/%d promotions counted, max abs diff %.2e",
             kind_name, n, first["disk"]["p50_ms"], first["disk"]["p99_ms"],
             first["host"]["p50_ms"], first["host"]["p99_ms"], warm["p50_ms"], warm["p99_ms"],
             row["ratio_p50"]["disk"], row["ratio_p50"]["host"], counted, cold, worst[0])
    return row


def run_colds(cfg: ScaleSettings) -> list[dict]:
    """The cold rows of ``cfg``: LoRA (``cold_tenants``), then full (``cold_full``)."""
    rows = []
    for kind_name, n in (("lora", cfg.cold_tenants), ("full", cfg.cold_full)):
        if n > 0:
            rows.append(run_cold(cfg, kind_name, n))
    return rows
