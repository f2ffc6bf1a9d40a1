"""CUDA graphs of the fused forward, one per batch structure (``PreparedBatch.key``).

A forward of BERT-base issues hundreds of launches; on a fast GPU launching them from Python
costs far more than running them. The first batch of a structure (the same tenants, layout and
outputs against the same weight-store version) is run eagerly twice on a side stream (warm-up:
kernel builds, cuBLAS workspaces), then captured into a ``torch.cuda.CUDAGraph`` that reads its
inputs from static device buffers. Every later batch of that structure copies its host buffers
into those static buffers (one non-blocking copy each) and replays the graph: one launch.

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


class GraphCache:
    def __init__(self, device: torch.device, max_graphs: int = 8, warmup: int = 2) -> None:
        self.device = device
        self.max_graphs = max_graphs
        self.warmup = warmup
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._failed: set[tuple] = set()
        self._version = -1
        self.lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._failed.clear()

    def run(self, spec: BackboneSpec, b: PreparedBatch) -> torch.Tensor | None:
        """The flat output of ``b`` through a graph (captured on first sight), or None when this
        structure cannot be captured (the caller runs it eagerly)."""
        version = b.key[0]
        if version != self._version:  # the store published new weights: old graphs are stale
            self.clear()
            self._version = version
        if b.key in self._failed:
            return None
        g = self._graphs.get(b.key)
        if g is None:
            g = self._capture(spec, b)
            if g is None:
                return None
        else:
            self._graphs.move_to_end(b.key)
            g.ints.copy_(b.host_ints, non_blocking=True)
            if g.floats is not None:
                g.floats.copy_(b.host_floats, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.out

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
