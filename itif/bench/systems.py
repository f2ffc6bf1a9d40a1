"""The systems ``itif bench`` compares, all on the same tenants' weights and the same inputs.

Contract of a system: ``load(requests)`` stages one workload's inputs (untimed); ``run()``
answers every request once and returns when the outputs are on the host (timed; a system that
times itself returns its own milliseconds); ``logits()`` gives the last run's logits in request
order (for the same-weights check); ``close()`` frees it.

- ``itif``: one :class:`~itif.Engine` holding every tenant, one fused forward per run (one system
  per planner strategy, all sharing the engine);
- ``seq``: one engine per tenant holding only that tenant ("one model instance per tenant"),
  tenants run one after another (the thesis' SEQ);
- ``multi_stream``: the same per-tenant engines, each tenant on its own thread and, on CUDA, its
  own ``torch.cuda.Stream``;
- ``hf``: one Hugging Face ``transformers`` model per tenant, eager PyTorch (no compile), each
  tenant's requests as one padded batch with an attention mask, tenants one after another;
- ``mps``: one process per tenant under NVIDIA MPS (:mod:`itif.bench.mps`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from itif.runtime.engine import Engine, Request

__all__ = ["System", "Fused", "Seq", "MultiStream", "HF", "measure", "by_tenant"]


def by_tenant(requests: list[Request]) -> dict[str, list[int]]:
    """Request indices per tenant, tenants in first-seen order."""
    out: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        out[r.tenant].append(i)
    return dict(out)


class System:
    name = "system"
    strategy: str | None = None

    def load(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def run(self) -> float | None:
        raise NotImplementedError

    def logits(self) -> np.ndarray | None:
        return None

    def close(self) -> None:
        pass


class Fused(System):
    """The fused engine with one planner strategy."""

    name = "itif"

    def __init__(self, engine: Engine, strategy: str) -> None:
        self.engine, self.strategy = engine, strategy
        self._reqs: list[Request] = []
        self._out = None

    def load(self, requests):
        self._reqs = requests

    def run(self):
        self._out = self.engine.infer(self._reqs, strategy=self.strategy)

    def logits(self):
        return None if self._out is None else np.stack([r.logits for r in self._out])


class _PerTenant(System):
    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines
        self.strategy = next(iter(engines.values())).strategy
        self._groups: dict[str, list[int]] = {}
        self._reqs: dict[str, list[Request]] = {}
        self._out: dict[str, list] = {}
        self._n = 0

    def load(self, requests):
        self._groups = by_tenant(requests)
        self._reqs = {t: [requests[i] for i in idx] for t, idx in self._groups.items()}
        self._n = len(requests)
        self._out = {}

    def logits(self):
        if not self._out:
            return None
        out = [None] * self._n
        for t, idx in self._groups.items():
            for i, r in zip(idx, self._out[t]):
                out[i] = r.logits
        return np.stack(out)


class Seq(_PerTenant):
    """One engine per tenant, tenants one after another."""

    name = "seq"

    def run(self):
        for t, reqs in self._reqs.items():
            self._out[t] = self.engines[t].infer(reqs)


class MultiStream(_PerTenant):
    """One engine per tenant, each on its own thread (and CUDA stream)."""

    name = "multi_stream"

    def __init__(self, engines: dict[str, Engine], device: torch.device) -> None:
        super().__init__(engines)
        self._pool = ThreadPoolExecutor(max(1, len(engines)), thread_name_prefix="bench-stream")
        self._streams = ({t: torch.cuda.Stream(device) for t in engines}
                         if device.type == "cuda" else None)

    def _one(self, t: str):
        if self._streams is None:
            return self.engines[t].infer(self._reqs[t])
        # The current stream is per thread: every kernel of this tenant's forward, its uploads
        # and the final device-to-host copy (which synchronises) go to this tenant's stream.
        with torch.cuda.stream(self._streams[t]):
            return self.engines[t].infer(self._reqs[t])

    def run(self):
        futs = {t: self._pool.submit(self._one, t) for t in self._reqs}
        for t, f in futs.items():
            self._out[t] = f.result()

    def close(self):
        self._pool.shutdown(wait=True)


class HF(System):
    """One ``transformers`` model per tenant, eager, tenants one after another."""

    name = "hf"

    def __init__(self, models: dict[str, torch.nn.Module], is_text: bool,
                 device: torch.device) -> None:
        self.models, self.is_text, self.device = models, is_text, device
        self._groups: dict[str, list[int]] = {}
        self._inputs: dict[str, dict[str, torch.Tensor]] = {}
        self._out: dict[str, np.ndarray] = {}
        self._n = 0
        first = next(iter(models.values()))
        self.attn_implementation = getattr(first.config, "_attn_implementation", None)

    def load(self, requests):
        self._groups = by_tenant(requests)
        self._n = len(requests)
        self._out = {}
        self._inputs = {}
        for t, idx in self._groups.items():
            rs = [requests[i] for i in idx]
            if not self.is_text:
                px = np.stack([np.asarray(r.pixel_values, np.float32) for r in rs])
                self._inputs[t] = dict(pixel_values=torch.from_numpy(px))
                continue
            L = max(len(r.input_ids) for r in rs)
            ids = torch.zeros(len(rs), L, dtype=torch.long)
            mask = torch.zeros(len(rs), L, dtype=torch.long)
            for j, r in enumerate(rs):
                ids[j, : len(r.input_ids)] = torch.as_tensor(np.asarray(r.input_ids))
                mask[j, : len(r.input_ids)] = 1
            self._inputs[t] = dict(input_ids=ids, attention_mask=mask)

    @torch.inference_mode()
    def run(self):
        # Inputs go to the device and logits come back inside the timed region, as the engines'.
        for t, inputs in self._inputs.items():
            model = self.models[t]
            dtype = next(model.parameters()).dtype
            kw = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items()}
            self._out[t] = model(**kw).logits.float().cpu().numpy()

    def logits(self):
        if not self._out:
            return None
        out = [None] * self._n
        for t, idx in self._groups.items():
            for i, row in zip(idx, self._out[t]):
                out[i] = row
        return np.stack(out)


def measure(systems: list[System], repeats: int, warmup: int = 1,
            on_error=None) -> dict[int, list[float]]:
    """Milliseconds of ``repeats`` runs of every system (after ``warmup`` runs), interleaved
    round-robin with a rotating start so drift on a shared machine hits every system alike.
    A system that raises is dropped; ``on_error(system, exc)`` hears of it."""
    live = list(systems)
    times: dict[int, list[float]] = {id(s): [] for s in systems}

    def call(s: System) -> float | None:
        try:
            t0 = time.perf_counter()
            own = s.run()
            return float(own) if own is not None else (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - one failing baseline must not stop the others
            live.remove(s)
            if on_error is not None:
                on_error(s, e)
            return None

    for s in list(live):
        for _ in range(warmup):
            if s in live:
                call(s)
    for r in range(repeats):
        order = list(live)
        k = r % max(1, len(order))
        for s in order[k:] + order[:k]:
            if s in live:
                ms = call(s)
                if ms is not None:
                    times[id(s)].append(ms)
    return times
