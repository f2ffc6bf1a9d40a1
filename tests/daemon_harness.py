"""Run a real ``itif serve`` subprocess on loopback for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from itif.client import Client
from itif.config import hash_token

ADMIN = "admin-secret"


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
class Daemon:
    root: Path
    tenants: dict[str, str]  # id -> token
    backbone: str = "bert-tiny"
    port: int = field(default_factory=free_port)
    extra: dict = field(default_factory=dict)
    server_extra: str = ""
    proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def config(self) -> Path:
        return self.root / "tenants.yaml"

    def yaml(self, tenants: dict[str, str] | None = None) -> str:
        return (
            "server:\n"
            f"  listen: {self.addr}\n"
            "  data_dir: ./data\n"
            f"  admin_token_sha256: {hash_token(ADMIN)}\n"
            f"{self.server_extra}"
            "backbone:\n"
            f"  config: {self.backbone}\n"
            "  device: cpu\n"
            "scheduler:\n"
            "  max_wait_ms: 1\n"
            "tenants:\n" + tenant_yaml(self.tenants if tenants is None else tenants, self.extra)
        )

    def write_config(self, text: str | None = None) -> None:
        """Replace the config the way editors do: write a temp file, then rename over."""
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(self.yaml() if text is None else text)
        os.replace(tmp, self.config)

    def start(self, timeout: float = 60.0) -> "Daemon":
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.config.exists():
            self.write_config()
        self.log = open(self.root / "daemon.log", "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "itif", "serve", "--config", str(self.config)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root, env=env)
        with self.client(ADMIN) as c:
            end = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.logs()}")
                try:
                    if c.health_status() == "SERVING":
                        return self
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"daemon not ready:\n{self.logs()}")
                time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        self.log.close()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.log.close()

    def logs(self) -> str:
        return (self.root / "daemon.log").read_text()

    def client(self, token: str) -> Client:
        return Client(self.addr, token)
