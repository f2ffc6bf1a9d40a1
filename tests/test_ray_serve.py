"""The Ray Serve fleet (``itif.serve_ray``) on a local Ray instance: 2 replicas, 7 tenants.

One module-wide fleet, built from the committed Serve config (docs/scale-out/serve.yaml, its
``import_path`` and ``args`` with the test's tenants.yaml): a tiny random BERT backbone
(vocab 128, hidden 32), tenants t0..t5 whose weights a single writer (a plain daemon on the same
``data_dir``) committed to the shared blob store before the fleet started, and t6 without weights
(uploaded through the fleet by a test). Every answer is compared with the single-process engine
(``itif.Engine`` with the same files), and that engine with Hugging Face's model once.

Affinity is asked from Serve: each answer names the replica that produced it (``itif-replica``,
from ``serve.get_replica_context()``) and the multiplexed model id Serve routed it with
(``itif-tenant``); the replicas are Serve's live replica actors. Ray starts with 2 CPUs and no
dashboard; the deployments ask for no CPU (2 replicas, the router, Serve's controller and proxy
fit on 2 cores) and the replicas run torch on one thread each.

A second, smaller application on the same Ray instance (``gen_fleet``, route prefix ``/gen``)
serves ``/v1/completions``: a tiny GPT-2 backbone (tests/test_generate_daemon.py's, with its
word-level tokenizer), 2 replicas, 3 tenants committed by a single decoder daemon, whose
GenEngine is the oracle. Its tests read completions plain and streamed (server-sent events
through Serve's streaming), and check that a client leaving mid-stream cancels the generation
on the replica that runs it.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import random
import re
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml

import itif
from itif.config import hash_token, load_config
from itif.daemon import Daemon, Identity
from itif.generation.api import GenerateRequest
from itif.safetensors_io import save_safetensors, sha256_file
from tests.daemon_harness import ADMIN, free_port
from tests.doc_blocks import REPO, blocks
from tests.oracle import make_hf_model, reference
from tests.reliability_util import wait_until
from tests.test_generate_daemon import VOCAB, hf_model, weights_bytes, write_backbone

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
th = pytest.importorskip("tritonclient.http")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from itif import serve_ray  # noqa: E402

TENANTS = [f"t{i}" for i in range(6)]  # weights committed before the fleet starts
LATE = "t6"  # no weights until a test uploads them through the fleet
ALL = TENANTS + [LATE]
TOKENS = {t: f"{t}-token" for t in ALL}
APP = "itif"
SERVE_YAML = REPO / "docs/scale-out/serve.yaml"
RAYSERVICE_YAML = REPO / "docs/scale-out/rayservice.yaml"
DOC = REPO / "docs/scale-out.md"
DOC_ADDR = "127.0.0.1:8000"
BACKBONE = dict(model_type="bert", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)


def H(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class Fleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.backbone = root / "backbone" / "config.json"
        self.backbone.parent.mkdir()
        self.backbone.write_text(json.dumps(BACKBONE))
        self.config = root / "tenants.yaml"
        lines = ["server:", "  listen: 127.0.0.1:0", f"  data_dir: {root / 'data'}",
                 f"  admin_token_sha256: {hash_token(ADMIN)}", "backbone:",
                 f"  config: {self.backbone}", "  device: cpu", "  dtype: float32",
                 "scheduler:", "  max_wait_ms: 2", "tenants:"]
        for t in ALL:
            lines += [f"  - id: {t}", f"    token_sha256: {hash_token(TOKENS[t])}"]
        self.config.write_text("\n".join(lines) + "\n")
        self.files: dict[str, Path] = {}
        self.hf = {}
        for i, t in enumerate(ALL):
            self.hf[t] = make_hf_model(str(self.backbone), num_labels=2 + i % 3, seed=1600 + i)
            self.files[t] = root / f"{t}.safetensors"
            save_safetensors({k: v.contiguous() for k, v in self.hf[t].state_dict().items()},
                             self.files[t])
        self.engine = itif.Engine(str(self.backbone), device="cpu", dtype="float32")
        for t in ALL:
            self.engine.add_tenant(t, str(self.files[t]))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def commit_weights(self) -> None:
        """The single writer: a plain daemon on the same data_dir commits t0..t5, then stops."""
        d = Daemon(load_config(self.config))
        d.start()
        try:
            for t in TENANTS:
                data = self.files[t].read_bytes()
                d.upload(Identity(None, admin=True), t, sha256_file(self.files[t]), len(data),
                         [data])
        finally:
            d.stop(0)

    def want(self, tenant: str, ids: list[int], output: str = "logits") -> np.ndarray:
        (res,) = self.engine.infer([itif.Request(tenant, input_ids=ids, outputs=(output,))])
        return getattr(res, output)

    def replicas(self) -> set[str]:
        """Serve's live ItifReplica replica ids (its replica actors, by name)."""
        prefix = f"SERVE_REPLICA::{APP}#ItifReplica#"
        out = set()
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(prefix):
                try:
                    ray.get_actor(a["name"], namespace=a["namespace"])
                except ValueError:
                    continue
                out.add(a["name"][len(prefix):])
        return out

    def kill(self, replica: str) -> None:
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#ItifReplica#{replica}", namespace="serve")
        ray.kill(actor, no_restart=True)


def _serve_config() -> dict:
    return yaml.safe_load(SERVE_YAML.read_text())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    f.commit_weights()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="warning", configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": f.port})
        (cfg,) = ServeDeploySchema.model_validate(_serve_config()).applications
        module, _, builder = cfg.import_path.partition(":")
        app = getattr(importlib.import_module(module), builder)({**cfg.args,
                                                                 "config": str(f.config)})
        serve.run(app, name=cfg.name, route_prefix=cfg.route_prefix)
        yield f
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- one call of each kind, checked ------------------------------------------------------------
def _rand_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 128) for _ in range(rng.randrange(2, 12))]


def kserve_json(f: Fleet, client: httpx.Client, tenant: str, ids: list[int]) -> tuple[str, str]:
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)],
                        "data": ids}], "outputs": [{"name": "logits"}]}
    r = client.post(f"/v2/models/{tenant}/infer", json=body, headers=H(TOKENS[tenant]))
    assert r.status_code == 200, (tenant, r.status_code, r.text)
    out = r.json()["outputs"][0]
    np.testing.assert_allclose(np.asarray(out["data"], np.float32), f.want(tenant, ids),
                               atol=2e-5, rtol=1e-4)
    return r.headers[serve_ray.REPLICA_HEADER], r.headers[serve_ray.TENANT_HEADER]


def embeddings(f: Fleet, client, tenant: str, ids: list[int]) -> tuple[str, str]:
    raw = client.with_options(api_key=TOKENS[tenant]).embeddings.with_raw_response.create(
        model=tenant, input=[ids])
    got = np.asarray(raw.parse().data[0].embedding, np.float32)
    np.testing.assert_allclose(got, f.want(tenant, ids, "pooled"), atol=2e-5, rtol=1e-4)
    return raw.headers[serve_ray.REPLICA_HEADER], raw.headers[serve_ray.TENANT_HEADER]


def triton_binary(f: Fleet, client, tenant: str, ids: list[int]) -> None:
    t = th.InferInput("input_ids", [1, len(ids)], "INT64")
    t.set_data_from_numpy(np.asarray([ids], np.int64))  # binary tensor extension
    res = client.infer(tenant, [t], outputs=[th.InferRequestedOutput("logits")],
                       headers=H(TOKENS[tenant]))
    np.testing.assert_allclose(res.as_numpy("logits")[0], f.want(tenant, ids),
                               atol=2e-5, rtol=1e-4)


class Load:
    """Mixed traffic from ``workers`` threads until stopped: KServe JSON over httpx, OpenAI
    embeddings through the ``openai`` client, KServe binary tensors through tritonclient.http;
    every answer checked. ``seen[tenant]`` lists (time, replica) of the answers that name it."""

    def __init__(self, f: Fleet, tenants: list[str], workers: int = 6, seed: int = 0) -> None:
        self.f, self.tenants, self.workers = f, tenants, workers
        self.seed = seed
        self.stop = threading.Event()
        self.seen: dict[str, list[tuple[float, str]]] = defaultdict(list)
        self.errors: list[BaseException] = []
        self.answers = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(workers)]

    def _run(self, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        f = self.f
        hc = httpx.Client(base_url=f.url, timeout=120)
        oc = openai.OpenAI(base_url=f.url + "/v1", api_key="-", max_retries=0, timeout=120)
        tc = th.InferenceServerClient(f.url[len("http://"):], network_timeout=120)
        try:
            while not self.stop.is_set():
                tenant, ids = rng.choice(self.tenants), _rand_ids(rng)
                kind = rng.randrange(3)
                try:
                    if kind == 0:
                        who = kserve_json(f, hc, tenant, ids)
                    elif kind == 1:
                        who = embeddings(f, oc, tenant, ids)
                    else:
                        triton_binary(f, tc, tenant, ids)
                        who = None
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    with self.lock:
                        self.errors.append(e)
                    continue
                with self.lock:
                    self.answers += 1
                    if who is not None:
                        assert who[1] == tenant, who  # Serve routed it with its tenant's id
                        self.seen[tenant].append((time.monotonic(), who[0]))
        finally:
            hc.close()
            oc.close()
            tc.close()

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def wait_answers(self, n: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        start = self.answers
        while self.answers - start < n:
            assert not self.errors, self.errors[:3]
            assert time.monotonic() < end, f"{self.answers - start} answers in {timeout} s"
            time.sleep(0.05)


def _place(f: Fleet, client: httpx.Client, tenants: list[str]) -> dict[str, str]:
    """One call per tenant, in turn: Serve places each (the first call of a tenant goes to a
    replica holding the fewest); returns tenant -> replica."""
    rng = random.Random(7)
    out = {}
    for t in tenants:
        replica, routed = kserve_json(f, client, t, _rand_ids(rng))
        assert routed == t
        out[t] = replica
        # the replica reports its tenants to Serve's routers every 0.1 s: a call sent before
        # that may be placed on another replica as if it were the tenant's first
        time.sleep(1.0)
    return out


# ---- tests -------------------------------------------------------------------------------------
def test_engine_oracle_is_hugging_face(fleet):
    """The single-process engine the fleet is compared with equals HF's model per tenant."""
    ids = [3, 17, 99, 4, 51]
    for t in (TENANTS[0], TENANTS[4]):
        want = reference(fleet.hf[t], itif.Request(t, input_ids=ids))["logits"]
        np.testing.assert_allclose(fleet.want(t, ids), want, atol=1e-5)


def test_mixed_traffic_equals_the_engine_and_tenants_keep_their_replica(fleet):
    live = fleet.replicas()
    assert len(live) == 2, live
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        placed = _place(fleet, c, TENANTS)
        assert set(placed.values()) == live  # tenants are spread over both replicas
        with Load(fleet, TENANTS, workers=6, seed=1) as load:
            load.wait_answers(90)
        assert not load.errors, load.errors[:3]
        for t in TENANTS:
            replicas = {r for _, r in load.seen[t]}
            assert replicas == {placed[t]}, (t, replicas, placed[t])  # every call, one replica
        assert sum(len(v) for v in load.seen.values()) >= 45

        # a replica holds exactly the tenants routed to it (asked from each replica)
        for t in TENANTS:
            r = c.get(f"/v2/models/{t}/ready", headers=H(TOKENS[t]))
            assert r.status_code == 200 and r.headers[serve_ray.REPLICA_HEADER] == placed[t]

        # what has no tenant, or names none that is configured, goes to any replica and loads
        # nothing; errors keep the KServe body
        assert c.get("/v2/health/ready").status_code == 200
        r = c.post("/v2/models/nope/infer", json={"inputs": []}, headers=H(TOKENS["t0"]))
        assert r.status_code == 404 and "not found" in r.json()["error"]
        assert r.headers[serve_ray.TENANT_HEADER] == ""
        r = c.post("/v2/models/t1/infer", json={"inputs": []}, headers=H("wrong"))
        assert r.status_code == 401 and "token" in r.json()["error"]
        r = c.post("/v2/models/t1/infer", json={"inputs": []}, headers=H(TOKENS["t0"]))
        assert r.status_code == 404  # another tenant's model answers like an unknown one
        r = c.post("/v1/embeddings", content=b"{not json", headers=H(TOKENS["t0"]))
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_kill_a_replica_mid_load_loses_no_tenant(fleet):
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        placed = _place(fleet, c, TENANTS)
        # t6's weights are acknowledged by the fleet itself: uploaded through it (KServe
        # repository load, admin token), stored in the shared blob store by t6's replica
        data = base64.b64encode(fleet.files[LATE].read_bytes()).decode()
        r = c.post(f"/v2/repository/models/{LATE}/load", headers=H(ADMIN),
                   json={"parameters": {"file:model.safetensors": data}})
        assert r.status_code == 200, r.text
        holder = r.headers[serve_ray.REPLICA_HEADER]
        time.sleep(1.0)  # the replica reports that it holds t6 to Serve's routers (see _place)
        placed[LATE] = kserve_json(fleet, c, LATE, [5, 6, 7])[0]
        assert placed[LATE] == holder
        before = fleet.replicas()
        victims = [t for t in ALL if placed[t] == holder]
        with Load(fleet, ALL, workers=6, seed=2) as load:
            load.wait_answers(30)
            fleet.kill(holder)
            end = time.monotonic() + 150
            while not (len(fleet.replicas()) == 2 and holder not in fleet.replicas()):
                assert time.monotonic() < end, "Serve did not restart the replica"
                time.sleep(0.5)
            t_recovered = time.monotonic()
            load.wait_answers(60)
        assert not load.errors, load.errors[:3]  # no call failed, across the kill
        after = fleet.replicas()
        assert holder not in after and len(after) == 2 and len(after & before) == 1
        for t in victims:  # the killed replica's tenants answered again, by a live replica
            late = [r for when, r in load.seen[t] if when > t_recovered]
            assert late and set(late) <= after, (t, late, after)

    # recovered: every tenant, t6 included, answers correctly, each from one live replica
    with httpx.Client(base_url=fleet.url, timeout=120) as c:
        rng = random.Random(3)
        for t in ALL:
            got = {kserve_json(fleet, c, t, _rand_ids(rng))[0] for _ in range(4)}
            assert len(got) == 1 and got <= after, (t, got)


# ---- the committed configs and the documented snippets ------------------------------------------
def test_serve_config_and_rayservice_parse_with_serves_schema():
    cfg = ServeDeploySchema.model_validate(_serve_config())
    (app_cfg,) = cfg.applications
    assert app_cfg.import_path == "itif.serve_ray:app" and app_cfg.route_prefix == "/"
    assert app_cfg.args["num_replicas"] == 2
    service = yaml.safe_load(RAYSERVICE_YAML.read_text())
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    spec = service["spec"]
    inner = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    assert inner.applications[0].import_path == app_cfg.import_path
    workers = spec["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == 1 and workers["replicas"] == inner.applications[0].args["num_replicas"]
    assert inner.applications[0].args["num_gpus_per_replica"] == 1
    # the doc's `serve run` / `serve deploy` lines name this module and these files
    text = DOC.read_text()
    assert "serve run itif.serve_ray:app config=" in text
    assert "serve deploy docs/scale-out/serve.yaml" in text
    assert "docs/scale-out/rayservice.yaml" in text
    with pytest.raises(ValueError, match="config="):
        serve_ray.app({})


def test_replica_daemon_holds_and_releases_tenants(tmp_path):
    """What the multiplexed loader and Serve's eviction do to a replica's daemon, without Ray:
    nothing is held at start; a held tenant answers like the engine; an evicted one is refused
    and leaves the engine; held anew it answers again, and the old handle's collection (Python
    calls ``__del__`` once more) does not drop it."""
    import gc

    f = Fleet(tmp_path)
    f.commit_weights()
    d = serve_ray.FleetDaemon(load_config(f.config))
    d.start()
    admin = Identity(None, admin=True)
    try:
        assert not any(t in d.engine.store for t in ALL)  # nothing restored at start
        d.hold(LATE)  # no stored weights: stays without
        assert d.status[LATE].state.name == "NO_WEIGHTS" and LATE not in d.engine.store
        d.hold("nope")  # not configured: nothing
        held = serve_ray._Held(d, "t1")
        d.hold("t1")
        np.testing.assert_allclose(d.infer(admin, "t1", [itif.Request("", input_ids=[4, 5, 6])],
                                           timeout=30)[0].logits, f.want("t1", [4, 5, 6]),
                                   atol=2e-5)
        held.__del__()  # Serve's eviction
        held.__del__ = lambda _: None  # what Serve does next
        assert "t1" not in d.engine.store and d.status["t1"].state.name == "NO_WEIGHTS"
        with pytest.raises(itif.errors.NoWeights):
            d.infer(admin, "t1", [itif.Request("", input_ids=[4, 5, 6])], timeout=30)
        d.hold("t1")
        del held
        gc.collect()
        assert "t1" in d.engine.store and d.status["t1"].state.name == "READY"
    finally:
        d.stop(0)


def test_a_tenant_called_before_its_weights_gets_them_once_committed(tmp_path):
    """A replica's first call of a tenant without weights (a readiness probe) holds it without;
    Serve caches that hold, so the replica now picks up weights the single writer commits
    later (before: NO_WEIGHTS on that replica until evicted). Without Ray: the replica's
    method on a FleetDaemon, Serve's cached loader stood in for."""
    import asyncio  # noqa: PLC0415

    f = Fleet(tmp_path)
    d = serve_ray.FleetDaemon(load_config(f.config))
    d.start()
    replica = serve_ray.ItifReplica.func_or_class.__new__(serve_ray.ItifReplica.func_or_class)
    replica.daemon = d
    loaded: list[str] = []

    async def cached_loader(tenant: str):  # Serve runs the loader once per tenant
        if tenant not in loaded:
            loaded.append(tenant)
            await asyncio.to_thread(d.hold, tenant)

    replica.tenant = cached_loader
    try:
        asyncio.run(replica.hold_tenant(LATE))
        assert d.status[LATE].state.name == "NO_WEIGHTS"
        writer = Daemon(load_config(f.config))
        writer.start()
        try:
            data = f.files[LATE].read_bytes()
            writer.upload(Identity(None, admin=True), LATE, sha256_file(f.files[LATE]),
                          len(data), [data])
        finally:
            writer.stop(0)
        asyncio.run(replica.hold_tenant(LATE))
        assert d.status[LATE].state.name == "READY" and loaded == [LATE]
        np.testing.assert_allclose(
            d.infer(Identity(None, admin=True), LATE, [itif.Request("", input_ids=[4, 5, 6])],
                    timeout=30)[0].logits, f.want(LATE, [4, 5, 6]), atol=2e-5)
    finally:
        d.stop(0)


def test_tenant_of_reads_the_routes():
    cases = [("POST", "/v2/models/acme/infer", b"", "acme"),
             ("GET", "/v2/models/acme/versions/1/ready", b"", "acme"),
             ("GET", "/v2/models/stats", b"", None),
             ("GET", "/v2/models/acme/stats", b"", "acme"),
             # a tenant named "stats": every route but the server-wide statistics is its own
             ("POST", "/v2/models/stats/infer", b"", "stats"),
             ("GET", "/v2/models/stats/ready", b"", "stats"),
             ("GET", "/v2/models/stats/stats", b"", "stats"),
             ("POST", "/v2/repository/models/acme/load", b"{}", "acme"),
             ("POST", "/v2/repository/index", b"{}", None),
             ("GET", "/v1/models/acme", b"", "acme"),
             ("GET", "/v1/models", b"", None),
             ("POST", "/v1/embeddings", b'{"model": "acme", "input": "x"}', "acme"),
             ("POST", "/v1/embeddings", b'{"model": 3}', None),
             ("POST", "/v1/embeddings", b"[1, 2]", None),
             ("POST", "/v1/embeddings", b"{bad", None),
             ("POST", "/v1/completions", b'{"model": "acme", "prompt": [5], "stream": true}',
              "acme"),
             ("POST", "/v1/completions", b'{"model": ["acme"]}', None),
             ("POST", "/v1/completions", b"{bad", None),
             ("GET", "/v1/completions", b'{"model": "acme"}', None),
             ("GET", "/v2/health/ready", b"", None)]
    for method, path, body, want in cases:
        assert serve_ray.tenant_of(method, path, body) == want, (method, path, body)


def test_the_router_reads_a_large_bodys_model_in_a_worker():
    """A body over OFFLOAD_BYTES has its model read by a JSON worker process, not on the
    router's event loop; a malformed one routes to no tenant, as a small one does."""
    from itif.server.json_procs import OFFLOAD_BYTES, JsonProcs  # noqa: PLC0415

    router = object.__new__(serve_ray.ItifRouter.func_or_class)
    router.procs = JsonProcs(1)
    ran = []
    run = router.procs.run

    async def counted(fn, *args):
        ran.append(fn.__name__)
        return await run(fn, *args)

    router.procs.run = counted
    pad = b" " * (OFFLOAD_BYTES + 1)

    async def main():
        return [await router._tenant("POST", "/v1/embeddings", b'{"model": "acme"}' + pad),
                await router._tenant("POST", "/v1/completions", b"{bad" + pad),
                await router._tenant("POST", "/v1/embeddings", b'{"model": "acme"}')]

    try:
        assert asyncio.run(main()) == ["acme", None, "acme"]
    finally:
        router.procs.close()
    assert ran == ["model_of", "model_of"]  # the small body was read in place


@pytest.mark.parametrize("marker", ["import httpx", "from openai import",
                                    "import tritonclient.http"])
def test_documented_client_snippets(fleet, marker, capsys):
    """docs/scale-out.md's first calls, as written, against the fleet (its address for the
    documented one, t0's token for acme's; acme's ids fit any BERT vocabulary of 128+)."""
    (block,) = [b for b in blocks(DOC) if b.lang == "python" and marker in b.text
                and "completions.create" not in b.text]  # that one: a decoder fleet's (below)
    code = block.text.replace(DOC_ADDR, f"127.0.0.1:{fleet.port}")
    code = code.replace("acme-secret-token", TOKENS["t0"])
    code = re.sub(r"\bacme\b", "t0", code)
    exec(compile(code, f"{block.path}:{block.line}", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip(), "the snippet printed nothing"
    assert "replica" in out or "embedding" in out or "logits" in out, out


# ---- completions: a decoder fleet, streamed through Serve ----------------------------------------
GEN_APP, GEN_PREFIX = "itif-gen", "/gen"
GEN_TENANTS = ["g0", "g1", "g2"]
GEN_TOKENS = {t: f"{t}-gen-token" for t in GEN_TENANTS}
LONG = {"prompt": [5, 6, 7], "max_tokens": 2000, "eos_token_id": VOCAB - 1}


class GenFleet:
    def __init__(self, root: Path, port: int) -> None:
        backbone = write_backbone(root / "backbone")
        self.config = root / "tenants.yaml"
        lines = ["server:", "  listen: 127.0.0.1:0", f"  data_dir: {root / 'data'}",
                 f"  admin_token_sha256: {hash_token(ADMIN)}", "  max_new_tokens: 2040",
                 "backbone:", f"  config: {backbone}", "  device: cpu", "  dtype: float32",
                 "  kv_cache_bytes: 8MiB", "tenants:"]
        for t in GEN_TENANTS:
            lines += [f"  - id: {t}", f"    token_sha256: {hash_token(GEN_TOKENS[t])}"]
        self.config.write_text("\n".join(lines) + "\n")
        self.url = f"http://127.0.0.1:{port}{GEN_PREFIX}"
        # the single writer, kept running as the oracle: a plain decoder daemon
        self.daemon = Daemon(load_config(self.config))
        self.daemon.start()
        for i, t in enumerate(GEN_TENANTS):
            data = weights_bytes(hf_model(30 + i), root)
            self.daemon.upload(Identity(None, admin=True), t, sha256_hex(data), len(data), [data])

    def want(self, tenant: str, ids: list[int], **kw) -> list[list[int]]:
        (g,) = self.daemon.generator.generate([GenerateRequest(tenant, ids, **kw)])
        return [list(s) for s in g.sequences]

    def held(self, tenant: str) -> dict:
        """Asked from the replica Serve routes ``tenant`` to (the one that holds it)."""
        handle = serve.get_deployment_handle("ItifReplica", app_name=GEN_APP)
        return handle.options(multiplexed_model_id=tenant).held.remote().result()

    def post(self, client: httpx.Client, tenant: str, body: dict) -> httpx.Response:
        return client.post("/v1/completions", json={"model": tenant, **body},
                           headers=H(GEN_TOKENS[tenant]))

    def events(self, client: httpx.Client, tenant: str, body: dict
               ) -> tuple[httpx.Headers, list[str]]:
        """A streamed completion read with httpx: its headers and its server-sent events."""
        with client.stream("POST", "/v1/completions", headers=H(GEN_TOKENS[tenant]),
                           json={"model": tenant, **body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), raw[-300:]
        return r.headers, [e[len("data: "):] for e in events[:-1]]


def sha256_hex(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def gen_fleet(fleet, tmp_path_factory):
    g = GenFleet(tmp_path_factory.mktemp("gen-fleet"), fleet.port)
    try:
        serve.run(serve_ray.build(g.config, num_replicas=2, torch_threads=1), name=GEN_APP,
                  route_prefix=GEN_PREFIX)
        yield g
    finally:
        serve.delete(GEN_APP)
        g.daemon.stop(0)


def _words(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)  # the word-level tokenizer: id 5 is "t5"


GEN_CASES = [  # (prompt, request fields, the GenerateRequest's)
    ([5, 17, 42], dict(max_tokens=7, eos_token_id=VOCAB - 1),
     dict(max_new_tokens=7, eos_token_id=VOCAB - 1)),
    ("t7 t8 t9", dict(max_tokens=9), dict(max_new_tokens=9)),
    ([4, 40], dict(max_tokens=6, n=2, num_beams=3), dict(max_new_tokens=6, num_beams=3,
                                                         num_return_sequences=2)),
    ([3, 9], dict(max_tokens=8, temperature=0.8, seed=7, top_k=20),
     dict(max_new_tokens=8, do_sample=True, temperature=0.8, seed=7, top_k=20)),
]


def test_completions_through_the_fleet_equal_the_single_daemon(gen_fleet):
    """Each tenant's completions, plain and streamed (server-sent events through Serve's
    streaming), are the single daemon's sequences; every answer names the tenant's one
    replica; a greedy stream arrives as one event per token, then the finish chunk and
    ``[DONE]``, and its texts add up to the plain answer."""
    g = gen_fleet
    with httpx.Client(base_url=g.url, timeout=120) as c:
        placed = {}
        for t in GEN_TENANTS:  # as _place: one call each, Serve places the tenant
            r = g.post(c, t, {"prompt": [5], "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers[serve_ray.TENANT_HEADER] == t
            placed[t] = r.headers[serve_ray.REPLICA_HEADER]
            time.sleep(1.0)
        assert len(set(placed.values())) == 2  # 3 tenants over both replicas
        for t in GEN_TENANTS:
            assert t in g.held(t)["tenants"] and g.held(t)["replica"] == placed[t]

        for i, t in enumerate(GEN_TENANTS):
            for prompt, fields, gen_kw in GEN_CASES[i:] + GEN_CASES[:i]:
                ids = [int(w[1:]) for w in prompt.split()] if isinstance(prompt, str) else prompt
                want = g.want(t, ids, **gen_kw)
                r = g.post(c, t, {"prompt": prompt, **fields})
                assert r.status_code == 200, r.text
                assert r.headers[serve_ray.REPLICA_HEADER] == placed[t]
                assert r.headers[serve_ray.TENANT_HEADER] == t
                plain = r.json()
                assert [ch["token_ids"] for ch in plain["choices"]] == want, (t, prompt)
                assert [ch["text"] for ch in plain["choices"]] == [_words(s) for s in want]

                headers, events = g.events(c, t, {"prompt": prompt, **fields})
                assert headers[serve_ray.REPLICA_HEADER] == placed[t]
                assert headers[serve_ray.TENANT_HEADER] == t
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                joined: dict[int, list] = defaultdict(lambda: ["", [], []])
                for chunk in chunks:
                    (choice,) = chunk["choices"]
                    o = joined[choice["index"]]
                    o[0] += choice["text"]
                    o[1] += choice["token_ids"]
                    o[2].append(choice["finish_reason"])
                assert [joined[j][1] for j in sorted(joined)] == want, (t, prompt)
                assert [joined[j][0] for j in sorted(joined)] == [
                    ch["text"] for ch in plain["choices"]]
                assert [joined[j][2][-1] for j in sorted(joined)] == [
                    ch["finish_reason"] for ch in plain["choices"]]
                if gen_kw.get("num_beams", 1) == 1 and len(want) == 1:  # token by token
                    assert len(chunks) == len(want[0]) + 1 >= 3, (t, prompt, len(chunks))

        # the openai client, unchanged, streams through the fleet too
        oc = openai.OpenAI(base_url=g.url + "/v1", api_key=GEN_TOKENS["g1"], max_retries=0)
        text = "".join(ch.choices[0].text for ch in oc.completions.create(
            model="g1", prompt=[5, 17, 42], max_tokens=7, stream=True,
            extra_body={"eos_token_id": VOCAB - 1}))
        assert text == _words(g.want("g1", [5, 17, 42], max_new_tokens=7,
                                     eos_token_id=VOCAB - 1)[0])
        # refusals keep OpenAI's error body through the fleet, streamed or not
        for stream in (False, True):
            r = g.post(c, "g0", {"prompt": [5], "max_tokens": 0, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
            r = c.post("/v1/completions", json={"model": "g0", "prompt": [5], "stream": stream},
                       headers=H(GEN_TOKENS["g1"]))
            assert r.status_code == 404 and r.headers[serve_ray.REPLICA_HEADER], r.text


def test_a_client_leaving_a_streamed_completion_cancels_it_on_its_replica(gen_fleet):
    """A long streamed generation runs on the tenant's replica while its first events arrive
    (streamed as produced, not at the end); the client closing the connection reaches the
    replica through Serve (the proxy cancels the router's call, which cancels the replica's
    generator): the generation is cancelled there and its cache blocks freed. A client that
    gives up on a non-streamed completion cancels it the same way."""
    g, t = gen_fleet, "g2"

    def state() -> dict:
        return g.held(t)["generation"]

    wait_until(lambda: state()["running"] == 0, timeout=60, what="an idle replica")
    cancelled = state()["cancelled"]
    with httpx.Client(base_url=g.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", headers=H(GEN_TOKENS[t]),
                      json={"model": t, **LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["text"]
            running = g.held(t)
            assert running["replica"] == r.headers[serve_ray.REPLICA_HEADER]
            assert running["generation"]["running"] == 1, running  # still generating
            assert running["generation"]["blocks_used"] > 0, running
        # leaving the block before the end closes the connection
    wait_until(lambda: state()["cancelled"] == cancelled + 1, timeout=30,
               what="the replica to cancel the disconnected stream's generation")
    wait_until(lambda: state()["running"] == 0 and state()["blocks_used"] == 0, timeout=10,
               what="its sequences and cache blocks freed")

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(g.url + "/v1/completions", json={"model": t, **LONG},
                   headers=H(GEN_TOKENS[t]), timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: state()["cancelled"] == cancelled + 2, timeout=30,
               what="the abandoned non-streamed generation cancelled")
    wait_until(lambda: state()["running"] == 0 and state()["blocks_used"] == 0, timeout=10,
               what="its blocks freed")
    with httpx.Client(base_url=g.url, timeout=120) as c:  # and the replica still serves
        r = g.post(c, t, {**LONG, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_documented_completions_snippet_streams_through_the_fleet(gen_fleet, capsys):
    """docs/scale-out.md's completions snippet, as written, against the decoder fleet."""
    (block,) = [b for b in blocks(DOC) if b.lang == "python" and "completions.create" in b.text]
    code = block.text.replace(DOC_ADDR, gen_fleet.url[len("http://"):])
    code = code.replace("acme-secret-token", GEN_TOKENS["g0"])
    code = re.sub(r"\bacme\b", "g0", code)
    exec(compile(code, f"{block.path}:{block.line}", "exec"), {})
    out = capsys.readouterr().out.strip().splitlines()
    assert out and out[-1].split()[0].startswith("t"), out  # the streamed words
