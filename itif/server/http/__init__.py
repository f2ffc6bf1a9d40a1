"""The HTTP APIs on ``server.http_listen``: KServe v2 REST (``kserve_rest``), OpenAI-compatible
embeddings (``openai``) and completions of decoder tenants (``completions``), one Starlette app
served by uvicorn on the daemon's own event loop.

``itif.server.app`` starts it beside the gRPC server (the port opens before the backbone loads;
until then the routes answer 503, as gRPC answers UNAVAILABLE) and stops it after the daemon has
drained. Its calls are counted by the gRPC server's admission (``itif.server.http.common``: over
a limit, 429). The daemon's loop keeps SIGTERM/SIGINT: uvicorn installs no signal handler here. With
``server.tls`` the port speaks HTTPS with the same certificate (and, with ``client_ca``, asks
clients for theirs).

Needs the ``http`` extra (starlette, uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse
except ImportError as e:  # the daemon says what to install rather than a bare traceback
    raise ImportError(f"server.http_listen needs the http extra (pip install 'itif[http]'): "
                      f"{e}") from e

from itif.config import Config
from itif.server.admission import Admission
from itif.server.http.completions import CompletionsApi
from itif.server.http.kserve_rest import KServeRest
from itif.server.http.openai import OpenAIApi

log = logging.getLogger("itif.server.http")


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) answer with KServe's JSON error body."""
    return JSONResponse({"error": f"{request.method} {request.url.path[:200]}: {exc.detail}"},
                        status_code=exc.status_code, headers=exc.headers)


def build_app(daemon, health=None, *, max_body: int, admission=None) -> Starlette:
    """The Starlette app of the APIs on ``daemon``. ``admission``: the
    :class:`~itif.server.admission.Admission` that counts the calls (the gRPC server's, so both
    protocols share the limits); None: a new one of this app's own."""
    if admission is None:
        admission = Admission(daemon)
    routes = (KServeRest(daemon, health, max_body=max_body, admission=admission).routes()
              + OpenAIApi(daemon, max_body=max_body, admission=admission).routes()
              + CompletionsApi(daemon, max_body=max_body, admission=admission).routes())
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the daemon's loop owns SIGTERM and SIGINT
        yield


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, int(port)), family=family)
    except OSError as e:
        raise OSError(f"cannot listen on {listen} (server.http_listen): {e}") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """uvicorn serving :func:`build_app` on a socket bound at construction."""

    def __init__(self, daemon, cfg: Config, health=None, admission=None) -> None:
        s = cfg.server
        self.listen = s.http_listen
        self.sock = _bind(self.listen)
        tls = {}
        if s.tls is not None:
            tls = dict(ssl_certfile=str(s.tls.cert), ssl_keyfile=str(s.tls.key))
            if s.tls.client_ca is not None:
                tls.update(ssl_ca_certs=str(s.tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        app = build_app(daemon, health, max_body=s.max_message_bytes, admission=admission)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                http="h11", ws="none", server_header=False,
                                timeout_graceful_shutdown=s.grace_s, **tls)
        self.tls = bool(tls)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self.listen} stopped at start")
            await asyncio.sleep(0.01)
        log.info("HTTP on %s%s", self.listen, " (TLS)" if self.tls else "")

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let requests in flight finish for up to ``grace_s``, close."""
        if self.task is None:
            return
        self.server.config.timeout_graceful_shutdown = max(0.0, grace_s)
        self.server.should_exit = True
        try:
            await self.task
        finally:
            self.sock.close()


__all__ = ["HttpServer", "build_app"]
