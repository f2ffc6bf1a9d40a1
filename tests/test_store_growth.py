"""WeightStore growth off the hot path, and each upload's tensors keyed and compared once.

(a) readers (``store.read()`` and its buffers) and accounting never wait for a writer, not even
    while it grows a large buffer; (b) after many growths, replacements and removals every
    tenant reads exactly the bytes it added and identical tensors share one slot (tensors whose
    sampled keys collide included); (c) a head-only tenant of a 21.8 MB BERT adds in <= 5 ms,
    as fast at the 2000th tenant as at the first ones; (d) the daemon's upload path (budget
    check, then add) keys and compares each tensor once.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import threading
import time

import pytest
import torch

import itif.weights.store as store_mod
from itif.backbones.hf import CanonicalWeights
from itif.backbones.spec import BackboneSpec
from itif.bench.tenants import tenant_weights
from itif.weights.store import WeightStore, tensor_key


def _cw(tensors: dict[str, torch.Tensor]) -> CanonicalWeights:
    return CanonicalWeights(tensors, None, False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- (a) ---------------------------------------------------------------------------------------
def test_readers_and_accounting_never_wait_for_growth():
    """A writer adds 128 tenants with a distinct 2 MiB tensor each: the buffer of that kind
    grows 7 times, the last growth copying 64 slots (128 MiB) into a new 256 MiB buffer. A
    reader thread reads slots through ``store.read()`` and an accounting thread calls
    ``weight_bytes`` / ``tenant_bytes`` / ``reserved_bytes`` all along; both keep finishing
    calls while the writer copies, and the reader always sees the right bytes."""
    shape = (512, 1024)  # 2 MiB float32
    big = ("big", shape)
    store = WeightStore()
    store.add("t0", _cw({"big": torch.zeros(shape), "bias": torch.zeros(16)}))
    stop = threading.Event()
    reads: list[tuple[float, float]] = []  # (start, duration)
    acct: list[tuple[float, float]] = []
    wrong: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            with store.read() as v:
                buf = v.buffers[big]
                tenant = f"t{len(v.tenants) - 1}"  # the newest tenant: its slot may be fresh
                _, slot = v.param(tenant, "big")
                _, slot0 = v.param("t0", "big")
                got, got0 = float(buf[slot, -1, -1]), float(buf[slot0, 0, 0])
            reads.append((t0, time.perf_counter() - t0))
            if got != float(len(v.tenants) - 1) or got0 != 0.0:
                wrong.append(f"{tenant}: {got}, t0: {got0}")
            time.sleep(0.0005)

    def accountant() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            store.weight_bytes
            store.tenant_bytes("t0")
            store.reserved_bytes
            acct.append((t0, time.perf_counter() - t0))
            time.sleep(0.0005)

    threads = [threading.Thread(target=reader), threading.Thread(target=accountant)]
    for t in threads:
        t.start()
    growths: list[tuple[float, float]] = []  # (start, end) of adds that grew the big buffer
    try:
        for i in range(1, 128):
            w = _cw({"big": torch.full(shape, float(i)), "bias": torch.full((16,), float(i))})
            cap = store.view.buffers[big].shape[0]
            t0 = time.perf_counter()
            store.add(f"t{i}", w)
            t1 = time.perf_counter()
            if store.view.buffers[big].shape[0] != cap:
                growths.append((t0, t1))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not wrong, wrong[:5]
    assert len(growths) == 7 and store.view.buffers[big].shape[0] == 128
    # A reader or accountant that waited for the writer would finish no call while a growth is
    # under way. Each of the three slowest growths (tens of ms: a 64-128 MiB copy) must contain
    # a whole call of both threads, started and finished while the writer was still copying.
    # (An absolute bound on the slowest call measured the CI machine's scheduler instead: one
    # 51 ms read on a loaded 2-core runner while a 100 ms growth ran.)
    for a, b in sorted(growths, key=lambda g: g[0] - g[1])[:3]:
        inside_reads = sum(1 for s, d in reads if a <= s and s + d <= b)
        inside_acct = sum(1 for s, d in acct if a <= s and s + d <= b)
        assert inside_reads >= 1 and inside_acct >= 1, (b - a, inside_reads, inside_acct)


# ---- (b) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_contents_exact_and_shared_after_growth(device, dtype):
    gen = torch.Generator().manual_seed(7)
    shape = (256, 1024)  # 1 MiB in float32
    pool = [torch.randn(shape, generator=gen) for _ in range(7)]
    # Twins of pool tensors with one element changed where the sampled key does not look: the
    # keys collide and only the bytes (or the full sha256) tell them apart.
    twins = []
    for k in range(3):
        t = pool[k].clone()
        t.view(-1)[1026] += 1.0  # byte 4104: in 64-byte block 64, between sampled blocks
        twins.append(t)
    for k in range(3):
        assert tensor_key(twins[k].to(dtype)) == tensor_key(pool[k].to(dtype))
        assert not torch.equal(_bits(twins[k].to(dtype)), _bits(pool[k].to(dtype)))

    def tenant(i: int) -> dict[str, torch.Tensor]:
        src = twins[i % 3] if i % 5 == 4 else pool[i % 7]
        return {"big": src.clone(),  # equal bytes, another tensor: sharing by content only
                "own": torch.full((32, 64), float(i)),
                "same": torch.ones(8)}

    store = WeightStore(device, dtype=dtype)
    added: dict[str, dict[str, torch.Tensor]] = {}
    held = []  # (context, view, what its tenants held then): read across later growths
    for i in range(60):
        name = f"t{i % 45}"  # tenants 45..59 replace t0..t14
        if i % 9 == 0:
            cm = store.read()
            view = cm.__enter__()
            held.append((cm, view, {t: dict(added[t]) for t in view.tenants}))
        added[name] = tenant(i)
        store.add(name, _cw(added[name]))
        if i % 11 == 10:
            gone = f"t{(i * 7) % 45}"
            if gone in added:
                store.remove(gone)
                del added[gone]
    assert store.view.buffers[("big", shape)].shape[0] >= 16  # it grew several times
    # Old views still read exactly what they saw: their pre-growth buffers are alive, and the
    # slots of tenants removed or replaced since were not reused under them.
    for cm, view, then in held:
        assert set(view.tenants) == set(then)
        for name, tensors in then.items():
            for pname, src in tensors.items():
                buf, slot = view.param(name, pname)
                assert torch.equal(_bits(buf[slot].cpu()), _bits(src.to(dtype))), (name, pname)
        cm.__exit__(None, None, None)

    v = store.view
    assert set(v.tenants) == set(added)
    where_of: dict[tuple[str, bytes], tuple] = {}  # distinct (kind, bytes) -> its slot
    numel = 0
    for name, tensors in added.items():
        for pname, src in tensors.items():
            buf, slot = v.param(name, pname)
            want = _bits(src.to(dtype))
            assert torch.equal(_bits(buf[slot].cpu()), want), (name, pname)  # bit for bit
            key = (pname, hashlib.sha256(want.numpy().tobytes()).digest())
            if key not in where_of:
                where_of[key] = v.tenants[name].slots[pname]
                numel += src.numel()
            assert where_of[key] == v.tenants[name].slots[pname], (name, pname)  # shared
    assert len(set(where_of.values())) == len(where_of)  # different bytes, different slots
    assert sum(1 for p, _ in where_of if p == "big") == 10  # 7 pool tensors and 3 twins
    assert store.weight_bytes == numel * torch.empty((), dtype=dtype).element_size()
    # with no view held any more, every freed slot is reusable: re-adding does not grow
    reserved = store.reserved_bytes
    names = sorted(added)[:5]
    for name in names:
        store.remove(name)
    for name in names:
        store.add(name, _cw(added[name]))
    assert store.reserved_bytes == reserved


def test_stale_or_foreign_digests_are_not_used():
    store = WeightStore(max_bytes=1 << 30)
    a = _cw({"x": torch.zeros(1000), "y": torch.ones(10)})
    store.add("a", a)
    b = _cw({"x": torch.zeros(1000), "y": torch.full((10,), 2.0)})
    d = store.check_budget(b)  # confirms b.x is a's x
    b.tensors["x"].add_(5.0)  # changed after the check: the match must not be trusted
    store.add("b", b, digests=d)
    buf, slot = store.view.param("b", "x")
    assert torch.equal(buf[slot], torch.full((1000,), 5.0))
    assert store.view.param("a", "x") != store.view.param("b", "x")
    c = _cw({"x": torch.full((1000,), 7.0), "y": torch.ones(10)})
    store.add("c", c, digests=store.digests(a))  # another weights object's digests: ignored
    buf, slot = store.view.param("c", "x")
    assert torch.equal(buf[slot], torch.full((1000,), 7.0))
    assert store.view.param("c", "y") == store.view.param("a", "y")  # shared by content


# ---- (c) ---------------------------------------------------------------------------------------
BERT_21MB = BackboneSpec("bert", 256, 4, 4, 1024, vocab_size=8192, max_position=512,
                         type_vocab_size=2, name="bert-21mb")


def _floor(pairs) -> None:
    """Compare ``pairs`` of equal tensors byte for byte: the floor of what an add of a
    head-only tenant must do (confirm the shared backbone), timed under the same load."""
    for a, b in pairs:
        if store_mod._memcmp is not None:
            assert store_mod._memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
        else:
            assert torch.equal(a, b)


def _timed(fn) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of ``fn()``."""
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    t1, c1 = time.perf_counter(), time.thread_time()
    return (t1 - t0) * 1e3, (c1 - c0) * 1e3


def _window(store: WeightStore, first: int, count: int, pairs) -> dict:
    """``store.add`` of head-only tenants ``first .. first+count-1``, each after a timing of the
    floor; the weights are built outside the timing, the cyclic GC is paused inside it."""
    adds, floors = [], []
    for i in range(first, first + count):
        w = tenant_weights(BERT_21MB, i, "head")
        gc.disable()
        try:
            floors.append(_timed(lambda: _floor(pairs)))
            adds.append(_timed(lambda: store.add(f"t{i}", w)))
        finally:
            gc.enable()
    med = statistics.median
    return dict(cpu=med(a[1] for a in adds), floor=med(f[1] for f in floors),
                wall=med(a[0] for a in adds), fastest_wall=min(a[0] for a in adds))


def test_head_only_tenant_adds_in_5ms_at_the_first_and_the_2000th():
    """21.8 MB of backbone (53 tensors) shared by every tenant, a 256x256 pooler and a 2-label
    head of its own (about 260 KB): an add keys its 57 tensors, confirms the 53 shared ones
    against the stored backbone byte for byte, and copies its 4 own tensors into free slots.

    The 1st tenant of all brings the backbone (a 21.8 MB copy into fresh buffers); the early
    window is the 15 head-only tenants right after it, the late one tenants 1986-2000 (2000
    tenants hold about 520 MB of poolers). The limit is 5 ms, on the adding thread's CPU time
    (on a quiet machine its wall time is the same): this test runs on shared 2-core machines
    where neighbours preempt it for 4 ms scheduler slices (wall times cluster at 3.5, 7.5 and
    12 ms there) and take memory bandwidth. So each window is measured up to three times and
    its best counts, and where even the bare comparison of the backbone's bytes (the floor,
    timed before every add) is slow, the limit becomes 2.5 times that floor (on a quiet
    machine the floor is about 1.5 ms). Wall times are in the failure message."""
    store = WeightStore()
    store.add("t0", tenant_weights(BERT_21MB, 0, "head"))
    base = tenant_weights(BERT_21MB, 0, "head").tensors
    shared = [n for n in base if not n.startswith(("pooler.", "head."))]
    assert len(shared) == 53 and sum(base[n].numel() * 4 for n in shared) > 21_000_000
    pairs = [(base[n], base[n].clone()) for n in shared]

    def limit(w: dict) -> float:
        return max(5.0, 2.5 * w["floor"])

    def best(first: int) -> tuple[dict, list]:
        tries = []
        for k in range(3):
            tries.append(_window(store, first + 15 * k, 15, pairs))
            if tries[-1]["cpu"] <= 5.0:
                break
        return min(tries, key=lambda w: w["cpu"] / limit(w)), tries

    early, early_tries = best(1)
    for i in range(len(store.tenants()), 1985):
        store.add(f"t{i}", tenant_weights(BERT_21MB, i, "head"))
    late, late_tries = best(1985)
    assert len(store.tenants()) >= 2000
    why = f"early {early_tries}, late {late_tries}"
    assert early["cpu"] <= limit(early) and late["cpu"] <= limit(late), why
    # no slowdown with the tenant count: as fast at the 2000th as early, relative to the floor
    assert late["cpu"] / late["floor"] <= 1.5 * early["cpu"] / early["floor"] + 0.5, why


# ---- (d) ---------------------------------------------------------------------------------------
def _count(monkeypatch, obj, name: str, static: bool = False) -> list:
    calls = []
    real = getattr(obj, name)

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(obj, name, staticmethod(counted) if static else counted)
    return calls


def test_daemon_upload_keys_and_compares_each_tensor_once(tmp_path, monkeypatch):
    from itif.config import hash_token, parse_config
    from itif.daemon import Daemon, Identity
    from itif.safetensors_io import save_safetensors
    from tests.daemon_harness import free_port
    from tests.oracle import make_hf_model

    cfg = parse_config(
        "server:\n"
        f"  listen: 127.0.0.1:{free_port()}\n"
        "  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\n"
        "backbone:\n"
        "  config: bert-tiny\n"
        "  device: cpu\n"
        "  max_weight_bytes: 100MiB\n"  # a budget: the upload path checks it before adding
        "tenants:\n"
        f"  - id: a\n    token_sha256: {hash_token('ta')}\n"
        f"  - id: b\n    token_sha256: {hash_token('tb')}\n",
        tmp_path,
    )
    path = tmp_path / "w.safetensors"
    model = make_hf_model("bert-tiny", 2, seed=5)
    save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    admin = Identity(None, admin=True)
    d = Daemon(cfg)
    d.start()
    try:
        n = len(d.engine.load_weights(path).tensors)
        keys = _count(monkeypatch, store_mod, "_key")
        digests = _count(monkeypatch, store_mod, "tensor_digest")
        compares = _count(monkeypatch, WeightStore, "_same", static=True)
        d.upload(admin, "a", sha, len(data), [data])
        assert len(keys) == n and not digests and not compares  # all new: nothing to compare
        keys.clear()
        view = d.upload(admin, "b", sha, len(data), [data])  # the same bytes: all shared
        assert len(keys) == n, (len(keys), n)  # keyed once, not once per check and add
        assert len(compares) == n, (len(compares), n)  # confirmed once: add reused the check's
        assert not digests
        assert view.exclusive_bytes == 0 and view.weight_bytes > 0
        store = d.engine.store
        assert all(store.view.param("a", p) == store.view.param("b", p)
                   for p in store.view.tenants["a"].slots)
        assert not store._prepared  # nothing left behind for a later add
    finally:
        d.stop()
