"""Assemble and run the daemon: gRPC server, health, reflection, config watcher, shutdown.

Start order keeps health truthful: the port opens first with health NOT_SERVING and the itif
service answering UNAVAILABLE; the backbone loads and stored tenants are restored in a worker
thread; then health turns SERVING. On SIGTERM/SIGINT health turns NOT_SERVING, new calls get
UNAVAILABLE, queued and in-flight calls finish within ``server.grace_s``, and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from itif.config import Config, ConfigWatcher, load_config
from itif.daemon import Daemon
from itif.metrics import Metrics, MetricsInterceptor
from itif.platform import tune_gc
from itif.server._proto.itif.v1 import itif_pb2_grpc
from itif.server import kserve
from itif.server.admission import Admission
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
    daemon = Daemon(cfg)
    metrics = daemon.metrics = Metrics(daemon)
    limit = cfg.server.max_message_bytes
    admission = Admission(daemon)  # calls in flight, unread reply bytes (itif.server.admission)
    server = grpc.aio.server(
        # metrics first: it sees the final status of every call, auth and admission refusals
        # included
        interceptors=[MetricsInterceptor(metrics), kserve.ProbeAuthInterceptor(daemon, admission)],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            # calls gRPC has received and the server not yet taken (one per turn of the event
            # loop): past gRPC's defaults (1,000, then 3,000) gRPC CANCELS new calls of every
            # caller, uncounted; keep them for admission to answer (RESOURCE_EXHAUSTED, counted)
            ("grpc.server.max_pending_requests", cfg.server.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", cfg.server.max_pending_calls),
            # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: one connection's calls beyond it are
            # refused by gRPC itself (REFUSED_STREAM: UNAVAILABLE, never started, retryable)
            # before they can queue in front of every other caller's
            ("grpc.max_concurrent_streams", cfg.server.max_streams_per_connection),
        ],
        maximum_concurrent_rpcs=None,  # the bound is admission's: per tenant, and counted
    )
    itif_pb2_grpc.add_ItifServicer_to_server(ItifService(daemon), server)
    health = HealthService(daemon)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    kserve.add_to_server(daemon, server, health)  # KServe v2 / Triton, same port and auth
    reflection.enable_server_reflection(
        (SERVICE, kserve.SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    creds = _credentials(cfg)
    listen = cfg.server.listen
    port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    if cfg.server.metrics_listen:
        metrics.serve(cfg.server.metrics_listen)
    http = await _start_http(daemon, cfg, health, admission)  # one admission for both
    log.info("listening on %s%s", listen, " (TLS)" if creds else "")

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await asyncio.to_thread(daemon.start)
    tune_gc()  # startup is done: what it made is frozen out of the collector's walks
    watcher = ConfigWatcher(config_path, on_change=daemon.apply_config,
                            on_error=daemon.config_failed, initial=cfg)
    watcher.start()
    if ready is not None:
        ready.set()
    print(f"itif: serving {len(cfg.tenants)} tenants on {listen}", flush=True)

    await stop.wait()
    grace = daemon.config.server.grace_s  # the live value: tenants.yaml may have changed it
    log.info("shutting down: draining for up to %.1fs", grace)
    health.shutting_down = True
    watcher.stop()
    t0 = time.monotonic()
    await asyncio.to_thread(daemon.stop, grace)  # refuse new work, finish queued and in-flight
    if http is not None:  # the HTTP APIs (server.http_listen): in flight answered, then closed
        await http.stop(max(0.0, grace - (time.monotonic() - t0)))
    await server.stop(max(0.0, grace - (time.monotonic() - t0)))  # one grace period in all
    metrics.close()
    log.info("stopped")
    return 0


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config_path))


__all__ = ["serve", "main"]
