"""CUDA graphs of the fused forward, one per batch structure (``PreparedBatch.key``).

A forward of BERT-base issues hundreds of launches; on a fast GPU launching them from Python
costs far more than running them. A captured structure (the same tenants, layout and outputs
against the same weight-store version) copies its host buffers into the graph's static device
buffers (one non-blocking copy each) and replays it: one launch. A capture is run eagerly twice
on a side stream first (warm-up: kernel builds, cuBLAS workspaces), then captured into a
``torch.cuda.CUDAGraph``: on an H100 it costs several eager forwards.

When to capture is a rent-or-buy choice. Under a serving load most structures never come back
(lengths, tenants and batch sizes all vary): capturing each one on first sight made every batch
pay a capture, and the daemon served bert-base x16 at 136-217 req/s on an H100
(bench/results/gpu-h100-2026-11-26-serve/serve-before.json). So ``policy="rent"`` (the
engine's ``cuda_graphs="auto"``) runs a structure eagerly until the eager forwards it has cost
reach what its capture costs (about ``ratio`` of them; the ratio is measured on each capture,
capture time over the structure's fastest eager forward, and kept as a running average), then
captures it: a structure that repeats is captured after a few sightings, one that never repeats
never is, and neither pays more than about twice what the better choice made in hindsight
would have. ``policy="first"`` (``cuda_graphs="on"``) captures every structure on first sight:
the choice for a workload that repeats one structure (benchmarks). The eager counts live in a
bounded LRU (``max_tracked``): a structure not seen for that many others starts over.

The key holds the store's view version, so a graph never outlives the weights it was captured
on: when the store publishes a new view, graphs of older versions are dropped. At most
``max_graphs`` are kept (least recently used first out). A structure whose capture fails is
remembered and runs eagerly from then on (logged once). Callers serialise ``run`` and read the
returned output before the next call (the engine holds a lock): the output lives in the graph's
memory and the next replay overwrites it.

Several engines may replay at once (one per thread and stream, as the multi_stream baseline
does). A captured GEMM bakes in the cuBLAS workspace of the stream it was captured on, and
torch's default capture stream is one per process: graphs of different engines captured there
would share one workspace, and replaying them concurrently would race on it (seen on an H100:
ALBERT-large per-tenant engines run concurrently gave wrong logits). So each cache captures on
its own stream, in ``thread_local`` error mode (other threads' CUDA calls stay legal), and
captures are serialised process-wide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from itif.backbones.spec import BackboneSpec
from itif.runtime import forward
from itif.runtime.batch import PreparedBatch

log = logging.getLogger("itif.graphs")
_CAPTURE = threading.Lock()  # one capture at a time in the process


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ints: torch.Tensor
    floats: torch.Tensor | None
    out: torch.Tensor


POLICIES = ("rent", "first")


class GraphCache:
    def __init__(self, device: torch.device, max_graphs: int = 32, warmup: int = 2,
                 policy: str = "rent", max_tracked: int = 4096) -> None:
        if policy not in POLICIES:
            raise ValueError(f"graph policy {policy!r} is not one of {POLICIES}")
        self.device = device
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.policy = policy
        self.max_tracked = max_tracked
        # capture seconds over the structure's fastest eager forward: the warm-ups, the capture
        # and the graph's instantiation (a prior until the first capture measures it)
        self.ratio = float(warmup + 2)
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._eager: OrderedDict[tuple, list] = OrderedDict()  # key -> [forwards, fastest s]
        self._failed: set[tuple] = set()
        self._version = -1
        self.lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.captures = 0
        self.replays = 0
        self.eager = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._eager.clear()
        self._failed.clear()

    def stats(self) -> dict:
        return dict(policy=self.policy, graphs=len(self._graphs), captures=self.captures,
                    replays=self.replays, eager=self.eager, ratio=round(self.ratio, 2))

    def run(self, spec: BackboneSpec, b: PreparedBatch) -> torch.Tensor:
        """The flat output of ``b`` on the device: a replay of its structure's graph, a capture
        and replay, or an eager forward (see the module's docstring for which)."""
        version = b.key[0]
        if version != self._version:  # the store published new weights: old graphs are stale
            self.clear()
            self._version = version
        g = self._graphs.get(b.key)
        if g is not None:
            self._graphs.move_to_end(b.key)
            g.ints.copy_(b.host_ints, non_blocking=True)
            if g.floats is not None:
                g.floats.copy_(b.host_floats, non_blocking=True)
        else:
            seen = self._eager.get(b.key)
            if b.key in self._failed or (self.policy == "rent"
                                         and (seen is None or seen[0] < self.ratio)):
                return self._run_eagerly(spec, b, seen)
            t0 = time.perf_counter()
            g = self._capture(spec, b)
            if g is None:
                return self._run_eagerly(spec, b, seen)
            self._eager.pop(b.key, None)  # an evicted graph's structure pays its rent again
            if seen is not None:  # the measured price of a capture, in its fastest eager forwards
                ratio = (time.perf_counter() - t0) / seen[1]
                self.ratio = min(50.0, max(1.0, 0.5 * self.ratio + 0.5 * ratio))
        g.graph.replay()
        self.replays += 1
        return g.out

    def _run_eagerly(self, spec: BackboneSpec, b: PreparedBatch, seen: list | None) -> torch.Tensor:
        t0 = time.perf_counter()
        ints, floats = b.upload(self.device)
        out = forward.run(spec, b, ints, floats)
        s = time.perf_counter() - t0  # host time: the launches (a forward here is launch-bound)
        self.eager += 1
        if b.key in self._failed:
            return out
        if seen is None:
            self._eager[b.key] = [1, s]
            while len(self._eager) > self.max_tracked:
                self._eager.popitem(last=False)
        else:
            seen[0] += 1
            seen[1] = min(seen[1], s)
            self._eager.move_to_end(b.key)
        return out

    def _capture(self, spec: BackboneSpec, b: PreparedBatch) -> _Graph | None:
        ints = b.host_ints.to(self.device, non_blocking=True)
        floats = (None if b.host_floats is None
                  else b.host_floats.to(self.device, non_blocking=True))
        try:
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)
            with _CAPTURE:
                with torch.cuda.stream(self._stream):  # warm-up on this cache's own stream
                    for _ in range(self.warmup):
                        forward.run(spec, b, ints, floats)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self._stream,
                                      capture_error_mode="thread_local"):
                    out = forward.run(spec, b, ints, floats)
            current.wait_stream(self._stream)
        except Exception as e:  # noqa: BLE001 - any capture failure: run this one eagerly
            self._failed.add(b.key)
            log.warning("CUDA graph capture failed (%s: %s); this batch shape runs eagerly",
                        type(e).__name__, e)
            return None
        g = _Graph(graph, ints, floats, out)
        self._graphs[b.key] = g
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g
