"""PNG plots of a result: Table 5.2 latencies, speedup vs tenants (ours beside the thesis'),
throughput vs requests per tenant (Fig. 5.3/5.4's axes), serving latency vs load, add time and
resident-memory ratio vs registered tenants (the tenants suite), requests per second of the
CPU peer suite's systems (issue 65)."""

from __future__ import annotations

from pathlib import Path

from itif.batching.strategies import DEFAULT_STRATEGY
from itif.bench.thesis import THESIS_TABLE_5_2, thesis_family

BASELINES = ("seq", "multi_stream", "mps", "hf", "hf_compiled")
COLORS = {"seq": "tab:gray", "multi_stream": "tab:blue", "mps": "tab:purple", "hf": "tab:orange",
          "hf_compiled": "tab:brown", "itif": "tab:green", "itif_nographs": "tab:olive",
          "per_tenant": "tab:red"}



def _save(plt, fig, stem: str, kind: str) -> Path:
    """Lay ``fig`` out, write it to ``<stem>-<kind>.png`` and free it; the path."""
    fig.tight_layout()
    path = Path(f"{stem}-{kind}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def _ok(rows, **match):
    return [r for r in rows if r.get("status") == "ok"
            and all(r.get(k) == v for k, v in match.items())]


def _itif_strategy(rows) -> str:
    have = {r.get("strategy") for r in rows if r.get("system") == "itif"}
    return DEFAULT_STRATEGY if DEFAULT_STRATEGY in have else (sorted(have - {None}) or [None])[0]


def _latency(rows, system, strategy, **match):
    for r in _ok(rows, system=system, **match):
        if not system.startswith("itif") or r.get("strategy") == strategy:
            return r["latency_ms"]
    return None


def make_plots(rows: list[dict], meta: dict, stem: Path) -> list[Path]:
    """Write ``<stem>-*.png``; returns the files written (none for an empty section)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = []
    device = meta.get("device", "")
    strat = _itif_strategy(rows)
    for fn in (_table, _speedup, _batch, _load, _tenants, _peer):
        path = fn(plt, rows, device, strat, stem)
        if path is not None:
            out.append(path)
    return out


def _table(plt, rows, device, strat, stem):
    table = [r for r in rows if r.get("suite") == "table"]
    models = list(dict.fromkeys(r["model"] for r in table))
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    systems = [s for s in BASELINES if _ok(table, system=s)] + ["itif"] + (
        ["itif_nographs"] if _ok(table, system="itif_nographs") else [])
    for ax, model in zip(axes[0], models):
        tenants = sorted({r["tenants"] for r in table if r["model"] == model})
        width = 0.8 / len(systems)
        for k, s in enumerate(systems):
            ys = [_latency(table, s, strat, model=model, tenants=t) for t in tenants]
            xs = [i + k * width for i in range(len(tenants))]
            ax.bar(xs, [y or 0 for y in ys], width, label=s if s != "itif" else f"itif ({strat})",
                   color=COLORS.get(s, "tab:cyan"))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))], [str(t) for t in tenants])
        ax.set_xlabel("tenants (one request each)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(model)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Table 5.2 workloads on {device}")
    return _save(plt, fig, stem, "table52")


def _speedup(plt, rows, device, strat, stem):
    pts = [r for r in rows if r.get("suite") in ("table", "scale") and r.get("system") == "itif"
           and r.get("strategy") == strat and r.get("status") == "ok"]
    models = list(dict.fromkeys(r["model"] for r in pts))
    if not models:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, model in enumerate(models):
        mine = sorted((r["tenants"], r) for r in pts if r["model"] == model)
        color = f"C{i}"
        xs = [t for t, r in mine if "speedup_vs_seq" in r]
        ax.plot(xs, [r["speedup_vs_seq"] for _, r in mine if "speedup_vs_seq" in r], "o-",
                color=color, label=f"{model}: itif / seq")
        xs = [t for t, r in mine if "speedup_vs_hf" in r]
        if xs:
            ax.plot(xs, [r["speedup_vs_hf"] for _, r in mine if "speedup_vs_hf" in r], "s:",
                    color=color, label=f"{model}: itif / hf")
        fam = thesis_family(model)
        if fam in THESIS_TABLE_5_2:
            th = THESIS_TABLE_5_2[fam]
            ax.plot(sorted(th), [th[t]["SEQ"] / th[t]["ITIF"] for t in sorted(th)], "^--",
                    color=color, alpha=0.5, label=f"thesis {fam} (RTX A5000)")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xscale("log", base=2)
    ticks = {r["tenants"] for r in pts}
    for m in models:
        ticks |= set(THESIS_TABLE_5_2.get(thesis_family(m), {}))
    ticks = sorted(ticks)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tenants (one request each)")
    ax.set_ylabel("speedup (baseline latency / itif latency)")
    ax.set_title(f"Speedup vs tenants, {device}")
    ax.legend(fontsize=7)
    return _save(plt, fig, stem, "speedup")


def _batch(plt, rows, device, strat, stem):
    batch = [r for r in rows if r.get("suite") == "batch" and r.get("status") == "ok"]
    keys = sorted({(r["model"], r["tenants"]) for r in batch})
    if not keys:
        return None
    cols = min(4, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.3 * nrows), squeeze=False)
    for ax, (model, t) in zip(axes.flat, keys):
        for s in BASELINES + ("itif",):
            pts = sorted((r["requests_per_tenant"], r["throughput_rps"])
                         for r in batch if r["model"] == model and r["tenants"] == t
                         and r["system"] == s and (s != "itif" or r["strategy"] == strat))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[s],
                        label=s if s != "itif" else f"itif ({strat})")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["requests_per_tenant"] for r in batch if r["model"] == model})
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.minorticks_off()
        ax.set_title(f"{model}, {t} tenants", fontsize=9)
        ax.set_xlabel("requests per tenant")
        ax.set_ylabel("requests / s")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Throughput vs batch (Fig. 5.3/5.4 axes), {device}")
    return _save(plt, fig, stem, "batch")


def _load(plt, rows, device, strat, stem):
    serve = [r for r in rows if r.get("suite") == "serve" and r.get("status") == "ok"]
    mixes = list(dict.fromkeys(r["mix"] for r in serve))
    if not mixes:
        return None
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        modes = list(dict.fromkeys((r["system"], r["strategy"]) for r in serve if r["mix"] == mix))
        fused = ["tab:green", "tab:olive", "tab:cyan", "tab:brown"]
        for i, (system, strategy) in enumerate(modes):
            pts = sorted((r["rate_rps"], r["p50_ms"], r["p99_ms"]) for r in serve
                         if r["mix"] == mix and r["system"] == system
                         and r["strategy"] == strategy and r["p50_ms"] is not None)
            color = COLORS["per_tenant"] if system == "per_tenant" else fused[i % len(fused)]
            label = f"{system} ({strategy})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color,
                    label=f"{label} p50")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color,
                    label=f"{label} p99")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (Poisson arrivals / s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(mix, fontsize=9)
    axes[0][0].legend(fontsize=7)
    model = serve[0]["model"]
    fig.suptitle(f"Latency vs load through the daemon\n{model}, {serve[0]['tenants']} tenants, "
                 f"{device}", fontsize=10)
    return _save(plt, fig, stem, "load")


def _tenants(plt, rows, device, strat, stem):
    pts = [r for r in rows if r.get("suite") == "tenants" and r.get("status") == "ok"]
    kinds = list(dict.fromkeys(r["kind"] for r in pts))
    if not kinds:
        return None
    cold = [r for r in rows if r.get("suite") == "tenants" and r.get("status") == "cold"]
    fig, axes = plt.subplots(1, 3 if cold else 2, figsize=(15 if cold else 10, 4))
    ax1, ax2 = axes[0], axes[1]
    if cold:
        _cold_panel(axes[2], cold)
    for i, kind in enumerate(kinds):
        mine = sorted((r["tenants"], r) for r in pts if r["kind"] == kind)
        xs = [t for t, _ in mine]
        color = f"C{i}"
        ax1.plot(xs, [r["last100_median_add_ms"] for _, r in mine], "o-", color=color,
                 label=f"{kind}: median of the last 100 adds")
        ax1.plot(xs, [r["p99_add_ms"] for _, r in mine], "x--", color=color,
                 label=f"{kind}: p99 of all adds")
        ax2.plot(xs, [r["rss_ratio"] for _, r in mine], "o-", color=color, label=kind)
    ax1.axhline(10.0, color="k", lw=0.6, ls=":", label="10 ms (issue 14)")
    ax2.axhline(1.5, color="k", lw=0.6, ls=":", label="1.5x (issue 14)")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("registered tenants")
        ax.legend(fontsize=6)
    ax1.set_yscale("log")
    ax1.set_ylabel("Engine.add_tenant; daemon_lora: whole upload (ms)")
    ax1.set_title("time per add at that count", fontsize=9)
    ax2.set_ylabel("RSS growth / (base + tenants' own bytes)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("resident memory vs the store's accounting", fontsize=9)
    for ax in axes[2:]:
        ax.legend(fontsize=6)
    fig.suptitle(f"{pts[0]['model']} tenants, {device}", fontsize=10)
    return _save(plt, fig, stem, "tenants")


def _cold_panel(ax, cold: list[dict]) -> None:
    """First-response latency by the tier the tenant's weights came from (bars: p50; x: p99),
    one group per cold row (its kind and registered tenants)."""
    sources = ("disk", "host", "device")
    width = 0.8 / len(cold)
    for k, r in enumerate(cold):
        xs = [i + k * width for i in range(len(sources))]
        first = r["first_response"]
        ax.bar(xs, [first[s]["p50_ms"] for s in sources], width, color=f"C{k}",
               label=f"{r['kind']} ({r['tenants']} registered): p50")
        ax.plot(xs, [first[s]["p99_ms"] for s in sources], "x", color="k",
                label="p99" if k == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sources))],
                  ["from disk", "from host", "resident"])
    ax.set_ylabel("submit to answer (ms)")
    ax.set_title("first response by the tier it came from", fontsize=9)


PEER_COLORS = {"itif": "tab:green", "itif_bf16": "tab:olive", "vllm": "tab:blue",
               "hf": "tab:orange"}


def _peer(plt, rows, device, strat, stem):
    """The peer suite (``itif.bench.cpu_peer``): median req/s of each system per workload, the
    fastest and slowest round as a range, and 3x the vLLM bar where issue 65 sets it."""
    pts = [r for r in rows if r.get("suite") == "peer" and r.get("status") == "ok"]
    if not pts:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in pts))
    systems = list(dict.fromkeys(r["system"] for r in pts))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for j, s in enumerate(systems):
        for i, w in enumerate(workloads):
            r = next((x for x in pts if x["system"] == s and x["workload"] == w), None)
            if r is None:
                continue
            n = r["throughput_rps"] * r["latency_ms"] / 1e3  # requests in the call
            lo, hi = n / r["latency_ms_max"] * 1e3, n / r["latency_ms_min"] * 1e3
            x = i + (j - (len(systems) - 1) / 2) * width
            ax.bar(x, r["throughput_rps"], width, color=PEER_COLORS.get(s, f"C{j}"),
                   yerr=[[r["throughput_rps"] - lo], [hi - r["throughput_rps"]]], capsize=3,
                   label=f"{s} ({r.get('dtype')})" if i == 0 else None)
            ax.annotate(f"{r['throughput_rps']:.0f}", (x, r["throughput_rps"]), ha="center",
                        va="bottom", fontsize=6, xytext=(0, 2), textcoords="offset points")
    for i, w in enumerate(workloads):
        vllm = next((x for x in pts if x["system"] == "vllm" and x["workload"] == w), None)
        if vllm is not None and vllm["tenants"] > 1:
            ax.hlines(3 * vllm["throughput_rps"], i - 0.4, i + 0.4, colors="k", ls=":",
                      label="3x the vLLM engines (issue 65)")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("requests / s (median; bars: slowest to fastest round)")
    ax.legend(fontsize=7)
    ax.set_title(f"{pts[0]['model']}, {pts[0]['requests']} requests, {device}", fontsize=9)
    return _save(plt, fig, stem, "peer")
