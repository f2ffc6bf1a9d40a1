"""The one harness of the end-to-end and reliability tests: a real ``python -m itif serve``
subprocess on 127.0.0.1 (``Daemon``), its tenants.yaml, clients (plain or TLS), process
introspection (descriptors, RSS) and restarts (SIGTERM, SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from itif.client import Client
from itif.config import hash_token

ADMIN = "admin-secret"
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tenant_yaml(tenants: dict[str, str], extra: dict[str, dict] | None = None) -> str:
    """The ``tenants:`` entries of a config (newline-terminated) for {id: token}."""
    lines = []
    for tid, token in tenants.items():
        lines += [f"  - id: {tid}", f"    token_sha256: {hash_token(token)}"]
        lines += [f"    {k}: {v}" for k, v in (extra or {}).get(tid, {}).items()]
    return "\n".join(lines) + "\n"


@dataclass
class TLS:
    """PEM files/bytes for a TLS daemon and its clients."""

    ca: bytes
    client_key: bytes | None = None
    client_cert: bytes | None = None


@dataclass
class Daemon:
    """A real ``python -m itif serve`` on 127.0.0.1 (the one harness of every end-to-end and
    reliability test). ``faults`` arms the daemon's test hooks (``ITIF_FAULT_INJECT``,
    itif/faults.py); ``tenant_extra``, ``scheduler``, ``server_extra`` and ``backbone_extra``
    add keys to the generated tenants.yaml."""

    root: Path
    tenants: dict[str, str]  # id -> token
    tenant_extra: dict[str, dict] = field(default_factory=dict)
    scheduler: dict = field(default_factory=lambda: {"max_wait_ms": 1})
    server_extra: dict = field(default_factory=dict)
    faults: str = ""
    backbone: str = "bert-tiny"
    backbone_extra: dict = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    tls: TLS | None = None
    proc: subprocess.Popen | None = None

    # -- layout --
    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        """The Prometheus port (``server_extra={"metrics_listen": "127.0.0.1:<port>"}``)."""
        return int(self.server_extra["metrics_listen"].rsplit(":", 1)[1])

    @property
    def config(self) -> Path:
        return self.root / "tenants.yaml"

    @property
    def store(self) -> Path:
        return self.root / "data" / "store"

    @property
    def weights_dir(self) -> Path:
        return self.store / "weights"

    @property
    def tmp_dir(self) -> Path:
        return self.store / "tmp"

    def tmp_files(self) -> list[str]:
        try:
            return sorted(os.listdir(self.tmp_dir))
        except FileNotFoundError:
            return []

    def stored(self, tenant: str) -> tuple[bytes | None, str | None]:
        """(committed file bytes, digest in its sidecar) -- either may be None."""
        data = self.weights_dir / f"{tenant}.safetensors"
        side = self.weights_dir / f"{tenant}.sha256"
        return (data.read_bytes() if data.exists() else None,
                side.read_text().split()[0] if side.exists() else None)

    # -- config --
    def yaml(self, tenants: dict[str, str] | None = None, *,
             tenant_extra: dict[str, dict] | None = None, scheduler: dict | None = None,
             server_extra: dict | None = None) -> str:
        server = {"listen": self.addr, "data_dir": "./data",
                  "admin_token_sha256": hash_token(ADMIN),
                  # ITIF_TEST_INGRESS=N runs every harness daemon behind N ingress processes
                  # (``server.ingress_processes``) unless a test sets it
                  **({"ingress_processes": int(os.environ["ITIF_TEST_INGRESS"])}
                     if os.environ.get("ITIF_TEST_INGRESS") else {}),
                  **(self.server_extra if server_extra is None else server_extra)}
        out = ["server:"]
        for k, v in server.items():
            if isinstance(v, dict):
                out.append(f"  {k}:")
                out += [f"    {kk}: {vv}" for kk, vv in v.items()]
            else:
                out.append(f"  {k}: {v}")
        out += ["backbone:", f"  config: {self.backbone}", "  device: cpu"]
        out += [f"  {k}: {v}" for k, v in self.backbone_extra.items()]
        out.append("scheduler:")
        out += [f"  {k}: {v}" for k, v in (self.scheduler if scheduler is None
                                            else scheduler).items()]
        tenants = self.tenants if tenants is None else tenants
        extra = self.tenant_extra if tenant_extra is None else tenant_extra
        out.append("tenants:" + ("" if tenants else " []"))
        return "\n".join(out) + "\n" + (tenant_yaml(tenants, extra) if tenants else "")

    def write_config(self, text: str | None = None) -> None:
        """Replace the config the way editors do: write a temp file, then rename it over."""
        tmp = self.config.with_name(".tenants.yaml.tmp")
        tmp.write_text(self.yaml() if text is None else text)
        os.replace(tmp, self.config)

    # -- process --
    def start(self, timeout: float = 90.0, wait: bool = True) -> Daemon:
        """Launch the daemon (and by default wait until it is SERVING). If another process took
        the port between ``free_port()`` and the daemon's bind, move to a new port and retry."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.config.exists():
            self.write_config()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("ITIF_FAULT_INJECT", None)
        if self.faults:
            env["ITIF_FAULT_INJECT"] = self.faults
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        for attempt in range(3):
            log_start = len(self.logs())
            self._log = open(self.root / "daemon.log", "a")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "itif", "serve", "--config", str(self.config)],
                stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root, env=env)
            if not wait:
                return self
            try:
                self.wait_serving(timeout)
                return self
            except RuntimeError:
                taken = "cannot listen" in self.logs()[log_start:]
                generated = self.config.read_text() == self.yaml()
                self.proc = None
                self._log.close()
                if not (taken and generated) or attempt == 2:
                    raise
                self.port = free_port()
                self.config.write_text(self.yaml())  # in place: a symlinked config stays one
        return self

    def port_open(self) -> bool:
        """Whether the daemon accepts TCP connections (polled with plain sockets: a gRPC channel
        that failed to connect backs off for a second or more before it tries again)."""
        with socket.socket() as s:
            s.settimeout(1.0)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def wait_port(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while not self.port_open():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > end:
                raise TimeoutError(f"daemon port not open:\n{self.logs()[-4000:]}")
            time.sleep(0.02)

    def wait_serving(self, timeout: float = 90.0) -> None:
        self.wait_port(timeout)
        with self.client(ADMIN) as c:
            end = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.logs()}")
                try:
                    if c.health_status(timeout=1.0) == "SERVING":
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"daemon not ready:\n{self.logs()[-4000:]}")
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        self._log.close()
        return code

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        self._log.close()

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the daemon to end by itself (a fault hook killed it, say); its exit status
        (negative: the signal)."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self.proc = None
        self._log.close()
        return code

    def restart(self) -> Daemon:
        self.stop()
        return self.start()

    def logs(self) -> str:
        try:
            return (self.root / "daemon.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- process introspection (Linux /proc) --
    def fds(self) -> list[str]:
        """Targets of the daemon's open descriptors."""
        out = []
        base = f"/proc/{self.pid}/fd"
        for name in os.listdir(base):
            try:
                out.append(os.readlink(f"{base}/{name}"))
            except OSError:  # closed while we looked
                pass
        return out

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    # -- clients --
    def client(self, token: str, *, tls: TLS | None | bool = True, **kw) -> Client:
        t = self.tls if tls is True else (tls or None)
        if t is None:
            return Client(self.addr, token, **kw)
        return Client(self.addr, token, root_certificates=t.ca, private_key=t.client_key,
                      certificate_chain=t.client_cert, **kw)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.stop()


def http_daemon(root: Path, tokens: dict[str, str], seed: int, **kw) -> Daemon:
    """A started daemon (under ``root / "d"``) that also serves HTTP on a free port
    (``d.http``: its host:port), every tenant of ``tokens`` given one bert-tiny
    BertForSequenceClassification (3 labels, random weights of ``seed``). ``kw``: more
    :class:`Daemon` fields (``server_extra`` keys join ``http_listen``)."""
    from itif.safetensors_io import save_safetensors  # noqa: PLC0415
    from tests.oracle import make_hf_model  # noqa: PLC0415 - torch and transformers, on demand

    path = root / "w.safetensors"
    save_safetensors({k: v.detach().contiguous() for k, v in
                      make_hf_model("bert-tiny", 3, seed=seed).state_dict().items()}, path)
    server = {"http_listen": f"127.0.0.1:{free_port()}", **kw.pop("server_extra", {})}
    d = Daemon(root / "d", dict(tokens), server_extra=server, **kw).start()
    for tenant, token in tokens.items():
        with d.client(token) as c:
            c.upload(tenant, path)
    d.http = server["http_listen"]
    return d


#: ``pytest.fixture`` arguments of a module's daemon fixture that runs every test of the module
#: twice: the daemon serving its port itself, and behind two ingress processes
#: (``server.ingress_processes``); the fixture's ``request.param`` is the count for
#: :func:`serving`.
PORT_AND_INGRESS = dict(params=[0, 2], ids=["port", "ingress"])


def save_hf_tenants(root: Path, tenants: dict[str, tuple[int | None, int]]
                    ) -> tuple[dict[str, object], dict[str, Path]]:
    """For each tenant id -> (num_labels, seed): a random bert-tiny Hugging Face model, saved as
    ``root/<id>.safetensors``. Returns (models, files) by tenant id: the models are the oracle's,
    the files what a client uploads."""
    from itif.safetensors_io import save_safetensors  # noqa: PLC0415
    from tests.oracle import make_hf_model  # noqa: PLC0415 - torch and transformers, on demand

    models, files = {}, {}
    for tid, (labels, seed) in tenants.items():
        models[tid] = m = make_hf_model("bert-tiny", labels, seed=seed)
        files[tid] = root / f"{tid}.safetensors"
        save_safetensors({k: v.contiguous() for k, v in m.state_dict().items()}, files[tid])
    return models, files


@contextlib.contextmanager
def serving(root: Path, tokens: dict[str, str], files: dict[str, Path], *, ingress: int,
            upload: Iterable[str] | None = None) -> Iterator[Daemon]:
    """A started daemon of the ``tokens`` tenants, with ``ingress`` ingress processes (0: it
    serves its port itself), each tenant of ``upload`` (all by default) given its file through
    its own token; stopped on leaving."""
    d = Daemon(root, dict(tokens), server_extra={"ingress_processes": ingress}).start()
    with d:
        for tid in tokens if upload is None else upload:
            with d.client(tokens[tid]) as c:
                c.upload(tid, files[tid])
        yield d


#: The counters an ingress process reports in bulk (``itif.server.ingress_columns.REPORT_S``).
_REPORTED = ("itif_requests_total", "itif_request_seconds")


def settled_metrics(port: int, timeout: float = 10.0) -> dict[tuple[str, frozenset], float]:
    """The daemon's /metrics once the calls already answered are all counted: behind ingress
    processes a column call's count reaches the daemon up to ``REPORT_S`` after its answer, so
    this scrapes until two scrapes ``3 x REPORT_S`` apart agree on every call count."""
    from itif.bench.daemon_probe import scrape_metrics  # noqa: PLC0415
    from itif.server.ingress_columns import REPORT_S  # noqa: PLC0415

    def calls(s: dict) -> dict:
        return {k: v for k, v in s.items() if k[0].startswith(_REPORTED)}

    end = time.monotonic() + timeout
    last = scrape_metrics(port)
    while True:
        time.sleep(3 * REPORT_S)
        now = scrape_metrics(port)
        if calls(now) == calls(last) or time.monotonic() > end:
            return now
        last = now
