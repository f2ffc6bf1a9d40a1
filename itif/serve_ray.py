"""A fleet of itif daemons as one Ray Serve application (``pip install 'itif[ray]'``).

Two deployments (:func:`build`, or ``serve run itif.serve_ray:app config=tenants.yaml``):

``ItifRouter`` (the HTTP ingress, ``route_prefix="/"``)
    receives every HTTP request Serve's proxy accepts, reads its body (bounded by
    ``server.max_message_bytes``), finds the tenant it is for (the ``{model}`` of
    ``/v2/models/{model}/...``, ``/v2/repository/models/{model}/...`` and ``/v1/models/{model}``,
    the ``model`` field of a ``/v1/embeddings`` or ``/v1/completions`` body, read by a JSON
    worker process past 256 KiB, ``itif.server.json_procs``) and hands it to
    ``ItifReplica`` with that tenant as Serve's **multiplexed model id**, so Serve's router sends it
    to a replica that holds
    the tenant (the first call of a tenant goes to a replica holding the fewest). A name that is
    no configured tenant, and a route of no tenant (health, ``/v2``, indexes), go to any replica
    without a model id: an unknown name cannot make a replica load anything. A call whose
    replica died under it is sent again (inference is idempotent), up to :data:`RETRIES` times.
    ``POST /v1/completions`` goes through Serve's streaming instead (:meth:`ItifReplica.stream`,
    ``handle.options(stream=True)``, a Starlette ``StreamingResponse``): each body chunk the
    replica's app sends (a server-sent event of a streamed completion) reaches the client as it
    is produced; a client that disconnects cancels the router's call, which cancels the
    replica's generator and with it the generation (its sequences and KV cache blocks freed).

``ItifReplica`` (``num_replicas`` of them, one GPU each where there are GPUs)
    one itif daemon each: its own engine, scheduler and fused batches, serving the very
    Starlette app of ``itif.server.http`` (KServe v2 REST, OpenAI embeddings and, on a decoder
    backbone such as ``gpt2-tiny``, completions, with their auth, validation, admission and
    error bodies), called in-process on each forwarded request.
    Tenants are held through ``@serve.multiplexed`` (:meth:`ItifReplica.tenant`): the loader reads
    the tenant's committed weights from the shared blob store (``server.data_dir`` of the one
    tenants.yaml every deployment loads, on a file system all replicas see) into this replica's
    engine; Serve evicts the least recently used past :data:`MAX_TENANTS_PER_REPLICA`, and the
    evicted tenant's weights leave the engine once its accepted requests have finished. Inside a
    replica every tenant's requests go through itif's own scheduler, so requests of different
    tenants share fused batches (``@serve.batch`` is not used: it would split batches by model
    id). Each answer carries the headers ``itif-replica`` (Serve's replica id, from
    ``serve.get_replica_context()``) and ``itif-tenant`` (the multiplexed model id Serve routed it
    with).

tenants.yaml holds fleet-wide: every replica and the router load the same file (tokens, quotas,
scheduler settings; edits apply live, as in the daemon). Weights are written to the shared store
by one writer: a single ``itif serve`` daemon on the same ``data_dir``, or an upload through the
fleet (``/v2/repository/models/{m}/load``, which lands on the tenant's replica); a replica that
already holds a tenant keeps the weights it loaded until Serve evicts it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from itif.config import Config, ConfigWatcher, load_config
from itif.daemon import Daemon, State, TenantStatus
from itif.errors import ItifError
from itif.platform import tune_gc
from itif.server.errors import http_retry_headers, http_status_of
from itif.server.http import build_app
from itif.server.http.common import read_body, release_body
from itif.server.json_procs import OFFLOAD_BYTES, JsonProcs, model_of

log = logging.getLogger("itif.serve_ray")

__all__ = ["FleetDaemon", "ItifReplica", "ItifRouter", "MAX_TENANTS_PER_REPLICA", "RETRIES",
           "app", "build", "call_asgi", "stream_asgi", "tenant_of"]

#: Tenants one replica holds at most (Serve's ``max_num_models_per_replica``); the least recently
#: used is evicted past it. ``ITIF_SERVE_MAX_TENANTS`` in the replicas' environment changes it.
MAX_TENANTS_PER_REPLICA = int(os.environ.get("ITIF_SERVE_MAX_TENANTS", "64"))
#: How many times the router sends a call again whose replica died under it.
RETRIES = 5
#: Concurrent calls per replica and per router (Serve's ``max_ongoing_requests``; its default, 5,
#: would keep a replica's scheduler from ever seeing a batch).
MAX_ONGOING = 256
#: Response headers naming who answered.
REPLICA_HEADER, TENANT_HEADER = "itif-replica", "itif-tenant"

#: Routes whose answer may be a stream (server-sent events): sent through Serve's streaming.
STREAMED = frozenset({("POST", "/v1/completions")})
#: Routes whose body's ``model`` names the tenant.
_MODEL_IN_BODY = frozenset({"/v1/embeddings", "/v1/completions"})
_TENANT_PATH = re.compile(r"^/(?:v2/models|v2/repository/models|v1/models)/([^/]+)")
_DIED = (ActorDiedError, ActorUnavailableError, RayActorError)


# ---- the replica's daemon ----------------------------------------------------------------------
class FleetDaemon(Daemon):
    """An itif daemon that restores no tenant at start: tenants arrive and leave as Serve
    multiplexes them onto this replica (:meth:`hold`, :meth:`release`). On a decoder backbone
    its engine is a GenEngine, as a plain daemon's (``Daemon.start``)."""

    #: Generations cancelled before their end (their client went away): tests, operators.
    cancelled_generations = 0

    def cancel_generate(self, ticket) -> None:
        if not getattr(ticket, "done", True):
            self.cancelled_generations += 1
        super().cancel_generate(ticket)

    def restore(self) -> None:
        """Nothing: see :meth:`hold`."""

    def hold(self, tenant: str) -> None:
        """Load ``tenant``'s committed weights from the shared store, unless held already (a
        tenant without stored weights stays NO_WEIGHTS: an upload through this replica may give
        it some)."""
        if tenant not in self.status:
            return
        with self.tenants.lock(tenant):
            if tenant not in self.status or tenant in self.engine.store:
                return
            if self.blobs.exists(tenant):
                self.load_stored(tenant)

    def release(self, tenant: str, timeout_s: float = 60.0) -> None:
        """Serve evicted ``tenant`` from this replica: refuse its new calls, let its accepted
        ones (inferences and generations) finish (up to ``timeout_s``), then drop its weights
        from the engine."""
        st = self.status.get(tenant)
        if st is not None:
            st.state, st.error = State.NO_WEIGHTS, "moved off this replica"
        deadline = time.monotonic() + timeout_s
        while self.outstanding(tenant) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.tenants.lock(tenant):
            if tenant in self.engine.store:
                self.engine.remove_tenant(tenant)
            if tenant in self.status and self.status[tenant].state is State.NO_WEIGHTS:
                self.status[tenant] = TenantStatus()


class _Held:
    """What the multiplexed loader returns for a tenant: Serve calls :meth:`__del__` when it
    evicts the tenant from this replica. Only that first call releases: Python calls the
    class's ``__del__`` again when the object is collected, by which time the tenant may be
    held anew (Serve's reset of the instance attribute does not stop that)."""

    def __init__(self, daemon: FleetDaemon, tenant: str) -> None:
        self.daemon, self.tenant = daemon, tenant
        self.released = False

    def __del__(self) -> None:
        daemon = self.__dict__.get("daemon")
        if self.__dict__.get("released", True) or daemon is None or daemon.engine is None:
            return
        self.released = True
        daemon.release(self.tenant)


# ---- ASGI in-process ---------------------------------------------------------------------------
def _scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
           client: tuple[str, int] | None) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": headers, "client": client, "server": ("itif-replica", 80)}


async def call_asgi(app: Any, method: str, path: str, query: bytes,
                    headers: list[tuple[bytes, bytes]], body: bytes,
                    client: tuple[str, int] | None = None) -> tuple[int, list, bytes]:
    """Run one HTTP request through the ASGI ``app`` in this process: (status, headers, body),
    the body being :func:`stream_asgi`'s chunks joined (500 if the app never answered)."""
    status, out_headers, chunks = 500, [], []
    async for item in stream_asgi(app, method, path, query, headers, body, client):
        if isinstance(item, tuple):
            status, out_headers = item
        else:
            chunks.append(item)
    return status, out_headers, b"".join(chunks)


async def stream_asgi(app: Any, method: str, path: str, query: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes,
                      client: tuple[str, int] | None = None):
    """Run one HTTP request through the ASGI ``app`` in this process, as it answers: yields
    ``(status, headers)`` once, then each non-empty body chunk the app sends. Leaving the
    generator early (closed, or its task cancelled: the caller went away) tells the app that
    the client disconnected and cancels it (a streamed completion then cancels its
    generation)."""
    scope = _scope(method, path, query, headers, client)
    gone = asyncio.Event()
    messages: asyncio.Queue = asyncio.Queue()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(None)

    task = asyncio.ensure_future(run())
    started = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield message["status"], list(message.get("headers", ()))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await asyncio.wait({task}, timeout=30)
        if task.done() and not task.cancelled() and task.exception() is not None:
            if not started:
                raise task.exception()
            log.error("%s %s failed after its answer: %r", method, path, task.exception())
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task}, timeout=5)


def tenant_of(method: str, path: str, body: bytes) -> str | None:
    """The tenant a request is for, by the routes of ``itif.server.http`` (None: no tenant)."""
    m = _TENANT_PATH.match(path)
    if m is not None:
        name = m.group(1)
        return None if path.rstrip("/") == "/v2/models/stats" else name  # the server's stats
    if method == "POST" and path in _MODEL_IN_BODY:
        return model_of(body)
    return None


def _release(deployment: object) -> None:
    """What a deployment's ``__del__`` stops: its tenants.yaml watcher and its JSON workers
    (whichever its ``__init__`` got to start)."""
    watcher = deployment.__dict__.get("watcher")
    if watcher is not None:
        watcher.stop()
    procs = deployment.__dict__.get("procs")
    if procs is not None:
        procs.close()


def _watch(path: str, on_change) -> ConfigWatcher:
    def failed(exc: Exception) -> None:
        log.error("tenants.yaml reload refused, keeping the last good config: %s", exc)

    watcher = ConfigWatcher(path, on_change=on_change, on_error=failed)
    watcher.start()
    return watcher


# ---- the deployments ---------------------------------------------------------------------------
@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class ItifReplica:
    """One itif daemon (engine, scheduler) serving the HTTP app of ``itif.server.http``."""

    def __init__(self, config: str, torch_threads: int | None = None) -> None:
        if torch_threads:
            import torch  # noqa: PLC0415

            torch.set_num_threads(torch_threads)
        cfg = load_config(config)
        self.daemon = FleetDaemon(cfg)
        self.daemon.start()
        tune_gc()  # a serving process: itif.platform.tune_gc
        # large JSON bodies and answers in worker processes (itif.server.json_procs), as itif serve
        self.procs = JsonProcs(cfg.server.http_json_processes)
        self.app = build_app(self.daemon, max_body=cfg.server.max_message_bytes,
                             procs=self.procs)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id if ctx is not None else "local"
        self.watcher = _watch(config, self.daemon.apply_config)

    @serve.multiplexed(max_num_models_per_replica=MAX_TENANTS_PER_REPLICA)
    async def tenant(self, tenant: str) -> _Held:
        """Serve's loader: hold ``tenant`` on this replica (weights from the shared store)."""
        await asyncio.to_thread(self.daemon.hold, tenant)
        return _Held(self.daemon, tenant)

    async def hold_tenant(self, tenant: str) -> None:
        """Serve's multiplexed hold of ``tenant``, then weights committed since, if it had none:
        Serve caches the hold, so a tenant whose first call came before its weights (a readiness
        probe) would otherwise stay without them on this replica until evicted."""
        await self.tenant(tenant)
        st = self.daemon.status.get(tenant)
        if st is not None and st.state is State.NO_WEIGHTS:
            await asyncio.to_thread(self.daemon.hold, tenant)

    async def handle(self, method: str, path: str, query: bytes,
                     headers: list[tuple[bytes, bytes]], body: bytes,
                     client: tuple[str, int] | None = None) -> tuple[int, list, bytes]:
        """One forwarded HTTP request, answered by the HTTP app on this replica's daemon."""
        tenant = serve.get_multiplexed_model_id()
        if tenant:
            await self.hold_tenant(tenant)
        status, out, data = await call_asgi(self.app, method, path, query, headers, body, client)
        return status, out + self._who(tenant), data

    async def stream(self, method: str, path: str, query: bytes,
                     headers: list[tuple[bytes, bytes]], body: bytes,
                     client: tuple[str, int] | None = None):
        """One forwarded HTTP request, answered as the app sends it (Serve's streaming: called
        with ``handle.options(stream=True)``): ``(status, headers)``, then the body's chunks.
        Serve cancels this generator when the router's call is cancelled (its client went
        away); :func:`stream_asgi` then cancels the app, and the app the generation."""
        tenant = serve.get_multiplexed_model_id()
        if tenant:
            await self.hold_tenant(tenant)
        parts = stream_asgi(self.app, method, path, query, headers, body, client)
        try:
            async for part in parts:
                if isinstance(part, tuple):
                    part = (part[0], part[1] + self._who(tenant))
                yield part
        finally:
            await parts.aclose()

    def _who(self, tenant: str) -> list[tuple[bytes, bytes]]:
        return [(REPLICA_HEADER.encode(), self.replica_id.encode()),
                (TENANT_HEADER.encode(), tenant.encode())]

    async def held(self) -> dict:
        """This replica's id, the tenants whose weights it holds and, on a decoder backbone,
        its GenEngine's cache and the generations cancelled by their client (tests,
        operators)."""
        gen = self.daemon.generator
        return {"replica": self.replica_id,
                "tenants": sorted(t for t, s in self.daemon.status.items()
                                  if s.state is State.READY),
                "generation": None if gen is None else {
                    **gen.cache_stats(), "cancelled": self.daemon.cancelled_generations}}

    def __del__(self) -> None:
        _release(self)
        daemon = self.__dict__.get("daemon")
        if daemon is not None:
            daemon.stop(0)


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class ItifRouter:
    """The HTTP ingress: forwards each request to a replica chosen by its tenant."""

    def __init__(self, replicas: DeploymentHandle, config: str) -> None:
        self.replicas = replicas
        self.config: Config = load_config(config)
        self.watcher = _watch(config, self._reload)
        # a large OpenAI body's model is read in a worker process: json holds the GIL, and
        # this router's event loop routes every call of every tenant
        self.procs = JsonProcs(self.config.server.http_json_processes)

    def _reload(self, cfg: Config) -> None:
        self.config = cfg

    def __del__(self) -> None:
        _release(self)

    async def __call__(self, request: Request) -> Response:
        """Forward the request; a gzip or deflate body is inflated here (bounded as in the
        daemon, ``itif.server.http.common.read_body``: over max_message_bytes 413 before it is
        inflated whole, past the inflated bytes held at once 429) and held until the replica
        has answered (a streamed answer: until it has started)."""
        try:
            return await self._forward(request)
        finally:
            release_body(request)

    async def _forward(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.config.server.max_message_bytes)
        except ItifError as e:
            status, _, msg = http_status_of(e)
            return JSONResponse({"error": msg}, status_code=getattr(e, "http_status", status),
                                headers=http_retry_headers(e, self.config.server.retry_after_ms))
        method, path = request.method, request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # an application on a route prefix other than "/"
            path = path[len(root):] or "/"
        tenant = await self._tenant(method, path, body)
        handle = self.replicas
        if tenant is not None and self.config.tenant(tenant) is not None:
            handle = handle.options(multiplexed_model_id=tenant)
        headers = [(k, v) for k, v in request.scope["headers"]
                   if k not in (b"content-encoding", b"content-length")]
        client = tuple(request.client) if request.client is not None else None
        call = (method, path, request.scope.get("query_string", b""), headers, body, client)
        if (method, path) in STREAMED:
            return await self._streamed(handle, call)
        for attempt in range(RETRIES + 1):
            try:
                status, out, data = await handle.handle.remote(*call)
                break
            except _DIED as e:  # the replica died under the call: Serve routes it elsewhere
                if attempt == RETRIES:
                    return _no_replica(e)
                await asyncio.sleep(0.25 * (attempt + 1))  # 3.75 s in all
        response = Response(data, status_code=status)
        response.raw_headers = [(k, v) for k, v in out if k != b"content-length"]
        response.raw_headers.append((b"content-length", str(len(data)).encode()))
        return response

    async def _tenant(self, method: str, path: str, body: bytes) -> str | None:
        """:func:`tenant_of`, a body over ``OFFLOAD_BYTES`` read by a worker (one that dies
        leaves the call without a tenant: any replica answers it)."""
        if method == "POST" and path in _MODEL_IN_BODY and len(body) > OFFLOAD_BYTES:
            try:
                return await self.procs.run(model_of, body)
            except ItifError:
                return None
        return tenant_of(method, path, body)

    async def _streamed(self, handle: DeploymentHandle, call: tuple) -> Response:
        """A call through Serve's streaming (:meth:`ItifReplica.stream`): sent again while its
        replica dies before answering; once the answer has started, a replica lost mid-stream
        ends the stream early (a completion without ``data: [DONE]``: generation is not
        resumable). The stream's end, whatever ended it (the client disconnecting cancels
        this call), cancels the replica's generator."""
        handle = handle.options(stream=True)
        for attempt in range(RETRIES + 1):
            parts = handle.stream.remote(*call)
            try:
                status, out = await parts.__anext__()
                break
            except _DIED as e:
                parts.cancel()
                if attempt == RETRIES:
                    return _no_replica(e)
                await asyncio.sleep(0.25 * (attempt + 1))
            except BaseException:  # cancelled (the client went away): Serve would cancel too
                parts.cancel()
                raise

        what = f"{call[0]} {call[1]}"  # not the call itself: the stream holds no body

        async def chunks():
            finished = False
            try:
                async for chunk in parts:
                    yield chunk
                finished = True
            except _DIED as e:
                log.warning("%s: its replica died mid-stream (%s)", what, type(e).__name__)
            finally:
                if not finished:
                    parts.cancel()

        response = StreamingResponse(chunks(), status_code=status)
        response.raw_headers = list(out)  # a content-length the app set stays true
        return response


def _no_replica(e: BaseException) -> Response:
    return JSONResponse({"error": f"no replica answered: {type(e).__name__}"}, status_code=503)


def build(config: str | os.PathLike, *, num_replicas: int = 2,
          torch_threads: int | None = None, replica_options: dict | None = None) -> Any:
    """The Serve application (for ``serve.run``): ``num_replicas`` replicas and the router, all
    loading ``config`` (one tenants.yaml, on a path every node sees)."""
    config = str(Path(config).resolve())
    replica = ItifReplica.options(num_replicas=num_replicas, **(replica_options or {}))
    return ItifRouter.bind(replica.bind(config, torch_threads), config)


def app(args: dict) -> Any:
    """The application builder of ``serve run itif.serve_ray:app config=tenants.yaml
    [num_replicas=2] [num_gpus_per_replica=0] [torch_threads=N]`` and of a Serve config's
    ``import_path`` (``args``: its ``args``)."""
    if "config" not in args:
        raise ValueError("itif.serve_ray:app needs the argument config=<path of tenants.yaml>")
    threads = args.get("torch_threads")
    gpus = float(args.get("num_gpus_per_replica", 0))
    options = {"ray_actor_options": {"num_cpus": 0, "num_gpus": gpus}} if gpus else None
    return build(args["config"], num_replicas=int(args.get("num_replicas", 2)),
                 torch_threads=int(threads) if threads else None, replica_options=options)
