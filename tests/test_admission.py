"""The server's admission bookkeeping without a server: reply bytes held and given back, and the
heap trim that follows a large reply's release (``itif.server.admission``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from itif.errors import Overloaded
from itif.server.admission import _THREAD_SERIALIZE_BYTES, Admission

MIB = 1 << 20


@pytest.fixture
def adm():
    server = SimpleNamespace(max_inflight_calls=100, max_pending_reply_bytes=8 * MIB,
                             max_active_calls=0)
    daemon = SimpleNamespace(config=SimpleNamespace(server=server, tenants=[]))
    a = Admission(daemon)
    trims = []
    done = threading.Event()

    def trim(pad):  # stands in for glibc's malloc_trim
        trims.append((time.monotonic(), pad))
        done.set()
        return 1

    a._trim._fn = trim
    a.trims, a.trimmed = trims, done
    return a


def test_a_large_reply_released_trims_the_heap(adm):
    """Half a second after a reply of at least _THREAD_SERIALIZE_BYTES is released, the heap
    is trimmed once (however many were released meanwhile); a small one trims nothing."""
    small = adm.enter("t", "peer-a")
    adm.reserve(small, 4096)
    small.release()
    time.sleep(0.8)
    assert adm.trims == []
    slots = [adm.enter("t", f"peer-{i}") for i in range(3)]
    for s in slots:
        adm.reserve(s, _THREAD_SERIALIZE_BYTES)
    t0 = time.monotonic()
    for s in slots:
        s.release()
    assert adm.trimmed.wait(5.0)
    time.sleep(0.8)
    assert len(adm.trims) == 1, adm.trims
    when, pad = adm.trims[0]
    assert pad == 0 and when - t0 >= 0.45
    assert adm.reply_by_tenant.get("t", 0) == 0 and adm.total == 0


def test_reply_budget_per_tenant_is_held_until_release(adm):
    """A tenant holding replies up to the budget is refused more; one call is always admitted
    when nothing is held; releasing gives the bytes back (released twice: counted once)."""
    a = adm.enter("t", "p1")
    adm.reserve(a, 6 * MIB)
    b = adm.enter("t", "p2")
    with pytest.raises(Overloaded, match="max_pending_reply_bytes"):
        adm.reserve(b, 3 * MIB)
    adm.reserve(b, 2 * MIB)  # exactly the budget
    other = adm.enter("u", "p3")
    adm.reserve(other, 12 * MIB)  # over the budget, but its tenant and connection hold nothing
    a.release()
    a.release()
    assert adm.reply_by_tenant == {"t": 2 * MIB, "u": 12 * MIB}
    c = adm.enter("t", "p4")
    adm.reserve(c, 6 * MIB)
    for s in (b, other, c):
        s.release()
    assert adm.reply_by_tenant == {} and adm.reply_by_peer == {} and adm.total == 0
