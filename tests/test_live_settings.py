"""Every tenants.yaml setting is applied live or refused live with "needs a restart" (issue 15,
item 8: ``server.max_upload_bytes`` and ``server.grace_s`` were logged as applied and not used).

The in-process tests change one setting at a time on a running :class:`itif.daemon.Daemon` and
check the value where it is used; a meta-test makes every field of every section appear in
exactly one of the tables below, so a new setting cannot be forgotten. The subprocess tests
show the effect of the server settings against a real ``itif serve``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from itif.config import (
    BackboneConfig,
    Config,
    SchedulerConfig,
    ServerConfig,
    Tenant,
    hash_token,
    parse_config,
)
from itif.daemon import Daemon as InProcess
from itif.errors import InvalidConfig
from itif.server._proto.itif.v1 import itif_pb2
from itif.server.errors import retry_after_ms
from tests.daemon_harness import ADMIN, Daemon, free_port
from tests.reliability_util import (
    code_of,
    error_of,
    upload_bytes,
    upload_messages,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode

# section.field -> (new value, what reads it now on the running daemon)
LIVE = {
    "server.admin_token_sha256": (hash_token("new-admin"),
                                  lambda d: _who(d, "new-admin") == (None, True)),
    "server.max_upload_bytes": (12345, lambda d: d.blobs.max_upload_bytes == 12345),
    "server.grace_s": (0.25, lambda d: d.config.server.grace_s == 0.25),
    "server.upload_idle_s": (0.5, lambda d: d.config.server.upload_idle_s == 0.5),
    "scheduler.max_batch_tokens": (777, lambda d: d.scheduler.max_batch_tokens == 777),
    "scheduler.max_batch_size": (7, lambda d: d.scheduler.max_batch_size == 7),
    "scheduler.max_wait_ms": (3.5, lambda d: d.scheduler.max_wait_ms == 3.5),
    "scheduler.strategy": ("pad_to_max", lambda d: d.engine.strategy == "pad_to_max"),
    "scheduler.isolate_tenants": (True, lambda d: d.scheduler.isolate_tenants is True),
    "scheduler.latency_sizing": (True, lambda d: d.scheduler.latency_sizing is True),
    "tenant.token_sha256": (hash_token("new-a"),
                            lambda d: _who(d, "new-a") == ("a", False)),
    "tenant.max_queue": (3, lambda d: _quota(d).max_queue == 3),
    "tenant.weight": (2.5, lambda d: _quota(d).weight == 2.5),
    "tenant.latency_target_ms": (40.0, lambda d: _quota(d).latency_target_ms == 40.0),
    "tenant.max_seq_len": (4, lambda d: _too_long_refused(d, 5)),
    "tenant.max_inflight": (3, lambda d: _admitted(d, "a") == 3),
    # read by the weight tiers (off in this daemon: tests/test_tiers.py shows the effect live)
    "tenant.pinned": (True, lambda d: d.config.tenant("a").pinned is True),
    # the limit a delta tenant's upload is checked against (read from the config per upload;
    # tests/test_delta.py shows a refusal above it)
    "tenant.max_error": (0.5, lambda d: d.config.tenant("a").error_limit == 0.5),
    "server.max_inflight_calls": (5, lambda d: _admitted(d, "") == 5),
    "server.max_active_calls": (2, lambda d: _through_gate(d, "a") == 2),
    "server.max_pending_reply_bytes": (4096, lambda d: not _reply_fits(d, 3000, 2000)),
    # the hint every transient overload's answer carries (itif.server.errors.retry_hint)
    "server.retry_after_ms": (4321, lambda d: retry_after_ms(d) == 4321),
    # what Daemon.submit_generate checks each request against (tests/test_generate_daemon.py
    # shows a reload refusing and admitting requests on a decoder daemon)
    "server.max_new_tokens": (7, lambda d: d.config.server.max_new_tokens == 7),
}
# section.field -> a changed value: the reload is refused and names the key
RESTART = {
    "server.listen": f"127.0.0.1:{free_port()}",
    "server.data_dir": "./elsewhere",
    "server.metrics_listen": f"127.0.0.1:{free_port()}",
    "server.http_listen": f"127.0.0.1:{free_port()}",
    "server.max_message_bytes": 2 << 20,
    "server.max_pending_calls": 1024,
    "server.max_streams_per_connection": 8,
    "server.ingress_processes": 2,
    "server.http_max_connections": 64,
    "server.http_max_connections_per_client": 16,
    "server.http_header_timeout_s": 2.5,
    "server.http_json_processes": 0,
    "server.tls": "tls",
    "backbone.config": "bert-small",
    "backbone.device": "auto",
    "backbone.dtype": "bfloat16",
    "backbone.max_seq_len": 16,
    "backbone.max_weight_bytes": 1 << 30,
    "backbone.kv_cache_bytes": 1 << 24,
    "backbone.device_weight_bytes": 1 << 30,
    "backbone.host_weight_bytes": 1 << 30,
}
# identity: what names the tenant, not one of its settings
NOT_SETTINGS = {"tenant.id"}
# section.field -> (a changed value, what the refusal says): fixed for the tenant's life
FIXED = {"tenant.base": ("a", "base is fixed for its life"),
         "tenant.compress": ("int8", "compress is fixed for its life")}
SECTIONS = {"server": ServerConfig, "backbone": BackboneConfig, "scheduler": SchedulerConfig,
            "tenant": Tenant}


def _who(d: InProcess, token: str) -> tuple[str | None, bool] | None:
    from itif.errors import Unauthenticated  # noqa: PLC0415

    try:
        who = d.identify(f"Bearer {token}")
    except Unauthenticated:
        return None
    return who.tenant, who.admin


def _quota(d: InProcess):
    return d.scheduler._q.tenants["a"].quota


def _too_long_refused(d: InProcess, n: int) -> bool:
    from itif.daemon import Identity  # noqa: PLC0415
    from itif.errors import InvalidRequest  # noqa: PLC0415
    from itif.requests import Request  # noqa: PLC0415

    try:
        d.submit(Identity("a"), "a", [Request("a", input_ids=list(range(1, n + 1)))])
    except InvalidRequest as e:
        return "max_seq_len" in str(e)
    return False


def _through_gate(d: InProcess, tenant: str, tries: int = 8) -> int:
    """Calls of ``tenant`` a fresh admission's fair gate lets through before one waits."""
    import asyncio  # noqa: PLC0415

    from itif.server.admission import Admission  # noqa: PLC0415

    gate = Admission(d).gate

    async def count() -> int:
        for n in range(tries):
            try:
                await asyncio.wait_for(gate.enter(tenant), 0.05)
            except asyncio.TimeoutError:
                return n
        return tries

    return asyncio.run(count())


def _admitted(d: InProcess, tenant: str, tries: int = 8) -> int:
    """Calls of ``tenant`` ("" = the admin) a fresh admission takes before refusing one
    (itif.server.admission reads its limits from the daemon's live config)."""
    from itif.errors import Overloaded  # noqa: PLC0415
    from itif.server.admission import Admission  # noqa: PLC0415

    adm = Admission(d)
    for n in range(tries):
        try:
            adm.enter(tenant, "peer")
        except Overloaded:
            return n
    return tries


def _reply_fits(d: InProcess, first: int, second: int) -> bool:
    """Whether a second reply of ``second`` bytes fits beside a held one of ``first``."""
    from itif.errors import Overloaded  # noqa: PLC0415
    from itif.server.admission import Admission  # noqa: PLC0415

    adm = Admission(d)
    adm.reserve(adm.enter("a", "p1"), first)
    try:
        adm.reserve(adm.enter("a", "p2"), second)
    except Overloaded:
        return False
    return True


def test_every_setting_is_live_or_refused_live():
    fields = {f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert fields == set(LIVE) | set(RESTART) | set(FIXED) | NOT_SETTINGS
    assert not set(LIVE) & set(RESTART)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    cfg = parse_config(
        "server:\n"
        f"  listen: 127.0.0.1:{free_port()}\n"
        "  data_dir: ./data\n"
        f"  admin_token_sha256: {hash_token('admin')}\n"
        "backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
        "tenants:\n"
        f"  - id: a\n    token_sha256: {hash_token('ta')}\n", root)
    d = InProcess(cfg)
    d.start()
    from itif.daemon import Identity  # noqa: PLC0415

    data = weights_bytes(184)
    d.upload(Identity(None, admin=True), "a", hashlib.sha256(data).hexdigest(), len(data), [data])
    yield d
    d.stop(0)


def _with(cfg: Config, key: str, value) -> Config:
    section, name = key.split(".")
    if section == "tenant":
        (t,) = cfg.tenants
        return dataclasses.replace(cfg, tenants=(dataclasses.replace(t, **{name: value}),))
    if name == "tls":
        from itif.config import TLSConfig  # noqa: PLC0415

        value = TLSConfig(cert=cfg.server.data_dir / "c.pem", key=cfg.server.data_dir / "k.pem")
    elif name == "data_dir":
        value = cfg.server.data_dir.parent / value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                     **{name: value})})


@pytest.mark.parametrize("key", sorted(LIVE))
def test_live_setting_reaches_what_uses_it(running, key):
    d = running
    before = d.config
    value, applied = LIVE[key]
    assert not applied(d), f"{key} already has the new value: the test would prove nothing"
    d.apply_config(_with(before, key, value))
    try:
        assert applied(d), key
    finally:
        d.apply_config(before)


@pytest.mark.parametrize("key", sorted(RESTART))
def test_restart_setting_is_refused_live_and_nothing_changes(running, key):
    d = running
    before = d.config
    with pytest.raises(InvalidConfig, match=rf"{key}.*needs a restart"):
        d.apply_config(_with(before, key, RESTART[key]))
    assert d.config is before


@pytest.mark.parametrize("key", sorted(FIXED))
def test_fixed_setting_is_refused_live_and_nothing_changes(running, key):
    d = running
    before = d.config
    value, message = FIXED[key]
    with pytest.raises(InvalidConfig, match=message):
        d.apply_config(_with(before, key, value))
    assert d.config is before


# ---- the server settings' effect on a real daemon ----------------------------------------------
def test_max_upload_bytes_changed_live_refuses_and_admits_uploads(tmp_path):
    d = Daemon(tmp_path / "d", {"a": "ta"})
    d.start()
    try:
        data = weights_bytes(180)
        d.server_extra = {"max_upload_bytes": len(data) - 1}
        d.write_config()
        with d.client("ta") as c:
            wait_until(lambda: code_of(lambda: upload_bytes(c, "a", data)) == C.RESOURCE_EXHAUSTED,
                       timeout=10, step=0.2, what="the smaller limit")
            code, msg = error_of(lambda: upload_bytes(c, "a", data))
            assert code == C.RESOURCE_EXHAUSTED and f"{len(data) - 1} byte limit" in msg, msg
            d.server_extra = {"max_upload_bytes": len(data)}
            d.write_config()
            wait_until(lambda: code_of(lambda: upload_bytes(c, "a", data)) == C.OK,
                       timeout=10, step=0.2, what="the larger limit")
    finally:
        d.stop()


def test_grace_s_changed_live_bounds_the_shutdown(tmp_path):
    """Started with grace_s 30 and a forward that takes 20 s; grace_s 0.5 set live: SIGTERM
    ends the process within a few seconds, not after the call (before the fix: 20 s)."""
    d = Daemon(tmp_path / "d", {"a": "ta"}, faults="slow:20000", server_extra={"grace_s": 30})
    d.start()
    try:
        with d.client("ta") as c:
            upload_bytes(c, "a", weights_bytes(181), timeout=120)  # its probe is slow too
            d.server_extra = {"grace_s": 0.5}
            d.write_config()
            wait_until(lambda: "config applied" in d.logs(), what="the reload")
            # the log says what changed (before: only the tenant lists, here all empty)
            assert "settings changed: server.grace_s" in d.logs()
            got = {}
            t = threading.Thread(target=lambda: got.update(code=code_of(
                lambda: c.infer("a", [1, 2, 3], timeout=60))))
            t.start()
            time.sleep(1.0)  # the call is in its forward
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(timeout=30)
            took = time.monotonic() - t0
            t.join(30)
        assert took < 8.0, took
        assert got["code"] in (C.UNAVAILABLE, C.CANCELLED), got
    finally:
        d.stop()


def test_idle_upload_is_aborted_and_frees_the_tenant(tmp_path):
    d = Daemon(tmp_path / "d", {"a": "ta"}, server_extra={"upload_idle_s": 1.0})
    d.start()
    try:
        data = weights_bytes(182)

        def stalled(empty: bool):
            msgs = upload_messages("a", data, chunk=4096)
            yield next(msgs)  # the header
            yield next(msgs)  # one chunk
            if empty:  # empty chunks are not progress (before: each one reset the idle timer)
                for _ in range(40):
                    time.sleep(0.5)
                    yield itif_pb2.UploadWeightsRequest(chunk=b"")
            time.sleep(30)  # then nothing (the call is over long before)

        with d.client("ta") as c:
            for empty in (False, True):
                t0 = time.monotonic()
                code, msg = error_of(lambda: c.stub.UploadWeights(
                    stalled(empty), metadata=c.metadata, timeout=60))
                took = time.monotonic() - t0
                assert code == C.DEADLINE_EXCEEDED and "upload_idle_s" in msg, (code, msg)
                assert took < 10, took
                wait_until(lambda: d.tmp_files() == [], what="the temp file to go")
            assert upload_bytes(c, "a", data).weight_bytes > 0  # the tenant's slot is free
    finally:
        d.stop()


def test_long_tenant_name_gets_not_found_with_a_short_message(tmp_path):
    d = Daemon(tmp_path / "d", {"a": "ta"})
    d.start()
    try:
        name = "x" * 17_000
        with d.client(ADMIN) as c:
            for call in (lambda: c.get_tenant(name), lambda: c.infer(name, [1, 2]),
                         lambda: c.delete_weights(name)):
                code, msg = error_of(call)
                assert code == C.NOT_FOUND and len(msg) < 300, (code, len(msg))
            code, msg = error_of(lambda: upload_bytes(c, name, b"abc"))
            assert code in (C.NOT_FOUND, C.INVALID_ARGUMENT) and len(msg) < 300, (code, len(msg))
    finally:
        d.stop()


def test_cli_upload_fits_a_1mib_message_limit(tmp_path):
    """A 3 MB file through ``itif upload`` against max_message_bytes 1 MiB (before the fix the
    CLI sent 1 MiB chunks plus framing and failed)."""
    from itif.safetensors_io import save_safetensors  # noqa: PLC0415
    from tests.reliability_util import state_dict  # noqa: PLC0415

    d = Daemon(tmp_path / "d", {"a": "ta"}, backbone="bert-small",
               server_extra={"max_message_bytes": "1MiB"})
    d.start()
    try:
        path = tmp_path / "w.safetensors"
        save_safetensors(state_dict(183, preset="bert-small"), path)
        assert path.stat().st_size > 3 << 20
        out = subprocess.run(
            [sys.executable, "-m", "itif", "upload", "--server", d.addr, "--token", "ta",
             "--tenant", "a", "--quiet", str(path)],
            capture_output=True, text=True, timeout=120, env={**os.environ})
        assert out.returncode == 0, out.stderr
        assert hashlib.sha256(path.read_bytes()).hexdigest() in out.stdout
        with d.client("ta") as c:
            assert c.get_tenant("a").state == itif_pb2.TenantInfo.READY
    finally:
        d.stop()

