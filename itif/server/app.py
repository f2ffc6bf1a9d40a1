"""Assemble and run the daemon: gRPC server, health, reflection, config watcher, shutdown.

Start order keeps health truthful: the port opens first with health NOT_SERVING and the itif
service answering UNAVAILABLE; the backbone loads and stored tenants are restored in a worker
thread; then health turns SERVING. On SIGTERM/SIGINT health turns NOT_SERVING, new calls get
UNAVAILABLE, queued and in-flight calls finish within ``server.grace_s``, and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from itif.config import Config, ConfigWatcher, load_config
from itif.daemon import Daemon
from itif.errors import InvalidConfig
from itif.metrics import Metrics
from itif.platform import resolve_device, tune_gc, tune_host_malloc
from itif.server import kserve
from itif.server._proto.itif.v1 import itif_pb2_grpc
from itif.server.admission import Admission
from itif.server.call_metrics import MetricsInterceptor
from itif.server.column_door import ColumnDoor
from itif.server.ingress import STREAM_LIMIT_OPTIONS, grpc_connection_cap
from itif.server.ingress_host import FrameServer, IngressPool, Recorder
from itif.server.service import SERVICE, HealthService, ItifService

log = logging.getLogger("itif.server")


def _credentials(cfg: Config) -> grpc.ServerCredentials | None:
    tls = cfg.server.tls
    if tls is None:
        return None
    client_ca = tls.client_ca.read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


async def serve(config_path: str | Path, *, ready: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code."""
    config_path = Path(config_path)
    cfg = load_config(config_path)
    try:  # before gRPC's and the engine's threads: a thread started earlier keeps an arena of
        # its own, which malloc_trim cannot shrink (gzip gRPC messages over the limit, inflated
        # by gRPC's threads, left 64 MiB more resident after each: 251 -> 519 MiB over eight)
        tune_host_malloc(resolve_device(cfg.backbone.device))
    except (RuntimeError, ValueError):
        pass  # a device that cannot be had: the engine says so when it is built
    daemon = Daemon(cfg)
    metrics = daemon.metrics = Metrics(daemon)
    limit = cfg.server.max_message_bytes
    admission = Admission(daemon)  # calls in flight, unread reply bytes (itif.server.admission)
    # metrics first: it sees the final status of every call, auth and admission refusals
    # included
    interceptors = [MetricsInterceptor(metrics), kserve.ProbeAuthInterceptor(daemon, admission)]
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            # calls gRPC has received and the server not yet taken (one per turn of the event
            # loop): past gRPC's defaults (1,000, then 3,000) gRPC CANCELS new calls of every
            # caller, uncounted; keep them for admission to answer (RESOURCE_EXHAUSTED, counted)
            ("grpc.server.max_pending_requests", cfg.server.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", cfg.server.max_pending_calls),
            # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: one connection's calls beyond it wait in
            # their client (HTTP/2 flow control), so a burst on one connection cannot queue in
            # front of every other caller's
            ("grpc.max_concurrent_streams", cfg.server.max_streams_per_connection),
            *STREAM_LIMIT_OPTIONS,
            # connections held at once (gRPC closes the ones past it as they come): 21,000
            # idle TCP connections took every descriptor of a 20,000 open-file limit, and with
            # them the HTTP port and both health checks; 2,000 cost nothing measurable
            ("grpc.max_allowed_incoming_connections", grpc_connection_cap()),
        ],
        maximum_concurrent_rpcs=None,  # the bound is admission's: per tenant, and counted
    )
    reg = Recorder(server)  # keeps the handlers for calls that come by frame (ingress)
    itif_pb2_grpc.add_ItifServicer_to_server(ItifService(daemon), reg)
    health = HealthService(daemon)
    health_pb2_grpc.add_HealthServicer_to_server(health, reg)
    kserve.add_to_server(daemon, reg, health)  # KServe v2 / Triton, same port and auth
    reflection.enable_server_reflection(
        (SERVICE, kserve.SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    creds = _credentials(cfg)
    listen = cfg.server.listen
    ingress = None
    n_ingress = cfg.server.ingress_count()
    if n_ingress:
        # the port is the ingress processes'; this server listens on a private socket
        ingress = await _start_ingress(cfg, n_ingress, server, reg, interceptors, metrics)
    else:
        _listen(server, listen, creds)
    http = None
    try:  # a start that fails part way closes what it opened, then says why (one line)
        await server.start()
        if ingress is not None:
            await ingress.start()
        if cfg.server.metrics_listen:
            try:
                metrics.serve(cfg.server.metrics_listen)
            except OSError as e:
                raise OSError(f"cannot listen on {cfg.server.metrics_listen} "
                              f"(server.metrics_listen): {e.strerror or e}") from None
        http = await _start_http(daemon, cfg, health, admission)  # one admission for both
        log.info("listening on %s%s", listen, " (TLS)" if creds else "")
        await asyncio.to_thread(daemon.start)
        if ingress is not None:
            ingress.bind(daemon)
    except BaseException:
        await _close_started(server, ingress, http, metrics)
        raise

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tune_gc()  # startup is done: what it made is frozen out of the collector's walks
    def apply(new: Config):
        diff = daemon.apply_config(new)
        if ingress is not None:  # the ingress processes check calls against the new limits
            loop.call_soon_threadsafe(ingress.publish_now)
        return diff

    watcher = ConfigWatcher(config_path, on_change=apply, on_error=daemon.config_failed,
                            initial=cfg)
    watcher.start()
    if ready is not None:
        ready.set()
    print(f"itif: serving {len(cfg.tenants)} tenants on {listen}", flush=True)

    await stop.wait()
    grace = daemon.config.server.grace_s  # the live value: tenants.yaml may have changed it
    log.info("shutting down: draining for up to %.1fs", grace)
    # New calls are refused (UNAVAILABLE) from here, on the loop, before health says
    # NOT_SERVING: daemon.stop, which makes the scheduler refuse them too, runs on a thread, and a
    # client that saw NOT_SERVING must not get a call in ahead of it.
    daemon.ready = False
    health.shutting_down = True
    if ingress is not None:  # new calls by frame, where the servicer refuses them
        ingress.columns_off()
    watcher.stop()
    t0 = time.monotonic()
    await asyncio.to_thread(daemon.stop, grace)  # refuse new work, finish queued and in-flight
    if http is not None:  # the HTTP APIs (server.http_listen): in flight answered, then closed
        await http.stop(max(0.0, grace - (time.monotonic() - t0)))
    if ingress is not None:  # their calls in flight are answered by now: close the port
        await ingress.stop(max(0.0, grace - (time.monotonic() - t0)))
    await server.stop(max(0.0, grace - (time.monotonic() - t0)))  # one grace period in all
    metrics.close()
    log.info("stopped")
    return 0


class _Ingress:
    """The ingress processes and the daemon's ends of their sockets (``itif.server.ingress``)
    and rings (``itif.server.column_door``)."""

    #: how often the tenant snapshot is compared with the last one sent (sent when it changed)
    SNAPSHOT_S = 0.2

    def __init__(self, frames: FrameServer, pool: IngressPool, sockets: str,
                 door: ColumnDoor) -> None:
        self.frames, self.pool, self.sockets, self.door = frames, pool, sockets, door
        self._publisher: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        await self.pool.start()
        log.info("%d ingress processes serve the port (pids %s)", self.pool.count,
                 self.pool.pids())

    def bind(self, daemon: Daemon) -> None:
        """Once the daemon has started: Infer calls of token ids come by columns."""
        if self.door.bind(daemon):
            self._publisher = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        last = None
        while True:
            try:
                snap = self.door.snapshot()
                if snap != last:
                    self.frames.publish(snap)
                    last = snap
            except Exception:  # noqa: BLE001 - a missed snapshot only sends calls by frame
                log.exception("the column path's tenant snapshot failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.SNAPSHOT_S)
            self._changed.clear()

    def publish_now(self) -> None:
        """The configuration changed: the snapshot goes out now, not within SNAPSHOT_S."""
        self._changed.set()

    def columns_off(self) -> None:
        """Every new call by frame from here (shutdown): the daemon's servicer refuses it
        UNAVAILABLE at once, where the snapshot's next publication would come up to
        SNAPSHOT_S later. Calls already sent by columns are answered or refused by the door."""
        if self._publisher is not None:
            self._publisher.cancel()
            self._publisher = None
        self.frames.publish(None)

    async def stop(self, grace_s: float) -> None:
        self.columns_off()
        await self.pool.stop(grace_s)
        await self.frames.close()
        self.door.close()
        shutil.rmtree(self.sockets, ignore_errors=True)


async def _start_ingress(cfg: Config, n: int, server, reg: Recorder, interceptors,
                         metrics: Metrics) -> _Ingress:
    """The daemon's gRPC server on a private unix socket, the frame socket, and the pool of
    ``n`` ingress processes that will serve ``server.listen`` (started once the server is)."""
    host, _, port = cfg.server.listen.rpartition(":")
    if port in ("", "0"):
        raise InvalidConfig("server.ingress_processes: needs a fixed port in server.listen, "
                            f"got {cfg.server.listen!r}")
    _port_free(host, int(port))
    sockets = tempfile.mkdtemp(prefix="itif-ingress-")
    target = f"unix:{sockets}/grpc.sock"
    if server.add_insecure_port(target) == 0:
        raise OSError(f"cannot listen on {target}")
    frames = FrameServer(interceptors, reg.generic)
    frames.on_report = metrics.observe_rpcs  # the column calls the ingress processes answered
    await frames.start(f"{sockets}/frames.sock")
    tls = cfg.server.tls
    spec = dict(listen=cfg.server.listen, frames=f"{sockets}/frames.sock", grpc=target,
                max_message_bytes=cfg.server.max_message_bytes,
                max_pending_calls=cfg.server.max_pending_calls,
                max_streams_per_connection=cfg.server.max_streams_per_connection,
                grace_s=cfg.server.grace_s,
                tls=None if tls is None else dict(
                    cert=str(tls.cert), key=str(tls.key),
                    client_ca=str(tls.client_ca) if tls.client_ca else None))
    door = ColumnDoor(n)
    log.info("ingress processes for %s: %d (server.ingress_processes%s)", cfg.server.listen, n,
             ": auto, from the cores" if cfg.server.ingress_processes == "auto" else "")
    return _Ingress(frames, IngressPool(n, spec, door), sockets, door)


def _port_free(host: str, port: int) -> None:
    """OSError when ``host:port`` is taken: the ingress processes bind it with SO_REUSEPORT,
    which would not fail where another daemon's ingress already listens there."""
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = "::1" if host == "::" else ("127.0.0.1" if host == "0.0.0.0" else host)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        if s.connect_ex((probe, port)) == 0:
            raise OSError(f"cannot listen on {host}:{port} (server.listen): something already "
                          "accepts calls there")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e}") from e


def _listen(server: grpc.aio.Server, listen: str, creds) -> None:
    """Bind ``server.listen`` (grpcio raises where older versions returned port 0)."""
    try:
        port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        why = "the address is in use or not available here"
        if creds:
            why += ", or server.tls's certificate and key are not a valid pair"
        raise OSError(f"cannot listen on {listen} (server.listen): {why}")


async def _close_started(server, ingress, http, metrics) -> None:
    """After a failed start: stop what started, so nothing is left to complain at exit."""
    steps = [("http", http.stop(0) if http is not None else None),
             ("ingress", ingress.stop(0) if ingress is not None else None),
             ("grpc", server.stop(0))]
    for name, step in steps:
        if step is None:
            continue
        try:
            await step
        except Exception:  # noqa: BLE001 - the start's own error is the one to report
            log.debug("closing %s after a failed start", name, exc_info=True)
    metrics.close()


async def _start_http(daemon: Daemon, cfg: Config, health: HealthService,
                      admission: Admission):
    """The HTTP APIs on ``server.http_listen`` (``itif.server.http``), or None when unset; their
    calls count against the same limits as gRPC's (``admission``)."""
    if not cfg.server.http_listen:
        return None
    from itif.server.http import HttpServer  # noqa: PLC0415 - the optional http extra

    http = HttpServer(daemon, cfg, health, admission)
    await http.start()
    return http


def main(config_path: str | Path) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config_path))


__all__ = ["serve", "main"]
