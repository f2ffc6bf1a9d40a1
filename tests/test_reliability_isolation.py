"""Reliability, tenant isolation (promises 23-27 of shared/reference/reliability.md), against a
real daemon subprocess on loopback: tokens on every RPC (streams included), tenants that cannot
see or touch each other, path-like tenant ids, admin-only operations, TLS and mutual TLS."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from itif.config import hash_token
from itif.server._proto.itif.v1 import itif_pb2, itif_pb2_grpc
from tests.reliability_util import (
    ADMIN,
    OK,
    TLS,
    Daemon,
    code_of,
    error_of,
    infer_sha,
    make_tokens,
    promise,
    upload_bytes,
    upload_messages,
    wait_until,
    weights_bytes,
)

C = grpc.StatusCode
TOKENS = make_tokens(["a", "b"])
PROBE = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("isolation"), dict(TOKENS))
    d.start()
    for i, (tid, tok) in enumerate(TOKENS.items()):
        with d.client(tok) as c:
            upload_bytes(c, tid, weights_bytes(30 + i))
    yield d
    d.stop()


def snapshot(d: Daemon) -> dict:
    """Every file under the daemon's directory with its size and mtime (the log excepted), the
    stored pairs, and the temp directory's mtime: anything written shows up."""
    out = {}
    for p in sorted(d.root.rglob("*")):
        if p.name == "daemon.log":
            continue
        st = p.lstat()
        out[str(p.relative_to(d.root))] = (st.st_size, st.st_mtime_ns)
    out["<tmp mtime>"] = d.tmp_dir.stat().st_mtime_ns
    return out


def outputs_of(d: Daemon) -> dict:
    res = {}
    for tid, tok in TOKENS.items():
        with d.client(tok) as c:
            res[tid] = infer_sha(c, tid, PROBE)
    return res


# ---- the calls, with raw metadata ---------------------------------------------------------
def _calls(channel, md, tenant: str, upload: bytes):
    """Every RPC of the daemon that can name a tenant, as zero-argument callables."""
    stub = itif_pb2_grpc.ItifStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    inp = itif_pb2.InferInput(input_ids=itif_pb2.TokenIds(ids=PROBE))
    kw = dict(metadata=md, timeout=20)
    return {
        "Infer": lambda: stub.Infer(itif_pb2.InferRequest(tenant=tenant, input=inp), **kw),
        "InferBatch": lambda: stub.InferBatch(
            itif_pb2.InferBatchRequest(tenant=tenant, inputs=[inp, inp]), **kw),
        "GetTenant": lambda: stub.GetTenant(itif_pb2.GetTenantRequest(tenant=tenant), **kw),
        "ListTenants": lambda: stub.ListTenants(itif_pb2.ListTenantsRequest(), **kw),
        "DeleteWeights": lambda: stub.DeleteWeights(
            itif_pb2.DeleteWeightsRequest(tenant=tenant), **kw),
        "UploadWeights": lambda: stub.UploadWeights(
            upload_messages(tenant, upload, chunk=16 * 1024), **kw),
        "Health.Check": lambda: health.Check(health_pb2.HealthCheckRequest(service=tenant), **kw),
        "Health.Watch": lambda: next(iter(health.Watch(
            health_pb2.HealthCheckRequest(service=tenant), metadata=md, timeout=5))),
    }


BAD_AUTH = {
    "no metadata": (),
    "wrong token": (("authorization", "Bearer wrong"),),
    "empty bearer": (("authorization", "Bearer "),),
    "no scheme": (("authorization", TOKENS["a"]),),
    "lower-case scheme": (("authorization", f"bearer {TOKENS['a']}"),),
    "Basic scheme": (("authorization", f"Basic {TOKENS['a']}"),),
    "the stored hash as token": (("authorization", f"Bearer {hash_token(TOKENS['a'])}"),),
    "token with a suffix": (("authorization", f"Bearer {TOKENS['a']}x"),),
    "token prefix": (("authorization", f"Bearer {TOKENS['a'][:-1]}"),),
    "4 KiB token": (("authorization", "Bearer " + "x" * 4096),),
    "other header": (("x-authorization", f"Bearer {TOKENS['a']}"),),
    "admin hash as token": (("authorization", f"Bearer {hash_token(ADMIN)}"),),
}


@promise(23)
def test_no_or_wrong_token_on_every_rpc_is_unauthenticated_and_writes_nothing(daemon, rel):
    """No token / wrong token (12 variants) on every RPC, the streaming upload included ->
    UNAUTHENTICATED, and not one byte written anywhere under the daemon's directory."""
    before_files, before_out = snapshot(daemon), outputs_of(daemon)
    blob = weights_bytes(40) * 8  # a multi-chunk stream
    with grpc.insecure_channel(daemon.addr) as ch:
        for what, md in BAD_AUTH.items():
            for tenant in ("a", "b"):
                for rpc, call in _calls(ch, md, tenant, blob).items():
                    code, msg = error_of(call)
                    rel.inputs += 1
                    rel.saw(code)
                    assert code == C.UNAUTHENTICATED, (what, rpc, tenant, code, msg)
    assert snapshot(daemon) == before_files
    assert outputs_of(daemon) == before_out
    assert daemon.tmp_files() == []


@promise(24)
def test_other_tenant_is_refused_exactly_like_a_missing_one(daemon, rel):
    """A's token naming B gets exactly what A's token naming a tenant that does not exist gets
    (code and message, the name aside), on every RPC; B's outputs are never returned."""
    before_files, before_out = snapshot(daemon), outputs_of(daemon)
    blob = weights_bytes(40)
    md = (("authorization", f"Bearer {TOKENS['a']}"),)
    with grpc.insecure_channel(daemon.addr) as ch:
        b_calls = _calls(ch, md, "b", blob)
        ghost_calls = _calls(ch, md, "zz", blob)
        for rpc in b_calls:
            if rpc == "ListTenants":
                continue
            got_b = error_of(b_calls[rpc])
            got_ghost = error_of(ghost_calls[rpc])
            rel.inputs += 2
            rel.saw(got_b[0])
            assert got_b[0] in (C.NOT_FOUND, C.PERMISSION_DENIED), (rpc, got_b)
            assert (got_b[0], got_b[1].replace("'b'", "<t>")) == (
                got_ghost[0], got_ghost[1].replace("'zz'", "<t>")), rpc
        tenants = itif_pb2_grpc.ItifStub(ch).ListTenants(itif_pb2.ListTenantsRequest(),
                                                        metadata=md, timeout=10).tenants
        assert [t.id for t in tenants] == ["a"]
    assert snapshot(daemon) == before_files and outputs_of(daemon) == before_out


PATH_IDS = ["../b", "../../etc/passwd", "/abs", "/tmp/x", "a\x00", "a\x00b", "a/../b", "..",
            ".", "", " a", "a ", "A", "b/", "a\\..\\b", "%2e%2e%2fb", "a\n", "\u0430",
            "a" * 64, "tmp", "weights", "store", "b.safetensors", "b.sha256", "*", "a;rm -rf /"]


@promise(25)
def test_tenant_cannot_write_another_and_path_like_ids_refused(daemon, tmp_path, rel):
    """A cannot overwrite B's weights; ids such as ``../b``, ``/abs``, ``a\\x00`` are refused
    for every RPC, with A's token and with the admin's; nothing is written anywhere (the whole
    daemon directory is compared, and no file appears at the absolute paths named)."""
    before_files, before_out = snapshot(daemon), outputs_of(daemon)
    evil = weights_bytes(41)
    with daemon.client(TOKENS["a"]) as c:
        assert code_of(lambda: upload_bytes(c, "b", evil)) == C.NOT_FOUND
        assert code_of(lambda: c.delete_weights("b")) == C.PERMISSION_DENIED
    outside = [tmp_path / "evil", tmp_path / "evil2"]
    ids = PATH_IDS + [str(outside[0]), f"../../../../../../..{outside[1]}"]
    for token in (TOKENS["a"], ADMIN):
        md = (("authorization", f"Bearer {token}"),)
        with grpc.insecure_channel(daemon.addr) as ch:
            for tid in ids:
                for rpc, call in _calls(ch, md, tid, evil).items():
                    if rpc == "ListTenants" or (tid == "" and rpc.startswith("Health")):
                        continue  # Health with service "" is the daemon's own (public) health
                    code, msg = error_of(call)
                    rel.inputs += 1
                    rel.saw(code)
                    assert code in (C.NOT_FOUND, C.INVALID_ARGUMENT, C.PERMISSION_DENIED), (
                        token == ADMIN, rpc, tid, code, msg)
    assert not any(p.exists() for p in outside)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert snapshot(daemon) == before_files and outputs_of(daemon) == before_out


@promise(25)
def test_path_like_tenant_ids_in_a_config_edit_are_refused(daemon, rel):
    """A tenants.yaml edit naming a tenant ``../evil`` (or ``/abs``, ``a\\x00``) is refused as a
    whole: a valid tenant added by the same edit does not appear either; the last good config
    keeps serving."""
    before_out = outputs_of(daemon)
    good = daemon.yaml()
    newcomer = "c-token-0123456789"
    try:
        for bad in ("../evil", "/abs", "a\\x00", "A"):
            n = daemon.logs().count("config reload refused")
            daemon.write_config(good + f"  - id: c\n    token_sha256: {hash_token(newcomer)}\n"
                                f'  - id: "{bad}"\n    token_sha256: {"e" * 64}\n')
            rel.inputs += 1
            wait_until(lambda: daemon.logs().count("config reload refused") > n, 10,
                       what=f"reload of id {bad!r} refused")
            with daemon.client(newcomer) as c:  # the edit's valid half was not applied
                assert code_of(lambda: c.get_tenant("c")) == C.UNAUTHENTICATED, bad
            with daemon.client(ADMIN) as c:
                assert sorted(t.id for t in c.tenants()) == sorted(TOKENS), bad
            assert outputs_of(daemon) == before_out
    finally:
        daemon.write_config(good)
        time.sleep(1.5)  # one poll plus debounce: the good file is the baseline again
    assert outputs_of(daemon) == before_out


@promise(26)
def test_admin_operations_need_the_admin_token_and_there_is_no_url_upload(daemon, rel):
    """DeleteWeights needs the admin token (a tenant cannot delete even its own weights);
    ListTenants shows a tenant only itself; no method or request field of any service the daemon
    exposes takes a URL, so weights only ever arrive as uploaded bytes."""
    before_out = outputs_of(daemon)
    for tid, tok in TOKENS.items():
        with daemon.client(tok) as c:
            for target in TOKENS:
                code = code_of(lambda: c.delete_weights(target))
                rel.inputs += 1
                assert code == C.PERMISSION_DENIED, (tid, target, code)
            assert [t.id for t in c.tenants()] == [tid]
    assert outputs_of(daemon) == before_out
    with daemon.client(ADMIN) as c:
        assert sorted(t.id for t in c.tenants()) == sorted(TOKENS)
        assert c.get_tenant("b").state == itif_pb2.TenantInfo.READY

    # Every service and request field the daemon exposes, read through its own reflection.
    with grpc.insecure_channel(daemon.addr) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services="")]
        services = [s.name for s in next(iter(refl.ServerReflectionInfo(
            iter(reqs), timeout=10))).list_services_response.service]
        files = {}
        for svc in services:
            r = next(iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol=svc)]), timeout=10)))
            for raw in r.file_descriptor_response.file_descriptor_proto:
                fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files[fd.name] = fd
    assert "itif.v1.Itif" in services
    suspicious = ("url", "uri", "href", "http", "location", "remote", "fetch", "download")
    names = []
    for fd in files.values():
        for svc in fd.service:
            for m in svc.method:
                names.append(m.name.lower())
        stack = list(fd.message_type)
        while stack:
            msg = stack.pop()
            stack.extend(msg.nested_type)
            names += [f.name.lower() for f in msg.field]
    rel.inputs += len(names)
    assert names and not [n for n in names if any(s in n for s in suspicious)]
    itif_fields = {f.name for f in files["itif/v1/itif.proto"].message_type
                   if f.name == "UploadHeader" for f in f.field}
    assert itif_fields == {"tenant", "sha256", "total_size"}


@promise(26)
def test_admin_token_rotation_applies_live(daemon, rel):
    """Rotating server.admin_token_sha256 in tenants.yaml: the old admin token stops working at
    once, the new one works; tenants are unaffected."""
    new_admin = "rotated-admin-token"
    good = daemon.yaml()
    rotated = good.replace(hash_token(ADMIN), hash_token(new_admin))
    assert rotated != good
    before_files, before_out = snapshot(daemon), outputs_of(daemon)
    try:
        daemon.write_config(rotated)
        with daemon.client(new_admin) as c:
            wait_until(lambda: code_of(c.tenants) == OK, 10, what="new admin token accepted")
            assert sorted(t.id for t in c.tenants()) == sorted(TOKENS)  # it is the admin
        with daemon.client(ADMIN) as c:
            assert code_of(c.tenants) == C.UNAUTHENTICATED
            assert code_of(lambda: c.delete_weights("a")) == C.UNAUTHENTICATED
        rel.inputs += 4
        # tenants unaffected: every tenant's token still serves the same outputs (bit for bit,
        # same weights sha256), and the refused delete removed nothing
        assert outputs_of(daemon) == before_out
        assert {k: v for k, v in snapshot(daemon).items() if "tenants.yaml" not in k} == {
            k: v for k, v in before_files.items() if "tenants.yaml" not in k}
        rel.inputs += len(TOKENS)
    finally:
        daemon.write_config(good)
        with daemon.client(ADMIN) as c:
            wait_until(lambda: code_of(c.tenants) == OK, 10, what="admin token restored")
    with daemon.client(new_admin) as c:
        assert code_of(c.tenants) == C.UNAUTHENTICATED  # rotated back: the new one is gone
    assert outputs_of(daemon) == before_out


# ---- 27: TLS and mutual TLS -------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA with a server cert (127.0.0.1) and a client cert, and a rogue CA with its own
    client cert, made with the openssl command line."""
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                             "extendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue-server", "rogue-ca", "subjectAltName=IP:127.0.0.1\n")
    return d


def _tls_daemon(root: Path, pki: Path, mutual: bool) -> Daemon:
    tls = {"cert": str(pki / "server.pem"), "key": str(pki / "server.key")}
    if mutual:
        tls["client_ca"] = str(pki / "ca.pem")
    creds = TLS(ca=(pki / "ca.pem").read_bytes())
    if mutual:
        creds.client_key = (pki / "client.key").read_bytes()
        creds.client_cert = (pki / "client.pem").read_bytes()
    return Daemon(root, {"a": TOKENS["a"]}, server_extra={"tls": tls}, tls=creds)


def _refused(code: grpc.StatusCode) -> bool:
    return code == C.UNAVAILABLE  # the handshake fails: the call never reaches the server


@promise(27)
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_tls_refuses_plaintext_and_untrusted_client_certificates(tmp_path, pki, mutual, rel):
    """``server.tls`` set: a plaintext client is refused (every RPC, health included); a client
    that does not trust the server's CA is refused. With ``client_ca`` (mutual TLS) a client
    without a certificate, or with one from another CA, is refused too; the right certificate
    still needs the right token."""
    d = _tls_daemon(tmp_path, pki, mutual).start()
    try:
        with d.client(TOKENS["a"]) as c:
            upload_bytes(c, "a", weights_bytes(30))
            assert c.health_status() == "SERVING"
            good = c.infer("a", PROBE)["logits"]
        with d.client("wrong") as c:
            assert code_of(lambda: c.infer("a", PROBE)) == C.UNAUTHENTICATED
        ca = (pki / "ca.pem").read_bytes()
        rogue_ca = (pki / "rogue-ca.pem").read_bytes()
        clients = {
            "plaintext": None,
            "untrusting (rogue CA as root)": TLS(ca=rogue_ca),
        }
        if mutual:
            clients["TLS without a client certificate"] = TLS(ca=ca)
            clients["client certificate from another CA"] = TLS(
                ca=ca, client_key=(pki / "rogue.key").read_bytes(),
                client_cert=(pki / "rogue.pem").read_bytes())
            clients["server certificate as client certificate"] = TLS(
                ca=ca, client_key=(pki / "rogue-server.key").read_bytes(),
                client_cert=(pki / "rogue-server.pem").read_bytes())
        for what, creds in clients.items():
            c = d.client(TOKENS["a"], tls=creds if creds is not None else False)
            try:
                for call in (lambda: c.infer("a", PROBE, timeout=10),
                             lambda: c.health_status(timeout=10),
                             lambda: upload_bytes(c, "a", weights_bytes(31), timeout=10)):
                    code = code_of(call)
                    rel.inputs += 1
                    rel.saw(code)
                    assert _refused(code), (what, code)
            finally:
                c.close()
        with d.client(TOKENS["a"]) as c:
            assert (c.infer("a", PROBE)["logits"] == good).all()  # the refused upload did nothing
        assert d.tmp_files() == []
    finally:
        d.stop()


def test_a_refused_upload_tells_nothing_of_other_tenants_weights(tmp_path):
    """Tenant b's upload over the weight budget is refused with the same words whichever other
    tenant's weights fill the store: before, the message said how many bytes the store held
    (tenant a's weights, to the byte)."""
    import hashlib

    from itif.config import parse_config
    from itif.daemon import Daemon as InProcess
    from itif.errors import Overloaded
    from itif.safetensors_io import save_safetensors
    from tests.oracle import make_hf_model

    def weights(seed: int, labels: int) -> bytes:
        m = make_hf_model("bert-tiny", labels, seed)
        p = tmp_path / f"m{seed}-{labels}.safetensors"
        save_safetensors({k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}, p)
        return p.read_bytes()

    wb = weights(2, 3)
    cfg = (f"server:\n  listen: 127.0.0.1:0\n  data_dir: ./data\n"
           f"  admin_token_sha256: {hash_token('admin-x')}\n"
           f"backbone:\n  config: bert-tiny\n  device: cpu\n  dtype: float32\n"
           f"  max_weight_bytes: {int(len(wb) * 1.6)}\ntenants:\n"
           + "".join(f"  - id: {t}\n    token_sha256: {hash_token('tok-' + t)}\n" for t in "ab"))
    d = InProcess(parse_config(cfg, tmp_path))
    d.start()
    try:
        admin, a, b = (d.identify(f"Bearer {t}") for t in ("admin-x", "tok-a", "tok-b"))

        def up(who, tenant, data):
            return d.upload(who, tenant, hashlib.sha256(data).hexdigest(), len(data), [data])

        said = []
        for wa in (weights(1, 3), weights(1, 40)):  # a's weights, two sizes
            up(a, "a", wa)
            with pytest.raises(Overloaded) as e:
                up(b, "b", wb)
            said.append(str(e.value))
            d.delete_weights(admin, "a")
        assert said[0] == said[1], said
        assert up(b, "b", wb).weight_bytes > 0  # alone, it fits
    finally:
        d.stop(0)
