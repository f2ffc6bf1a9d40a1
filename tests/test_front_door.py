"""The daemon's front door for Infer (``Daemon.admit``), as the servers use it through
``itif.server.infer_calls.await_tickets``: in an admitted gRPC call the tenant's visibility is
checked once, the call is validated, and only then is its reply reserved and its work queued.

No server and no scheduler thread: the daemon object is wired to a real engine (bert-tiny,
one tenant) and a recording scheduler, and the admitted call's slot is a recording stand-in.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

import itif
from itif import daemon as daemon_mod
from itif.backbones.spec import load_spec
from itif.bench.tenants import tenant_weights
from itif.config import hash_token, parse_config
from itif.daemon import Identity, State
from itif.errors import InvalidRequest, TenantNotFound
from itif.requests import Request
from itif.server import admission, infer_calls


@pytest.fixture(scope="module")
def engine():
    e = itif.Engine("bert-tiny")
    e.add_tenant("a", tenant_weights(load_spec("bert-tiny"), 0))
    return e


class _Ticket:
    """A ticket already answered: its callback runs at once."""

    def __init__(self, request):
        self.request = request

    def add_done_callback(self, cb):
        cb(self)

    def result(self, timeout):
        return self.request.tenant

    def cancel(self):
        pass


@pytest.fixture
def wired(tmp_path, engine):
    """(daemon, log): every visibility check, reply reservation and queueing, in order."""
    cfg = parse_config(
        "server:\n  listen: 127.0.0.1:1\n  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\n"
        "backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
        "tenants:\n" + "".join(f"  - id: {t}\n    token_sha256: {hash_token(t)}\n"
                              for t in ("a", "b")), tmp_path)
    d = daemon_mod.Daemon(cfg, engine)
    log: list = []

    def submit_many(requests, *, tokens, deadline=None, priority=0):
        log.append(("queue", len(requests)))
        return [_Ticket(r) for r in requests]

    d.scheduler = SimpleNamespace(submit_many=submit_many)
    d.metrics = SimpleNamespace(note_tenant=lambda t: log.append(("seen", t)),
                                watch=lambda tenant, tickets: None)
    d.status["a"].state = State.READY
    return d, log


def _admitted(d, log, who, tenant, requests):
    """``await_tickets`` in an admitted gRPC call whose reservations ``log`` records."""
    slot = SimpleNamespace(admission=SimpleNamespace(
        reserve=lambda s, n: log.append(("reserve", n))))

    async def main():
        admission._SLOT.set(slot)
        return await infer_calls.await_tickets(d, who, tenant, requests, None)
    return asyncio.run(main())


def test_an_admitted_call_is_seen_once_then_reserved_then_queued(wired):
    d, log = wired
    reqs = [Request("", input_ids=np.arange(1, 6)), Request("", input_ids=np.arange(1, 9))]
    assert _admitted(d, log, Identity("a"), "a", reqs) == ["a", "a"]
    assert [e[0] for e in log] == ["seen", "reserve", "queue"]  # one visibility check
    assert log[0] == ("seen", "a") and log[2] == ("queue", 2)
    assert log[1][1] > 0


def test_an_invalid_call_is_refused_before_its_reply_is_reserved(wired):
    d, log = wired
    bad = [Request("", input_ids=np.arange(1, 6)), Request("", input_ids=np.zeros(0, np.int64))]
    with pytest.raises(InvalidRequest, match="request 1: input_ids length 0"):
        _admitted(d, log, Identity("a"), "a", bad)
    assert log == [("seen", "a")]  # nothing reserved, nothing queued


@pytest.mark.parametrize("who, tenant", [(Identity("a"), "b"), (Identity("a"), "nobody"),
                                         (Identity(None, admin=True), "nobody")])
def test_an_invisible_tenant_is_not_found_before_anything_else(wired, who, tenant):
    d, log = wired
    with pytest.raises(TenantNotFound, match="not found"):
        _admitted(d, log, who, tenant, [Request("", input_ids=np.arange(1, 6))])
    assert log == []
