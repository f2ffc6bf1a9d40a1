"""Reliability, faults survived (promises 5, 6, 8-13, 15, 16 of shared/reference/reliability.md),
against real daemon subprocesses on loopback: SIGKILL in the middle of uploads, restarts,
corrupted stored files, bad and racy config edits, reloads under traffic, out-of-memory in a
forward, clients killed mid-upload, health and graceful shutdown."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from itif.config import hash_token
from itif.server._proto.itif.v1 import itif_pb2
from tests.reliability_util import (
    ADMIN,
    OK,
    Daemon,
    code_of,
    error_of,
    free_port,
    infer_sha,
    make_tokens,
    metric,
    promise,
    scrape,
    sha256,
    state_dict,
    upload_bytes,
    upload_messages,
    wait_until,
    weights_bytes,
    weights_file,
)

C = grpc.StatusCode
PROBE = [101, 7, 42, 9, 300, 5, 102]
READY = itif_pb2.TenantInfo.READY
FAILED = itif_pb2.TenantInfo.FAILED


def answers(d: Daemon, tokens: dict[str, str]) -> dict[str, tuple[bytes, str]]:
    """Each tenant's (logits bytes, weights sha256) for PROBE, asked one at a time."""
    out = {}
    for tid, tok in tokens.items():
        with d.client(tok) as c:
            out[tid] = infer_sha(c, tid, PROBE)
    return out


def assert_same(got: dict, want: dict) -> None:
    """Same weights (sha256) and the same logits up to float rounding: under concurrent
    traffic a probe shares its fused batch with other requests, which may change the last bit
    of a GEMM's result (``answers`` taken when idle are compared bit for bit instead)."""
    assert got.keys() == want.keys()
    for t in want:
        assert got[t][1] == want[t][1], t
        np.testing.assert_allclose(np.frombuffer(got[t][0], "<f4"),
                                   np.frombuffer(want[t][0], "<f4"), rtol=1e-4, atol=1e-5)


class Traffic:
    """Background Infer calls for some tenants until stopped; every status is counted."""

    def __init__(self, d: Daemon, tokens: dict[str, str], threads_per_tenant: int = 1,
                 pause_s: float = 0.0, timeout: float = 30.0) -> None:
        self.codes: dict[str, Counter] = {t: Counter() for t in tokens}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(d, tid, tok, pause_s, timeout), daemon=True)
            for tid, tok in tokens.items() for _ in range(threads_per_tenant)]

    def _run(self, d, tid, tok, pause_s, timeout):
        rng = random.Random(tid)
        with d.client(tok) as c:
            while not self._stop.is_set():
                ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
                code = code_of(lambda: c.infer(tid, ids, timeout=timeout))
                self.codes[tid][code.name] += 1
                if pause_s:
                    time.sleep(pause_s)

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    def not_ok(self) -> dict:
        return {t: {k: v for k, v in c.items() if k != "OK"} for t, c in self.codes.items()
                if set(c) - {"OK"}}


# ---- 5, 6: health truthful, graceful shutdown -------------------------------------------------
@promise(5, 6)
def test_health_truthful_and_graceful_shutdown(tmp_path, rel):
    """Health NOT_SERVING (and calls UNAVAILABLE) while the backbone loads, SERVING after; on
    SIGTERM health turns NOT_SERVING, new calls get UNAVAILABLE, the in-flight calls finish
    OK, and the process exits 0 within server.grace_s."""
    tokens = make_tokens(["a"])
    # stop_delay: the daemon's own shutdown starts 1.5 s after SIGTERM, so a call that the
    # server let in after health turned NOT_SERVING would be queued and answered OK
    d = Daemon(tmp_path, tokens, faults="start_delay:2000,slow:2500,stop_delay:1500",
               server_extra={"grace_s": 20})
    d.start(wait=False)
    try:
        d.wait_port(60)  # the port opens before the backbone loads
        with d.client(tokens["a"]) as c:
            assert c.health_status(timeout=5) == "NOT_SERVING"
            code, msg = error_of(lambda: c.infer("a", PROBE, timeout=10))
            assert code == C.UNAVAILABLE, (code, msg)
            rel.inputs += 2
        d.wait_serving()
        with d.client(tokens["a"]) as c:
            upload_bytes(c, "a", weights_bytes(50))
        results: list = []

        def call():
            with d.client(tokens["a"]) as c:
                results.append(error_of(lambda: c.infer("a", PROBE, timeout=60)))

        inflight = [threading.Thread(target=call) for _ in range(4)]
        for t in inflight:
            t.start()
        time.sleep(0.5)  # the calls are queued or running (each forward sleeps 2.5 s)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        rel.faults += 1
        with d.client(tokens["a"]) as c:
            wait_until(lambda: c.health_status(timeout=1) == "NOT_SERVING", 10,
                       what="health NOT_SERVING after SIGTERM")
            code, msg = error_of(lambda: c.infer("a", PROBE, timeout=10))
            assert code == C.UNAVAILABLE, (code, msg)
            rel.inputs += 2
        assert any(t.is_alive() for t in inflight), "the drain began after the calls finished"
        for t in inflight:
            t.join(60)
        rc = d.proc.wait(30)
        took = time.monotonic() - t0
        d.proc = None
        d._log.close()
        rel.inputs += len(results)
        assert results == [(OK, "")] * 4
        assert rc == 0 and took < 20, (rc, took)
        rel.notes["exit after SIGTERM (s)"] = round(took, 2)
    finally:
        if d.proc is not None:
            d.stop()


# ---- 8, 9: kill -9 during uploads; restart restores every tenant ---------------------------
def _pace_upload(d: Daemon, token: str, tenant: str, data: bytes, pace_s: float, out: list):
    with d.client(token) as c:
        out.append(error_of(lambda: upload_bytes(c, tenant, data, chunk=16 * 1024,
                                                 pace_s=pace_s, timeout=120)))


def _check_pair(d: Daemon, tenant: str, versions: dict[str, bytes]) -> str:
    """The committed pair is exactly one known version (file and sidecar agree), nothing else
    sits in the weights directory, no temp file is left; returns the version's sha256."""
    data, side = d.stored(tenant)
    assert data is not None and side == sha256(data), "a committed-looking pair that disagrees"
    assert side in versions, "a partial or unknown file under the final name"
    names = sorted(os.listdir(d.weights_dir))
    assert all(n.endswith((".safetensors", ".sha256", ".note.json")) for n in names), names
    assert d.tmp_files() == []
    return side


@promise(8, 9)
@pytest.mark.slow
def test_kill9_during_upload_keeps_old_or_new_weights_exactly(tmp_path, rel):
    """SIGKILL mid-stream -> after restart the tenant serves its old weights, no partial file
    under the final name, temp files cleaned, re-upload OK. Then SIGKILL at random moments of
    full-speed uploads (streaming, validating, committing): after every restart the tenant
    serves exactly the old or the new weights, and every other tenant is restored unchanged."""
    tokens = make_tokens(["t", "u", "v"])
    d = Daemon(tmp_path, tokens)
    d.start()
    versions = {sha256(weights_bytes(s)): weights_bytes(s) for s in (60, 61, 62, 63)}
    by_seed = {s: sha256(weights_bytes(s)) for s in (60, 61, 62, 63)}
    with d.client(tokens["t"]) as c:
        upload_bytes(c, "t", weights_bytes(60))
    with d.client(tokens["u"]) as c:
        upload_bytes(c, "u", weights_bytes(64))
    with d.client(tokens["v"]) as c:
        upload_bytes(c, "v", weights_bytes(60))  # same file as t: shared slots
    outputs = {by_seed[60]: answers(d, {"t": tokens["t"]})["t"]}
    others = answers(d, {k: tokens[k] for k in ("u", "v")})
    try:
        # 1) in the middle of a paced stream
        out: list = []
        th = threading.Thread(target=_pace_upload,
                              args=(d, tokens["t"], "t", weights_bytes(61), 0.03, out))
        th.start()
        wait_until(lambda: any((d.tmp_dir / f).stat().st_size > 64 * 1024
                               for f in d.tmp_files() if (d.tmp_dir / f).exists()), 30,
                   what="a partial upload on disk")
        d.sigkill()
        rel.faults += 1
        th.join(60)
        assert out and out[0][0] != OK, out  # the connection died under the client
        d.start()
        assert _check_pair(d, "t", versions) == by_seed[60]
        assert answers(d, {"t": tokens["t"]})["t"] == outputs[by_seed[60]]
        assert answers(d, {k: tokens[k] for k in ("u", "v")}) == others
        with d.client(tokens["t"]) as c:  # re-upload works (lock and temp state are fresh)
            assert upload_bytes(c, "t", weights_bytes(61)).sha256 == by_seed[61]
        outputs[by_seed[61]] = answers(d, {"t": tokens["t"]})["t"]

        # 2) random moments of full-speed uploads; how long one takes sets the range
        t0 = time.monotonic()
        with d.client(tokens["t"]) as c:
            upload_bytes(c, "t", weights_bytes(62))
        span = time.monotonic() - t0
        outputs[by_seed[62]] = answers(d, {"t": tokens["t"]})["t"]
        rng = random.Random(8)
        outcomes = Counter()
        current = by_seed[62]
        for k in range(5):
            seed = 63 if current != by_seed[63] else 61
            th = threading.Thread(target=_pace_upload,
                                  args=(d, tokens["t"], "t", weights_bytes(seed), 0.0, []))
            th.start()
            time.sleep(rng.uniform(0.0, span * 1.2))
            d.sigkill()
            rel.faults += 1
            th.join(60)
            d.start()
            got = _check_pair(d, "t", versions)
            assert got in (current, by_seed[seed])
            outcomes["new" if got == by_seed[seed] else "old"] += 1
            logits, served = answers(d, {"t": tokens["t"]})["t"]
            assert served == got
            if got in outputs:
                assert (logits, served) == outputs[got]
            outputs.setdefault(got, (logits, served))
            assert answers(d, {k: tokens[k] for k in ("u", "v")}) == others
            current = got
        rel.notes["random kills: old/new"] = dict(outcomes)
        # 9) a clean restart restores every tenant exactly
        before = answers(d, tokens)
        assert d.stop() == 0
        d.start()
        assert answers(d, tokens) == before
        with d.client(ADMIN) as c:
            assert {t.id: t.state for t in c.tenants()} == {t: READY for t in tokens}
        rel.inputs += 3
    finally:
        if d.proc is not None:
            d.stop()


def _hf_logits(seed: int) -> np.ndarray:
    """What bert-tiny with ``weights_bytes(seed)`` answers for PROBE (Hugging Face itself)."""
    import itif
    from tests.oracle import make_hf_model, reference

    return reference(make_hf_model("bert-tiny", 2, seed=seed),
                     itif.Request("t", input_ids=PROBE))["logits"]


#: Where ``kill_at`` lands in the commit protocol, and what start-up must make of it.
COMMIT_KILLS = {"commit_pending": "old", "commit_renamed": "new", "commit_done": "new"}


@promise(8)
@pytest.mark.slow
def test_kill9_inside_the_commit_lands_on_old_or_new_exactly(tmp_path, rel):
    """SIGKILL at each step of the weight commit, made deterministic by the ``kill_at`` hook:
    with the intent record durable and the data file not yet renamed the restarted daemon
    serves the OLD weights; with the data file renamed but the sidecar not yet (recovery rolls
    forward), or with the pair committed but the weights not yet swapped in, it serves the NEW
    weights. Every time: the pair on disk is exactly one version, no pending record or temp file
    is left, the logits equal Hugging Face's for that version, and the other tenant is intact."""
    tokens = make_tokens(["t", "u"])
    d = Daemon(tmp_path, tokens)
    d.start()
    seeds = {"old": 65, "new": 66}
    shas = {k: sha256(weights_bytes(s)) for k, s in seeds.items()}
    want = {k: _hf_logits(s) for k, s in seeds.items()}
    versions = {shas[k]: weights_bytes(s) for k, s in seeds.items()}
    outcomes = {}
    try:
        with d.client(tokens["u"]) as c:
            upload_bytes(c, "u", weights_bytes(67))
        other = answers(d, {"u": tokens["u"]})
        for point, expected in COMMIT_KILLS.items():
            with d.client(tokens["t"]) as c:  # the old version, committed normally
                upload_bytes(c, "t", weights_bytes(seeds["old"]))
            assert d.stop() == 0
            d.faults = f"kill_at:{point}"
            d.start()
            with d.client(tokens["t"]) as c:
                code, msg = error_of(lambda: upload_bytes(c, "t", weights_bytes(seeds["new"])))
            rel.faults += 1
            assert code != OK, (point, code, msg)  # the daemon died under the call
            assert d.wait_exit(30) == -signal.SIGKILL, point
            assert f"kill_at: commit reached {point}" in d.logs(), point  # it landed there
            d.faults = ""
            d.start()
            got = _check_pair(d, "t", versions)
            assert not list(d.weights_dir.glob("*.pending")), point
            outcome = "new" if got == shas["new"] else "old"
            outcomes[point] = outcome
            assert outcome == expected, (point, outcome)
            with d.client(tokens["t"]) as c:
                logits, served = infer_sha(c, "t", PROBE)
                assert c.get_tenant("t").state == READY
            assert served == got
            np.testing.assert_allclose(np.frombuffer(logits, "<f4"), want[outcome],
                                       rtol=1e-4, atol=1e-4)
            assert answers(d, {"u": tokens["u"]}) == other
            rel.inputs += 3
        rel.notes["commit kills: point -> weights served after restart"] = outcomes
        assert set(outcomes.values()) == {"old", "new"}  # both outcomes were exercised
    finally:
        if d.proc is not None:
            d.stop()


@promise(9)
@pytest.mark.slow
def test_restart_restores_every_tenant(tmp_path, rel):
    """Eight tenants (two sharing one file): outputs before == outputs after, bit for bit,
    across a SIGTERM restart and across a SIGKILL restart."""
    tokens = make_tokens([f"t{i}" for i in range(8)])
    d = Daemon(tmp_path, tokens).start()
    try:
        for i, (tid, tok) in enumerate(tokens.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(70 + min(i, 6), 2 + min(i, 6) % 3))
        before = answers(d, tokens)
        assert len({v[1] for v in before.values()}) == 7  # t6 and t7 share one file
        assert d.stop() == 0
        d.start()
        assert answers(d, tokens) == before
        d.sigkill()
        rel.faults += 1
        d.start()
        assert answers(d, tokens) == before
        rel.inputs += 3 * len(tokens)
    finally:
        d.stop()


# ---- 14: the memory budget ----------------------------------------------------------------------
@promise(14)
def test_tenant_beyond_the_memory_budget_is_refused_others_untouched(tmp_path, rel):
    """backbone.max_weight_bytes holds two distinct tenants: a third distinct upload answers
    RESOURCE_EXHAUSTED before anything is committed (no stored file, no temp file, the tenant
    stays NO_WEIGHTS) and the others serve exactly as before; weights equal to a stored
    tenant's fit when the operator uploads them (their tensors are shared), but not when the
    tenant does (a tenant is never credited, or told, what other tenants hold); a restart restores
    all that fit, and with a
    smaller budget the tenant that no longer fits fails alone (FAILED, the reason given)."""
    from itif.runtime.engine import Engine

    one = sum(t.numel() * 4 for t in Engine("bert-tiny").load_weights(
        weights_file(tmp_path, 130)).tensors.values())
    tokens = make_tokens(["m1", "m2", "m3", "m4"])
    d = Daemon(tmp_path / "d", tokens, backbone_extra={"max_weight_bytes": int(one * 2.5)})
    d.start()
    try:
        for tid, seed in (("m1", 130), ("m2", 131)):
            with d.client(tokens[tid]) as c:
                upload_bytes(c, tid, weights_bytes(seed))
        before = answers(d, {k: tokens[k] for k in ("m1", "m2")})
        with d.client(tokens["m3"]) as c:
            code, msg = error_of(lambda: upload_bytes(c, "m3", weights_bytes(132)))
            rel.inputs += 1
            assert code == C.RESOURCE_EXHAUSTED and "budget" in msg, (code, msg)
            assert c.get_tenant("m3").state == itif_pb2.TenantInfo.NO_WEIGHTS
            assert code_of(lambda: c.infer("m3", PROBE)) == C.FAILED_PRECONDITION
        assert d.stored("m3") == (None, None) and d.tmp_files() == []
        assert answers(d, {k: tokens[k] for k in ("m1", "m2")}) == before
        with d.client(tokens["m4"]) as c:
            # The same tensors as m1, sent by m4 itself: the check charges them in full, as if
            # nothing were shared, so its outcome (and the reply) says nothing about m1's
            # weights: refused here. The operator's upload of the same file fits (shared).
            code, msg = error_of(lambda: upload_bytes(c, "m4", weights_bytes(130)))
            assert code == C.RESOURCE_EXHAUSTED and "budget" in msg, (code, msg)
        with d.client(ADMIN) as c:
            r = upload_bytes(c, "m4", weights_bytes(130))
            assert r.shared_bytes == r.weight_bytes > 0
        with d.client(tokens["m4"]) as c:
            info = c.get_tenant("m4")
            assert info.exclusive_bytes == info.weight_bytes == r.weight_bytes  # told no sharing
        rel.inputs += 2
        everyone = answers(d, {k: tokens[k] for k in ("m1", "m2", "m4")})
        assert d.stop() == 0
        d.start()
        assert answers(d, {k: tokens[k] for k in ("m1", "m2", "m4")}) == everyone
        # a smaller budget at the next start: what no longer fits fails alone
        assert d.stop() == 0
        d.backbone_extra["max_weight_bytes"] = int(one * 1.5)
        d.write_config()
        d.start()
        with d.client(ADMIN) as c:
            states = {t.id: (t.state, t.error) for t in c.tenants()}
        assert states["m2"][0] == FAILED and "budget" in states["m2"][1], states
        assert {states[t][0] for t in ("m1", "m4")} == {READY}
        assert answers(d, {k: tokens[k] for k in ("m1", "m4")}) == {
            k: everyone[k] for k in ("m1", "m4")}
        rel.faults += 1
    finally:
        d.stop()


# ---- 10: one corrupted stored file fails only its tenant --------------------------------------
def _nan_file() -> bytes:
    import safetensors.torch

    sd = {k: v.clone() for k, v in state_dict(81).items()}
    sd["bert.encoder.layer.1.output.dense.weight"][0, 0] = float("nan")
    return safetensors.torch.save(sd)


CORRUPTIONS = {
    "flipped byte": lambda data, side: (data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:], side),
    "truncated": lambda data, side: (data[: len(data) // 2], side),
    "emptied": lambda data, side: (b"", side),
    "sidecar names another digest": lambda data, side: (data, side.replace(side[:8], "0" * 8)),
    "sidecar garbage": lambda data, side: (data, "not a digest\n"),
    "sidecar empty": lambda data, side: (data, ""),
    # a consistent pair whose content is bad: only validation on load can catch it
    "NaN weights with a matching sidecar": lambda data, side: (
        _nan_file(), f"{sha256(_nan_file())}  x.safetensors\n"),
    "another backbone's file with a matching sidecar": lambda data, side: (
        _other_backbone(), f"{sha256(_other_backbone())}  x.safetensors\n"),
}


def _other_backbone() -> bytes:
    import safetensors.torch

    return safetensors.torch.save(state_dict(82, 2, "albert-tiny"))


@promise(10)
@pytest.mark.slow
def test_corrupted_stored_file_fails_only_its_tenant(tmp_path, rel):
    """Each of eight corruptions of one tenant's stored pair (flipped byte, truncation, bad
    sidecars, a consistent pair of invalid weights) fails that tenant alone with
    FAILED_PRECONDITION (state FAILED, the reason given); the untouched tenant serves exactly as
    before, health is SERVING, and a fresh upload heals the broken tenants."""
    names = [f"c{i}" for i in range(len(CORRUPTIONS))] + ["ok"]
    tokens = make_tokens(names)
    d = Daemon(tmp_path, tokens).start()
    try:
        for i, (tid, tok) in enumerate(tokens.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(90 + i))
        before = answers(d, tokens)
        assert d.stop() == 0
        for tid, (what, corrupt) in zip(names, CORRUPTIONS.items()):
            data_p, side_p = d.weights_dir / f"{tid}.safetensors", d.weights_dir / f"{tid}.sha256"
            data, side = corrupt(data_p.read_bytes(), side_p.read_text())
            data_p.write_bytes(data)
            side_p.write_text(side)
            rel.faults += 1
        d.start()
        with d.client(ADMIN) as c:
            assert c.health_status() == "SERVING"
            states = {t.id: (t.state, t.error) for t in c.tenants()}
        for tid, what in zip(names, CORRUPTIONS):
            assert states[tid][0] == FAILED and states[tid][1], (what, states[tid])
            with d.client(tokens[tid]) as c:
                code, msg = error_of(lambda: c.infer(tid, PROBE))
                rel.inputs += 1
                rel.saw(code)
                assert code == C.FAILED_PRECONDITION, (what, code, msg)
        assert states["ok"][0] == READY
        assert answers(d, {"ok": tokens["ok"]}) == {"ok": before["ok"]}
        for i, tid in enumerate(names[:-1]):
            with d.client(tokens[tid]) as c:
                upload_bytes(c, tid, weights_bytes(90 + i))
        assert answers(d, tokens) == before
    finally:
        d.stop()


# ---- 11, 12, 13: config edits ------------------------------------------------------------------
CFG_TOKENS = make_tokens(["a", "b", "x"])


@pytest.fixture(scope="module")
def cfg_daemon(tmp_path_factory):
    """A daemon whose tenants.yaml is a Kubernetes-style ConfigMap mount: tenants.yaml ->
    ..data/tenants.yaml, ..data -> ..v1 (the symlink swap test relies on it)."""
    root = tmp_path_factory.mktemp("config")
    d = Daemon(root, dict(CFG_TOKENS),
                server_extra={"metrics_listen": f"127.0.0.1:{free_port()}"})
    _k8s_write(d, d.yaml(), first=True)
    d.start()
    for i, (tid, tok) in enumerate(CFG_TOKENS.items()):
        with d.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(100 + i))
    yield d
    d.stop()


_K8S_GEN = [0]


def _k8s_write(d: Daemon, text: str, first: bool = False) -> None:
    """Publish ``text`` the way the kubelet updates a ConfigMap volume: a new timestamped
    directory, a temporary ``..data_tmp`` symlink to it, renamed over ``..data``."""
    _K8S_GEN[0] += 1
    gen = d.root / f"..v{_K8S_GEN[0]}"
    gen.mkdir()
    (gen / "tenants.yaml").write_text(text)
    tmp = d.root / "..data_tmp"
    os.symlink(gen.name, tmp)
    os.replace(tmp, d.root / "..data")
    if first:  # (re)make tenants.yaml a link into ..data, atomically
        link = d.root / ".tenants.yaml.link"
        os.symlink("..data/tenants.yaml", link)
        os.replace(link, d.config)


def _count(d: Daemon, what: str) -> int:
    return d.logs().count(what)


APPLIED, REFUSED = "config applied", "config reload refused"


def _settle(d: Daemon, applied: int, refused: int, timeout: float = 10.0) -> float:
    """Wait until the log shows exactly these totals; then one more poll interval and debounce
    to prove nothing else is applied. Returns the seconds the first part took."""
    t0 = time.monotonic()
    wait_until(lambda: _count(d, APPLIED) >= applied and _count(d, REFUSED) >= refused, timeout,
               what=f"{applied} applied / {refused} refused reloads")
    took = time.monotonic() - t0
    time.sleep(0.9)  # > one poll (0.5 s) + debounce (0.2 s): a second apply would show
    assert (_count(d, APPLIED), _count(d, REFUSED)) == (applied, refused)
    return took


def _plain_write(d: Daemon, text: str | bytes) -> None:
    """Replace the file in place (truncate and write): what ``echo > tenants.yaml`` does."""
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(d.config, mode) as f:
        f.write(text)


@promise(11)
def test_bad_config_edits_keep_the_last_good_config(cfg_daemon, rel):
    """Invalid YAML, schema errors, a missing checkpoint, restart-only changes, duplicate ids,
    an empty, a binary or a deleted file: each edit refused once and reported, the last good
    config kept, traffic unaffected; the fixed file applies within one poll."""
    d = cfg_daemon
    good = d.yaml()
    ab = {k: CFG_TOKENS[k] for k in ("a", "b")}
    bad_edits = {
        "invalid YAML": "server: [this is not\n  valid yaml",
        "unknown key": good.replace("tenants:\n", "tenants:\n  - id: zz\n    max_qeue: 4\n"
                                    f"    token_sha256: {'d' * 64}\n"),
        "wrong type": good.replace("  max_wait_ms: 1", "  max_wait_ms: soon"),
        "out of range": good.replace("  max_wait_ms: 1", "  max_wait_ms: -1"),
        "missing checkpoint (weights)": good.replace("config: bert-tiny",
                                                     "config: ./no/such/checkpoint"),
        "restart-only change": good.replace(d.addr, "127.0.0.1:1"),
        "duplicate tenant id": good + f"  - id: a\n    token_sha256: {'c' * 64}\n",
        "duplicate token": good + f"  - id: y\n    token_sha256: {hash_token(CFG_TOKENS['a'])}\n",
        "empty file": "",
        "binary garbage": bytes(range(256)) * 4,
        "tenants removed by a truncated list": good.split("  - id: b")[0] + "  - id: [\n",
    }
    applied, refused = _count(d, APPLIED), _count(d, REFUSED)
    port = int(d.server_extra["metrics_listen"].rsplit(":", 1)[1])
    failed0 = metric(scrape(port), "itif_config_reloads_total", result="failed")
    before = answers(d, CFG_TOKENS)
    with Traffic(d, ab) as traffic:
        for what, text in bad_edits.items():
            if isinstance(text, bytes):
                _plain_write(d, text)
            else:
                _k8s_write(d, text)
            rel.faults += 1
            refused += 1
            _settle(d, applied, refused)
            assert_same(answers(d, CFG_TOKENS), before)
        os.unlink(d.config)  # the file disappears
        rel.faults += 1
        refused += 1
        _settle(d, applied, refused)
        assert_same(answers(d, CFG_TOKENS), before)
        # fixed: the good file plus a new tenant applies within one poll
        newtok = "n-token-1234567890"
        t0 = time.monotonic()
        d.config.write_text(good + f"  - id: n\n    token_sha256: {hash_token(newtok)}\n")
        with d.client(newtok) as c:
            wait_until(lambda: code_of(lambda: c.get_tenant("n")) == OK, 10,
                       what="the fixed config applied")
        took = time.monotonic() - t0
        applied += 1
        _settle(d, applied, refused)
        d.write_config(good)  # and back
        applied += 1
        _settle(d, applied, refused)
    rel.inputs += traffic.total()
    rel.notes["fixed config applied after (s)"] = round(took, 2)
    assert not traffic.not_ok(), traffic.codes
    assert took < 3.0  # poll 0.5 s + debounce 0.2 s (+ scheduling slack)
    assert answers(d, CFG_TOKENS) == before
    assert "config file not found" in d.logs()
    failed = metric(scrape(port), "itif_config_reloads_total", result="failed") - failed0
    assert failed == len(bad_edits) + 1, failed  # every refusal is exposed, once


@promise(12)
def test_half_written_editor_rename_and_symlink_swap_apply_once(cfg_daemon, rel):
    """A Kubernetes ``..data`` symlink swap, a temp file renamed over, an editor's rename dance
    (original moved away, new file written, backup deleted) and a file written in place in two
    halves 0.2 s apart (the first half alone is valid YAML that drops tenants): each change
    applied exactly once, never a half state (traffic to every tenant stays OK throughout)."""
    d = cfg_daemon
    _k8s_write(d, d.config.read_text(), first=True)  # same content as now: not a change
    applied, refused = _count(d, APPLIED), _count(d, REFUSED)
    _settle(d, applied, refused)
    added: dict[str, str] = {}
    steps = {
        "kubernetes symlink swap": lambda text: _k8s_write(d, text),
        "temp file renamed over": lambda text: d.write_config(text),
        "editor rename dance": lambda text: _editor(d, text),
        "half-written in place": lambda text: _halves(d, text),
    }
    with Traffic(d, CFG_TOKENS) as traffic:
        for i, (what, write) in enumerate(steps.items()):
            added[f"e{i}"] = f"e{i}-token-abcdefgh"
            write(d.yaml(tenants={**CFG_TOKENS, **added}))
            rel.faults += 1
            applied += 1
            _settle(d, applied, refused)
            with d.client(added[f"e{i}"]) as c:
                assert code_of(lambda: c.get_tenant(f"e{i}")) == OK, what
        d.write_config(d.yaml())  # back to the three tenants
        applied += 1
        _settle(d, applied, refused)
    rel.inputs += traffic.total()
    assert not traffic.not_ok(), traffic.codes


def _editor(d: Daemon, text: str) -> None:
    """vim without writebackup tricks: move the original away, write the new file, drop the
    backup (the path is missing for a moment)."""
    backup = d.config.with_name("tenants.yaml~")
    os.replace(d.config, backup)
    d.config.write_text(text)
    backup.unlink()


def _halves(d: Daemon, text: str) -> None:
    """Truncate and write the first half (a valid YAML that lists fewer tenants), wait 0.2 s
    (less than one poll), write the rest."""
    cut = text.index("  - id: b")
    with open(d.config, "w") as f:
        f.write(text[:cut])
        f.flush()
        time.sleep(0.2)
        f.write(text[cut:])


def _quota_effect(d: Daemon, q: int) -> list:
    """Tenant a's new max_queue ``q`` is in force: an InferBatch of q+1 rows is refused whole
    (INVALID_ARGUMENT: more rows than the queue holds can never be queued), one of q-2 rows is
    accepted and served (a's
    two traffic threads hold at most 2 more in its queue). The sequence 8, 40, 5 makes each
    check fail under the previous quota (9 rows fit under the default 64, 38 are refused under
    8, 6 fit under 40)."""
    with d.client(CFG_TOKENS["a"]) as c:
        over = code_of(lambda: c.infer_batch("a", [c.make_input(PROBE)] * (q + 1), timeout=60))
        fits = code_of(lambda: c.infer_batch("a", [c.make_input(PROBE)] * (q - 2), timeout=60))
    assert (over, fits) == (C.INVALID_ARGUMENT, OK), (q, over, fits)
    return [q, over.name, fits.name]


@promise(13)
@pytest.mark.slow
def test_reload_under_traffic_drops_nothing_and_removed_tenant_drains(tmp_path, rel):
    """Reloads (quota changes, a tenant removed, re-added) while three tenants send traffic
    and every forward takes 0.5 s (test hook): nothing dropped; the removed tenant's calls that
    were queued or running when the removal applied all finish OK, its new calls are refused
    (UNAUTHENTICATED, or NOT_FOUND at the boundary), and re-adding it restores its weights."""
    d = Daemon(tmp_path, dict(CFG_TOKENS), faults="slow:500").start()
    stop_x = threading.Event()
    try:
        for i, (tid, tok) in enumerate(CFG_TOKENS.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(100 + i))
        before = answers(d, CFG_TOKENS)
        ab = {k: CFG_TOKENS[k] for k in ("a", "b")}
        x_done: list[tuple[float, str]] = []  # (when it returned, code)

        def x_loop():
            with d.client(CFG_TOKENS["x"]) as c:
                while not stop_x.is_set():
                    code = code_of(lambda: c.infer("x", PROBE, timeout=60))
                    x_done.append((time.monotonic(), code.name))

        applied = _count(d, APPLIED)
        with Traffic(d, ab, threads_per_tenant=2) as traffic:
            xs = [threading.Thread(target=x_loop) for _ in range(4)]
            for t in xs:
                t.start()
            quota_checks = []
            for q in (8, 40, 5):  # quota changes under traffic, each checked by its effect
                d.write_config(d.yaml(tenant_extra={"a": {"max_queue": q, "weight": 1 + q % 3}}))
                applied += 1
                wait_until(lambda: _count(d, APPLIED) >= applied, 10, what="quota reload")
                rel.faults += 1
                quota_checks.append(_quota_effect(d, q))
                rel.inputs += 2
            wait_until(lambda: sum(1 for _, c in x_done if c == "OK") >= 4, 30, what="x OK")
            d.write_config(d.yaml(tenants=ab))  # remove x while its calls are in flight
            rel.faults += 1
            with d.client(ADMIN) as c:
                wait_until(lambda: code_of(lambda: c.get_tenant("x")) == C.NOT_FOUND, 10,
                           step=0.005, what="x removed")
            removed_at = time.monotonic()
            wait_until(lambda: any(t > removed_at and c != "OK" for t, c in x_done), 30,
                       what="x refused after removal")
            stop_x.set()
            for t in xs:
                t.join(60)
            d.write_config(d.yaml())  # x comes back with its stored weights
            rel.faults += 1
            with d.client(CFG_TOKENS["x"]) as c:
                wait_until(lambda: code_of(lambda: c.infer("x", PROBE)) == OK, 10,
                           what="x restored")
        drained = sum(1 for t, c in x_done if t > removed_at and c == "OK")
        rel.inputs += traffic.total() + len(x_done)
        rel.notes["x calls that finished OK after their tenant was removed"] = drained
        rel.notes["max_queue reloads: (q, batch of q+1, batch of q-2)"] = quota_checks
        codes = Counter(c for _, c in x_done)
        rel.codes.update(codes)
        assert set(codes) <= {"OK", "UNAUTHENTICATED", "NOT_FOUND"}, codes
        assert drained >= 1, x_done[-10:]
        assert not traffic.not_ok(), traffic.codes
        assert answers(d, CFG_TOKENS) == before
    finally:
        stop_x.set()  # a failed check must not leave the x threads calling for ever
        d.stop()


W_TOKENS = make_tokens(["wa", "wb", "z"])
W_CALLS = 16  # calls of each of wa and wb queued behind one running forward


def _served_order(d: Daemon) -> list[str]:
    """Queue W_CALLS calls of wa and of wb at once behind a running forward (one request per
    batch), return the order in which they finish (tenant names)."""
    done: list[str] = []
    with d.client(W_TOKENS["z"]) as cz, d.client(W_TOKENS["wa"]) as ca, \
            d.client(W_TOKENS["wb"]) as cb, d.client(ADMIN) as adm:
        blocker = cz.stub.Infer.future(itif_pb2.InferRequest(
            tenant="z", input=cz.make_input(PROBE)), metadata=cz.metadata, timeout=60)
        wait_until(lambda: adm.get_tenant("z").queue_depth == 0, 5, what="blocker running")
        futs = []
        for _ in range(W_CALLS):
            for tid, c in (("wa", ca), ("wb", cb)):
                f = c.stub.Infer.future(itif_pb2.InferRequest(
                    tenant=tid, input=c.make_input(PROBE)), metadata=c.metadata, timeout=60)
                f.add_done_callback(lambda f, tid=tid: done.append(tid))  # append is atomic
                futs.append(f)
        assert not blocker.done(), "the blocker finished before the calls were queued"
        assert code_of(blocker.result) == OK
        assert all(code_of(f.result) == OK for f in futs)
    wait_until(lambda: len(done) == 2 * W_CALLS, 5, what="every completion recorded")
    return done


@promise(13)
@pytest.mark.slow
def test_weight_reload_changes_the_share_each_tenant_is_served(tmp_path, rel):
    """A reloaded fairness ``weight`` takes effect, seen in what is served, not in a log line:
    wa and wb each queue 16 equal calls behind a running forward, batches hold one request;
    with weights 3:1 the first 16 served hold >= 10 of wa's (12 expected), and after a live
    reload to 1:3 they hold <= 6 of wa's (4 expected, 5 when wb starts with the one request of
    virtual time it ran ahead in the previous round); equal weights first, as a control (8)."""
    d = Daemon(tmp_path, dict(W_TOKENS), faults="slow:250",
               scheduler={"max_wait_ms": 1, "max_batch_size": 1}).start()
    shares = {}
    try:
        for i, (tid, tok) in enumerate(W_TOKENS.items()):
            with d.client(tok) as c:
                upload_bytes(c, tid, weights_bytes(150 + i))
        applied = _count(d, APPLIED)
        for wa, wb in ((1, 1), (3, 1), (1, 3)):
            if (wa, wb) != (1, 1):
                d.write_config(d.yaml(tenant_extra={"wa": {"weight": wa}, "wb": {"weight": wb}}))
                applied += 1
                wait_until(lambda: _count(d, APPLIED) >= applied, 10, what="weight reload")
                rel.faults += 1
            order = _served_order(d)
            rel.inputs += 2 * W_CALLS + 1
            shares[f"{wa}:{wb}"] = order[:W_CALLS].count("wa")
        rel.notes[f"wa's calls among the first {W_CALLS} served, by weights wa:wb"] = shares
        assert 6 <= shares["1:1"] <= 10, shares
        assert shares["3:1"] >= 10, shares
        assert shares["1:3"] <= 6, shares
    finally:
        d.stop()


# ---- 15, 16: out-of-memory in a forward; client killed mid-upload -----------------------------
FLT_TOKENS = make_tokens(["o", "p", "q"])


@pytest.fixture(scope="module")
def flt_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("faults"), dict(FLT_TOKENS), faults="oom:o")
    d.start()
    for i, (tid, tok) in enumerate(FLT_TOKENS.items()):
        with d.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(110 + i))
    yield d
    d.stop()


@promise(15)
def test_out_of_memory_in_a_forward_fails_that_batch_cleanly(flt_daemon, rel):
    """Every forward holding a request of tenant o raises CUDA's out-of-memory error (test
    hook). Concurrent traffic of o and p: o's calls all fail RESOURCE_EXHAUSTED, p's calls all
    succeed (a batch that ran out of memory runs each tenant's part again alone, so p's part
    of a batch it shared with o is answered; never INTERNAL, never a hang). o and p taking
    turns: every o call fails, every p call succeeds. The daemon keeps serving throughout."""
    d = flt_daemon
    with Traffic(d, {"o": FLT_TOKENS["o"], "p": FLT_TOKENS["p"]}, threads_per_tenant=3) as tr:
        wait_until(lambda: tr.codes["o"]["RESOURCE_EXHAUSTED"] >= 60, 60, what="OOMs")
    rel.faults += sum(tr.codes["o"].values())
    rel.inputs += tr.total()
    for codes in tr.codes.values():
        rel.codes.update(codes)
    assert set(tr.codes["o"]) == {"RESOURCE_EXHAUSTED"}, tr.codes
    assert set(tr.codes["p"]) == {"OK"}, tr.codes
    rel.notes["concurrent phase, p OK"] = tr.codes["p"]["OK"]
    with d.client(FLT_TOKENS["o"]) as co, d.client(FLT_TOKENS["p"]) as cp:
        for _ in range(20):
            code, msg = error_of(lambda: co.infer("o", PROBE))
            assert code == C.RESOURCE_EXHAUSTED and "out of memory" in msg.lower(), msg
            assert code_of(lambda: cp.infer("p", PROBE)) == OK
            rel.faults += 1
            rel.inputs += 2
        assert cp.health_status() == "SERVING"
    assert d.proc.poll() is None
    assert "Traceback" not in d.logs()


CLIENT = r"""
import struct, sys, time
import grpc  # only grpc: the client starts in a fraction of a second
addr, token, path, pace = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
blob = open(path, "rb").read()
msgs, i = [], 0
while i < len(blob):  # length-prefixed, already serialized UploadWeightsRequest messages
    (n,) = struct.unpack_from("<I", blob, i)
    msgs.append(blob[i + 4:i + 4 + n])
    i += 4 + n
def stream():
    for m in msgs:
        yield m
        time.sleep(pace)
    print("sent", flush=True)  # the stream half-closes now; the server verifies and commits
call = grpc.insecure_channel(addr).stream_unary("/itif.v1.Itif/UploadWeights")
call(stream(), metadata=(("authorization", "Bearer " + token),))
"""


def _serialized_upload(path: Path, tenant: str, data: bytes) -> Path:
    """The whole UploadWeights stream, serialized, for the client process."""
    with open(path, "wb") as f:
        for m in upload_messages(tenant, data, chunk=16 * 1024):
            raw = m.SerializeToString()
            f.write(struct.pack("<I", len(raw)) + raw)
    return path


def _received(d: Daemon, tenant: str, data: bytes) -> bool:
    """The server holds every byte of ``data`` in a temp file, or has committed it already."""
    for f in d.tmp_files():
        try:
            if os.path.getsize(d.tmp_dir / f) >= len(data):
                return True
        except FileNotFoundError:
            pass
    try:
        return (d.weights_dir / f"{tenant}.sha256").read_text().split()[0] == sha256(data)
    except (FileNotFoundError, IndexError):
        return False


def _upload_fds(d: Daemon) -> list[str]:
    return [f for f in d.fds() if str(d.tmp_dir) in f or f.endswith(".upload")]


@promise(16)
def test_client_killed_mid_upload_leaks_nothing(flt_daemon, tmp_path, rel):
    """A client process SIGKILLed in the middle of its upload stream (and, harder, once the
    server holds every byte, while it verifies and commits): the temp file is removed, the
    upload lock released (the next upload goes through at once), no descriptor is left open,
    and the stored pair is exactly the old or the new one."""
    d = flt_daemon
    tok = FLT_TOKENS["q"]
    versions = {sha256(weights_bytes(s)): s for s in (112, 120, 121)}
    files = {s: _serialized_upload(tmp_path / f"{s}.stream", "q", weights_bytes(s))
             for s in (120, 121)}
    baseline = len(d.fds())
    kills = Counter()
    for k in range(8):
        seed = 120 + k % 2
        late = k >= 4  # first mid-stream kills, then kills once the server has every byte
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, d.addr, tok, str(files[seed]),
             "0.0" if late else "0.02"], stdout=subprocess.PIPE, text=True)
        try:
            if late:  # kill while the server verifies and commits (or just after)
                wait_until(lambda: _received(d, "q", weights_bytes(seed)), 30, step=0.001,
                           what="the whole upload on the server")
            else:
                wait_until(lambda: any(os.path.getsize(d.tmp_dir / f) > 32 * 1024
                                       for f in d.tmp_files() if (d.tmp_dir / f).exists()), 30,
                           what="a partial upload on disk")
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        rel.faults += 1
        kills["upload complete on the server" if late else "mid-stream"] += 1
        wait_until(lambda: d.tmp_files() == [] and not _upload_fds(d) and not any(
            n.endswith(".pending") for n in os.listdir(d.weights_dir)), 15,
            what="temp file and its descriptor gone, any commit in progress finished")
        data, side = d.stored("q")
        assert side == sha256(data) and side in versions
        if late:  # did the server commit although its client was gone?
            kills["committed anyway" if side == sha256(weights_bytes(seed)) else "dropped"] += 1
        with d.client(tok) as c:  # the lock is released (at once, or when a commit in
            done: list = []  # progress when the client died has finished)
            wait_until(lambda: done.append(error_of(
                lambda: upload_bytes(c, "q", weights_bytes(112), timeout=30))) or
                done[-1][0] != C.RESOURCE_EXHAUSTED, 10, what="upload lock released")
            assert done[-1][0] == OK, done
            rel.notes.setdefault("upload retries", 0)
            rel.notes["upload retries"] += len(done) - 1
        data, side = d.stored("q")
        assert side == sha256(data) and side in versions
    rel.notes["client kills"] = dict(kills)
    wait_until(lambda: len(d.fds()) <= baseline + 2, 15,
               what=f"descriptors back to ~{baseline} (now {len(d.fds())})")
    rel.notes["daemon fds before/after"] = [baseline, len(d.fds())]
    with d.client(tok) as c:
        assert c.health_status() == "SERVING"
        assert infer_sha(c, "q", PROBE)[1] == sha256(weights_bytes(112))
