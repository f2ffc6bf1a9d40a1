"""The daemon's per-call front-end work: what each call no longer repeats.

Under load the daemon's one interpreter runs every call's Python (auth, validation, admission,
metrics) besides the forwards, so work per call bounds its throughput (docs/gpu.md). These
tests pin the savings: a finished batch wakes the event loop once, a token is hashed once, a
metric series is looked up once, and a validation reads metadata only.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import itif
from itif import daemon as daemon_mod
from itif.backbones.spec import load_spec
from itif.bench.tenants import tenant_weights
from itif.config import hash_token, parse_config, schema
from itif.errors import InvalidRequest, TenantNotFound, Unauthenticated
from itif.requests import Request
from itif.server import infer_calls

TOKENS = {"a": "token-a", "b": "token-b"}


@pytest.fixture
def daemon_factory(tmp_path):
    """A daemon object (not started: ``identify`` needs only its config) and its tokens."""
    def make():
        cfg = parse_config(
            "server:\n  listen: 127.0.0.1:1\n  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token('admin')}\n"
            "backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
            "tenants:\n" + "".join(f"  - id: {t}\n    token_sha256: {hash_token(k)}\n"
                                  for t, k in TOKENS.items()), tmp_path)
        return daemon_mod.Daemon(cfg), dict(TOKENS)
    return make


@pytest.fixture(scope="module")
def engine():
    spec = load_spec("bert-tiny")
    e = itif.Engine("bert-tiny")
    e.add_tenant("t0", tenant_weights(spec, 0))
    return e


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self, timeout):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


def test_settler_wakes_the_loop_once_for_a_burst_of_tickets():
    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe

        def counted(cb, *args):
            wakes.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counted
        settler = infer_calls._Settler.of(loop)
        assert infer_calls._Settler.of(loop) is settler
        futs = [loop.create_future() for _ in range(200)]
        go = threading.Event()

        def finish():  # the scheduler's thread finishing one batch
            go.wait()
            for i, f in enumerate(futs):
                settler.push(f, _Done(ValueError(i) if i == 7 else i))

        th = threading.Thread(target=finish)
        th.start()
        go.set()
        th.join()
        res = await asyncio.gather(*futs, return_exceptions=True)
        assert [r for i, r in enumerate(res) if i != 7] == [i for i in range(200) if i != 7]
        assert isinstance(res[7], ValueError)
        # every push after the first found a drain scheduled: one wake-up for the burst
        assert len(wakes) == 1
        # a later ticket schedules a new wake-up
        f = loop.create_future()
        settler.push(f, _Done("late"))
        assert await f == "late" and len(wakes) == 2
    asyncio.run(main())


def test_settler_skips_futures_already_cancelled():
    async def main():
        loop = asyncio.get_running_loop()
        s = infer_calls._Settler.of(loop)
        f = loop.create_future()
        f.cancel()
        s.push(f, _Done(1))  # the call went away before its ticket finished
        g = loop.create_future()
        s.push(g, _Done(2))
        assert await g == 2 and f.cancelled()
    asyncio.run(main())


def test_identify_hashes_a_known_token_once(daemon_factory, monkeypatch):
    d, tokens = daemon_factory()
    calls = []
    real = schema.hash_token
    monkeypatch.setattr(schema, "hash_token", lambda t: calls.append(t) or real(t))
    tenant, token = next(iter(tokens.items()))
    for _ in range(5):
        assert d.identify(f"Bearer {token}").tenant == tenant
    assert calls == [token]
    for _ in range(3):  # a bad token is hashed each time and never kept
        with pytest.raises(Unauthenticated):
            d.identify("Bearer not-a-token")
    assert calls.count("not-a-token") == 3
    assert "not-a-token" not in d._digests


def test_identify_cache_is_bounded(daemon_factory):
    d, tokens = daemon_factory()
    d._digests.limit = 1
    a, b = list(tokens.values())[:2]
    d.identify(f"Bearer {a}")
    d.identify(f"Bearer {b}")
    assert b in d._digests and a not in d._digests
    assert d.identify(f"Bearer {a}").tenant == "a"  # forgotten, not refused


def test_metric_children_are_looked_up_once():
    from itif.metrics import Metrics
    m = Metrics(nvml=None)
    for _ in range(3):
        m.observe_rpc("t0", "Infer", "OK", 0.01)
    assert m._child(m.requests, "t0", "Infer", "OK") is m.requests.labels("t0", "Infer", "OK")
    assert m.requests.labels("t0", "Infer", "OK")._value.get() == 3
    assert m.request_seconds.labels("Infer")._sum.get() == pytest.approx(0.03)


def test_check_reads_metadata_only_and_keeps_its_errors(engine):
    e = engine
    t = "t0"
    ok = Request(t, input_ids=np.arange(1, 6))
    # no snapshot is held: a writer waiting for readers is never held up by a check
    before = dict(e.store._active)
    e.check([ok])
    assert e.store._active == before
    with pytest.raises(TenantNotFound):
        e.check([ok, Request("nobody", input_ids=np.arange(1, 6))])
    with pytest.raises(InvalidRequest, match="request 1: input_ids length 0"):
        e.check([ok, Request(t, input_ids=np.zeros(0, np.int64))])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        e.check([Request(t, input_ids=np.array([1, 10**9]))])
    info = e.tenant_info(t, sizes=False)
    full = e.tenant_info(t)
    assert (info.num_labels, info.has_pooler) == (full.num_labels, full.has_pooler)
    assert full.bytes > 0 and (info.bytes, info.exclusive_bytes) == (0, 0)


def test_metrics_interceptor_wraps_each_kept_handler_once():
    from collections import namedtuple

    import grpc

    from itif.metrics import Metrics
    from itif.server.call_metrics import MetricsInterceptor

    Details = namedtuple("Details", ["method", "invocation_metadata"])
    kept = grpc.unary_unary_rpc_method_handler(lambda r, c: r)
    icpt = MetricsInterceptor(Metrics(nvml=None))

    async def chain(handler, method="/itif.v1.Itif/Infer"):
        async def continuation(details):
            return handler
        return await icpt.intercept_service(continuation, Details(method, ()))

    async def main():
        a, b = await chain(kept), await chain(kept)
        assert a is b and a is not kept  # wrapped, once
        other = await chain(kept, "/itif.v1.Itif/InferBatch")  # another method: its own count
        assert other is not a
        fresh = grpc.unary_unary_rpc_method_handler(lambda r, c: r)  # a refusal, say
        assert await chain(fresh) is not a
        assert await chain(None) is None
    asyncio.run(main())
