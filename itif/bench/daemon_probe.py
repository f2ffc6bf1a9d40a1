"""What a running daemon is doing, read from outside it: CPU time from ``/proc`` (its own, its
children's) and its counters from its Prometheus ``/metrics`` (the serving sweep's per-point
figures, ``itif.bench.serving``; the reliability and metrics tests scrape through it too)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("itif.bench")


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cpu_seconds(stat: Path) -> float | None:
    """User plus system CPU time from a ``/proc`` stat file (None once it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of process ``pid``, all its threads (Linux ``/proc``)."""
    return _cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User plus system CPU time of each live thread of process ``pid``, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        cpu = _cpu_seconds(task / "stat")
        if cpu is not None:  # None: the thread ended meanwhile
            out[int(task.name)] = cpu
    return out


def thread_cpu_by_name(pid: int, before: dict[int, float], after: dict[int, float]
                       ) -> dict[str, float]:
    """CPU seconds each thread name of process ``pid`` spent between two
    :func:`thread_cpu_seconds` readings (its OS name: ``itif.threadnames``; the process's own
    thread is ``main``; threads of one name summed; names of threads gone by now: ``?``)."""
    out: dict[str, float] = {}
    for tid, cpu in after.items():
        if tid == pid:
            name = "main"
        else:
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                name = "?"
        out[name] = out.get(name, 0.0) + cpu - before.get(tid, 0.0)
    return out


_FIGURES = {  # figure -> (metric sample, label that must match, or None: summed over all)
    "batches": ("itif_batch_size_count", None),
    "batch_rows": ("itif_batch_size_sum", None),
    "row_compute_s": ("itif_compute_seconds_sum", None),
    "rows_computed": ("itif_compute_seconds_count", None),
    "graph_replays": ("itif_cuda_graph_forwards_total", ("path", "replay")),
    "graph_eager": ("itif_cuda_graph_forwards_total", ("path", "eager")),
    "graph_captures": ("itif_cuda_graph_captures_total", None),
    "column_rows": ("itif_column_rows_total", None),
    "column_forward_cpu_s": ("itif_column_forward_cpu_seconds_total", None),
}


def scrape_metrics(port: int) -> dict[tuple[str, frozenset], float]:
    """A daemon's /metrics on 127.0.0.1:``port`` as {(sample name, labels): value}."""
    import urllib.request  # noqa: PLC0415

    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def daemon_figures(port: int) -> dict[str, float] | None:
    """:data:`_FIGURES` from a daemon's /metrics (absent series count 0; None when the scrape
    fails)."""
    try:
        samples = scrape_metrics(port)
    except OSError as e:
        log.warning("scraping the metrics on port %d failed: %s", port, e)
        return None
    return {key: sum(v for (n, labels), v in samples.items()
                     if n == name and (label is None or label in labels))
            for key, (name, label) in _FIGURES.items()}


def batch_figures(before: dict | None, after: dict | None) -> dict:
    """What the daemon did between two :func:`daemon_figures` readings: its batches, their mean
    size, the mean forward time a row waited on, and the forwards by CUDA graph path."""
    if not before or not after:
        return {}
    d = {k: after[k] - before[k] for k in after}
    out = {"batches": int(d["batches"]),
           "mean_batch_size": round(d["batch_rows"] / d["batches"], 2) if d["batches"] else None,
           "row_compute_ms": (round(1e3 * d["row_compute_s"] / d["rows_computed"], 3)
                              if d["rows_computed"] else None)}
    if d["graph_replays"] or d["graph_eager"] or d["graph_captures"]:
        out.update(graph_replays=int(d["graph_replays"]), graph_eager=int(d["graph_eager"]),
                   graph_captures=int(d["graph_captures"]))
    return out
