"""Prometheus metrics: a scripted workload on both APIs, then a scrape of /metrics over HTTP."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from itif.bench.daemon_probe import scrape_metrics as scrape
from itif.platform import nvml
from itif.safetensors_io import save_safetensors
from tests.daemon_harness import Daemon, free_port, settled_metrics
from tests.oracle import make_hf_model

tg = pytest.importorskip("tritonclient.grpc")
parser = pytest.importorskip("prometheus_client.parser")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKENS = {"acme": "acme-tok", "beta": "beta-tok"}
N_ITIF, N_KSERVE, KSERVE_BATCH = 4, 3, 2


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples, name: str, **labels) -> float:
    """Sum over the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    port = free_port()
    d = Daemon(root, dict(TOKENS), server_extra={"metrics_listen": f"127.0.0.1:{port}"}).start()
    for i, (tid, tok) in enumerate(TOKENS.items()):
        m = make_hf_model("bert-tiny", 2, seed=400 + i)
        path = root / f"{tid}.safetensors"
        save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, path)
        with d.client(tok) as c:
            c.upload(tid, path)
    yield d
    d.stop()


def _kserve_ids(ids: np.ndarray, name: str = "input_ids"):
    t = tg.InferInput(name, list(ids.shape), "INT64")
    t.set_data_from_numpy(ids)
    return t


def test_scrape_after_a_scripted_workload(daemon):
    rng = np.random.default_rng(0)
    triton = tg.InferenceServerClient(daemon.addr)
    rows = {}
    for tid, tok in TOKENS.items():
        headers = {"authorization": f"Bearer {tok}"}
        with daemon.client(tok) as c:
            for k in range(N_ITIF):
                c.infer(tid, rng.integers(0, 1000, 3 + k).tolist())
            with pytest.raises(grpc.RpcError) as e:
                c.infer(tid, [1, 10**6])  # INVALID_ARGUMENT: outside the vocabulary
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(N_KSERVE):
            triton.infer(tid, [_kserve_ids(rng.integers(0, 1000, (KSERVE_BATCH, 6)))],
                         headers=headers)
        holes = np.array([[1, 0, 1]], np.int64)
        with pytest.raises(InferenceServerException) as e:
            triton.infer(tid, [_kserve_ids(np.ones((1, 3), np.int64)),
                               _kserve_ids(holes, "attention_mask")], headers=headers)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        rows[tid] = N_ITIF + N_KSERVE * KSERVE_BATCH
    # three refused for a wrong token (two on itif, one on KServe); one for another's model
    with daemon.client("wrong") as c:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as e:
                c.infer("acme", [1, 2])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(InferenceServerException):
        triton.infer("acme", [_kserve_ids(np.ones((1, 2), np.int64))],
                     headers={"authorization": "Bearer wrong"})
    with daemon.client(TOKENS["acme"]) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.infer("beta", [1, 2])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    triton.close()

    s = settled_metrics(daemon.metrics_port)
    req = "itif_requests_total"
    for tid in TOKENS:
        assert value(s, req, tenant=tid, method="Infer", code="OK") == N_ITIF
        assert value(s, req, tenant=tid, method="ModelInfer", code="OK") == N_KSERVE
        assert value(s, req, tenant=tid, method="Infer", code="INVALID_ARGUMENT") == 1
        assert value(s, req, tenant=tid, method="ModelInfer", code="INVALID_ARGUMENT") == 1
        assert value(s, req, tenant=tid, method="UploadWeights", code="OK") == 1
        # rows queued = rows run: refused calls never reach the queue
        assert value(s, "itif_queue_seconds_count", tenant=tid) == rows[tid]
        assert value(s, "itif_compute_seconds_count", tenant=tid) == rows[tid]
        assert value(s, "itif_compute_seconds_sum", tenant=tid) > 0
        assert value(s, "itif_inference_rows_total", tenant=tid, code="OK") == rows[tid]
        assert value(s, "itif_tenant_weight_bytes", tenant=tid) > 0
        assert value(s, "itif_tenant_exclusive_weight_bytes", tenant=tid) > 0
        assert value(s, "itif_tenant_state", tenant=tid, state="READY") == 1
        assert value(s, "itif_tenant_state", tenant=tid, state="FAILED") == 0
        assert value(s, "itif_queue_depth", tenant=tid) == 0
    # refusals before any handler ran are counted too, with no tenant (the token named none)
    assert value(s, req, tenant="", method="Infer", code="UNAUTHENTICATED") == 2
    assert value(s, req, tenant="", method="ModelInfer", code="UNAUTHENTICATED") == 1
    assert total(s, req, code="UNAUTHENTICATED") == 3
    # another tenant's model: counted for the caller, never under the name it asked for
    assert value(s, req, tenant="acme", method="Infer", code="NOT_FOUND") == 1
    assert total(s, req, tenant="beta", code="NOT_FOUND") == 0
    assert value(s, "itif_request_duration_seconds_count", method="ModelInfer") == 2 * N_KSERVE + 3

    batches = value(s, "itif_batch_size_count")
    assert batches >= 1 and value(s, "itif_batch_size_sum") == sum(rows.values())
    assert value(s, "itif_batch_padding_ratio_count") == batches
    assert value(s, "itif_batch_tokens_count") == batches
    assert value(s, "itif_batch_tokens_sum") == sum(
        2 * [sum(3 + k for k in range(N_ITIF)) + N_KSERVE * KSERVE_BATCH * 6])
    assert value(s, "itif_weight_store_bytes") > 0 and value(s, "itif_ready") == 1
    # the process and Python's collector, as prometheus_client exports them
    assert value(s, "process_cpu_seconds_total") > 0
    assert value(s, "process_resident_memory_bytes") > 50 << 20
    assert value(s, "python_gc_collections_total", generation="0") >= 0
    if nvml() is None:
        assert not [k for k in s if k[0].startswith("itif_gpu_")]
    if not torch.cuda.is_available():  # the graph cache's series exist on CUDA only
        assert not [k for k in s if k[0].startswith("itif_cuda_graph")]


def test_graph_cache_series():
    from itif.metrics import _StateCollector

    class Engine:
        def graph_stats(self):
            return dict(policy="rent", graphs=3, captures=5, replays=40, eager=17, ratio=3.6)

    fams = {f.name: f for f in _StateCollector._graphs(Engine())}
    got = {(smp.name, tuple(smp.labels.items())): smp.value
           for f in fams.values() for smp in f.samples}
    assert got == {("itif_cuda_graph_forwards_total", (("path", "replay"),)): 40,
                   ("itif_cuda_graph_forwards_total", (("path", "eager"),)): 17,
                   ("itif_cuda_graph_captures_total", ()): 5,
                   ("itif_cuda_graphs", ()): 3}
    assert list(_StateCollector._graphs(object())) == []  # a decoder backend: no series


def test_config_reload_counters(daemon):
    s = scrape(daemon.metrics_port)
    ok0 = value(s, "itif_config_reloads_total", result="ok")
    failed0 = value(s, "itif_config_reloads_total", result="failed")
    daemon.tenant_extra = {"beta": {"weight": 2.0}}
    daemon.write_config()
    end = time.monotonic() + 15
    while value(scrape(daemon.metrics_port), "itif_config_reloads_total", result="ok") == ok0:
        assert time.monotonic() < end, "the valid edit was never applied"
        time.sleep(0.1)
    daemon.write_config("server: [this is not\n  valid yaml")
    while value(scrape(daemon.metrics_port), "itif_config_reloads_total",
                result="failed") == failed0:
        assert time.monotonic() < end, "the broken edit was never refused"
        time.sleep(0.1)
    daemon.tenant_extra = {}
    daemon.write_config()  # leave a valid file behind


def test_the_daemon_collects_its_youngest_generation_rarely(daemon):
    """itif.platform.tune_gc is in force in a started daemon: 600 calls make at most a few
    youngest-generation collections (with Python's default threshold of 700, ten times as
    many: 10 for 300 calls when measured)."""
    tid, tok = next(iter(TOKENS.items()))
    with daemon.client(tok) as c:
        c.infer(tid, [1, 2, 3])
        before = value(scrape(daemon.metrics_port), "python_gc_collections_total", generation="0")
        for k in range(600):
            c.infer(tid, list(range(1, 20 + k % 30)))
        after = value(scrape(daemon.metrics_port), "python_gc_collections_total", generation="0")
    assert after - before <= 6, (before, after)


def test_a_deadline_that_passes_while_queued_is_counted_deadline_exceeded(tmp_path):
    """Before: gRPC had ended the call when the handler's abort ran, the abort raised, and the
    call was counted UNKNOWN (an alert on UNKNOWN fired under ordinary timeouts)."""
    import threading  # noqa: PLC0415

    d = Daemon(tmp_path, {"acme": "acme-tok"}, faults="slow:300",
               server_extra={"metrics_listen": f"127.0.0.1:{free_port()}"}).start()
    try:
        m = make_hf_model("bert-tiny", 2, seed=400)
        path = tmp_path / "w.safetensors"
        save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, path)
        with d.client("acme-tok") as c:
            c.upload("acme", path)
            for _ in range(3):
                first = threading.Thread(target=lambda: c.infer("acme", [5, 6, 7], timeout=30))
                first.start()
                time.sleep(0.05)  # its 300 ms forward runs: the next call waits in the queue
                with pytest.raises(grpc.RpcError) as e:
                    c.infer("acme", [5, 6, 7], timeout=0.1)
                assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                first.join()
        time.sleep(0.3)  # the server finishes counting
        s = scrape(d.metrics_port)
        calls = dict(tenant="acme", method="Infer")
        assert value(s, "itif_requests_total", code="DEADLINE_EXCEEDED", **calls) == 3
        assert value(s, "itif_requests_total", code="UNKNOWN", **calls) == 0
        assert value(s, "itif_requests_total", code="OK", **calls) == 3
    finally:
        d.stop()


def test_an_aborted_call_is_counted_before_its_status_is_sent():
    """gRPC's ``context.abort`` sends the status and only then raises; a count made on the way
    out trailed the client's answer, and a scrape right after an error missed it (the CI once
    saw the scripted workload's last NOT_FOUND missing). The counter now counts inside abort,
    once, and a call aborted after its deadline passed still counts as DEADLINE_EXCEEDED."""
    import asyncio  # noqa: PLC0415
    from collections import namedtuple  # noqa: PLC0415

    from itif.metrics import Metrics, note_tenant  # noqa: PLC0415
    from itif.server.call_metrics import MetricsInterceptor  # noqa: PLC0415

    metrics = Metrics(nvml=None)
    icpt = MetricsInterceptor(metrics)
    Details = namedtuple("Details", ["method", "invocation_metadata"])

    def count(code: str) -> float:
        return metrics.requests.labels("acme", "Infer", code)._value.get()

    class Context:
        """What the server hands a handler: ``abort`` 'sends' (records what a scrape would
        show at that moment), then raises as gRPC's does."""
        def __init__(self, remaining: float | None = None) -> None:
            self.remaining, self.seen_at_send = remaining, None

        def time_remaining(self): return self.remaining
        def cancelled(self): return False
        def code(self): return None

        async def abort(self, code, details=""):
            self.seen_at_send = {c: count(c) for c in ("NOT_FOUND", "DEADLINE_EXCEEDED")}
            raise grpc.aio.AbortError(details)

    async def refuse(request, context):
        note_tenant("acme")
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")

    async def main():
        async def continuation(details):
            return grpc.unary_unary_rpc_method_handler(refuse)
        h = await icpt.intercept_service(continuation, Details("/itif.v1.Itif/Infer", ()))
        for ctx, want in ((Context(), "NOT_FOUND"), (Context(remaining=-0.1), "DEADLINE_EXCEEDED")):
            before = count(want)
            with pytest.raises(grpc.aio.AbortError):
                await h.unary_unary(b"", ctx)
            assert ctx.seen_at_send[want] == before + 1  # counted before the status went out
            assert count(want) == before + 1  # and once
    asyncio.run(main())
