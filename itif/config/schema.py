"""The typed config: frozen dataclasses, one per ``tenants.yaml`` section.

Each field is a :func:`~itif.config.fields.setting`: its default, its converter and its limits
are written here, once. The parser (``itif.config.parse``) reads them from the fields, and so do
the scheduler's live objects (``TenantQuota``, ``Scheduler.configure``) through
:func:`~itif.config.fields.check`, so a value the file refuses is refused everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from itif.config import fields as F
from itif.config.fields import (
    DEVICES,
    DTYPES,
    GRPC_MAX_MESSAGE,
    MAX_NEW_TOKENS_LIMIT,
    MAX_SEQ_LEN_LIMIT,
    Device,
    DType,
    GiB,
    KiB,
    MiB,
    TiB,
    backbone_presets,
    setting,
)

__all__ = [
    "BackboneConfig",
    "Config",
    "SchedulerConfig",
    "ServerConfig",
    "TLSConfig",
    "Tenant",
    "hash_token",
]


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS. ``client_ca`` set means mutual TLS: clients must present a cert it signed."""

    cert: Path = setting(F.fs_path, base_dir=True)
    key: Path = setting(F.fs_path, base_dir=True)
    client_ca: Path | None = setting(F.fs_path, None, base_dir=True)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


@dataclass(frozen=True)
class ServerConfig:
    listen: str = setting(F.hostport)
    data_dir: Path = setting(F.fs_path, base_dir=True)
    admin_token_sha256: str = setting(F.sha256)
    metrics_listen: str | None = setting(F.hostport, None)
    #: ``host:port`` of the HTTP APIs (KServe v2 REST, OpenAI embeddings; ``itif.server.http``,
    #: the ``http`` extra); None: no HTTP. Request bodies are bounded by ``max_message_bytes``.
    http_listen: str | None = setting(F.hostport, None)
    #: HTTP connections open at once (idle, sending, or being answered), all clients together.
    #: At the cap a new one closes the oldest idle one (no request in progress); only when all
    #: are busy with a request is it answered 503 and closed (``itif.server.http``). Lowered at
    #: start to half the process's open-file limit (``ulimit -n``) where that is smaller.
    http_max_connections: int = setting(F.integer, 1000, lo=1, hi=1_000_000)
    #: HTTP connections one peer address may hold at once: at it, a new one from that address
    #: closes the address's own oldest idle one (or, all busy, is answered 503), never another
    #: client's. Clients behind one proxy or NAT share an address: raise it there.
    http_max_connections_per_client: int = setting(F.integer, 256, lo=1, hi=1_000_000)
    #: An HTTP connection that has not sent a whole request line and headers this long after it
    #: opened (or, kept alive, after the first byte of its next request) is closed. An idle
    #: kept-alive connection is closed after uvicorn's keep-alive timeout (5 s).
    http_header_timeout_s: float = setting(F.number, 10.0, lo=0.0, hi=3600.0, lo_open=True)
    #: Processes that parse HTTP JSON bodies, and write JSON answers, over 256 KiB
    #: (``itif.server.json_procs``): Python's json holds the GIL, so in the daemon a 3 MB body
    #: (one image as JSON numbers) stalls every other call for its whole parse. Started when the
    #: HTTP port opens. 0: a thread of the daemon parses them.
    http_json_processes: int = setting(F.integer, 2, lo=0, hi=64)
    max_message_bytes: int = setting(F.size, 64 * MiB, lo=KiB, hi=GRPC_MAX_MESSAGE)
    max_upload_bytes: int = setting(F.size, 4 * GiB, lo=1, hi=TiB)
    grace_s: float = setting(F.number, 10.0, lo=0.0, hi=3600.0)
    #: An upload that sends nothing for this long is aborted (DEADLINE_EXCEEDED), freeing the
    #: tenant's upload slot; nothing of it is stored.
    upload_idle_s: float = setting(F.number, 60.0, lo=0.0, hi=86_400.0, lo_open=True)
    #: Calls the server holds at once, all callers together (queued, running, or whose reply
    #: is being sent); one more answers RESOURCE_EXHAUSTED before its request is parsed.
    max_inflight_calls: int = setting(F.integer, 4096, lo=1, hi=1_000_000)
    #: Calls the server works on at once (parsed, queued, running, answered); past it, a
    #: tenant over its fair share of this number waits before its request is parsed, so a
    #: flooding tenant cannot fill the event loop in front of the others
    #: (``itif.server.fairgate``). 0: no such limit.
    max_active_calls: int = setting(F.integer, 0, lo=0, hi=1_000_000)
    #: Calls gRPC may hold received but not yet taken by the server (a burst waits there for
    #: the event loop); past it gRPC itself cancels new calls (CANCELLED, not counted).
    max_pending_calls: int = setting(F.integer, 65_536, lo=1, hi=1_000_000)
    #: Calls (HTTP/2 streams) one connection may have open at once; a connection's calls
    #: beyond it wait in the client (HTTP/2 flow control): a burst on one connection cannot
    #: queue in front of every other caller's calls. 32, not gRPC's usual 100: another
    #: tenant's call waits behind the connection's calls that came first (issue 61's flood,
    #: one ingress process, 2 cores: quiet's median 61 -> 20 ms; the flood's own throughput
    #: unchanged, 1,200-1,750 OK/s either way: bench/hostile_load.py --parts fair).
    max_streams_per_connection: int = setting(F.integer, 32, lo=1, hi=1_000_000)
    #: The retry hint of a transient overload's answer (RESOURCE_EXHAUSTED's ``retry-after`` and
    #: ``grpc-retry-pushback-ms`` trailers, HTTP 429's ``Retry-After`` in whole seconds).
    retry_after_ms: int = setting(F.integer, 200, lo=1, hi=3_600_000)
    #: Bytes of replies a tenant, and a connection, may have computed or in computation and
    #: not yet read by the client; a call that would need more answers RESOURCE_EXHAUSTED
    #: before it runs (one call is always admitted when nothing is held).
    max_pending_reply_bytes: int = setting(F.size, 64 * MiB, lo=KiB, hi=TiB)
    #: Generate (a decoder backbone): the most new tokens one request may ask for; a request
    #: over it answers INVALID_ARGUMENT naming max_new_tokens. Live: a reload applies it to the
    #: next request.
    max_new_tokens: int = setting(F.integer, 512, lo=1, hi=MAX_NEW_TOKENS_LIMIT)
    #: Processes that take the gRPC port's calls off the daemon's interpreter
    #: (``itif.server.ingress``): each serves ``listen`` (the port shared, SO_REUSEPORT), hands
    #: Infer and InferBatch calls of token ids to the engine as columns through shared memory
    #: and every other call as raw bytes over a local socket, so no per-call work holds the GIL
    #: the forward needs. ``auto`` (the default): derived from the cores (:meth:`ingress_count`;
    #: none with an ephemeral port); 0: the daemon serves the port itself.
    ingress_processes: int | str = setting(F.count_or_auto, "auto", lo=0, hi=64)
    #: A nested section (``itif.config.parse`` reads it with the fields of :class:`TLSConfig`).
    tls: TLSConfig | None = None

    def ingress_count(self, cores: int | None = None) -> int:
        """The ingress processes to start: ``ingress_processes`` when a number; for ``auto``,
        one per four of the cores this process may run on (at least 1, at most 8; ``cores``
        overrides the count), like vLLM's API servers beside its engine core, or 0 when
        ``listen`` asks for an ephemeral port (``:0``): the processes share one fixed port."""
        if self.ingress_processes != "auto":
            return self.ingress_processes
        if self.listen.rpartition(":")[2] == "0":
            return 0
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
        return max(1, min(8, cores // 4))


@dataclass(frozen=True)
class BackboneConfig:
    """``config`` is a preset name (see :data:`BACKBONE_PRESETS`) or an absolute path. A
    decoder (a generation preset such as ``gpt2-tiny``, or a Hugging Face config whose
    ``model_type`` is gpt2, bart or marian) makes the daemon serve Generate instead of Infer."""

    config: str = setting(F.backbone_source, base_dir=True)
    device: Device = setting(F.choice, "auto", choices=DEVICES)
    dtype: DType = setting(F.choice, "auto", choices=DTYPES)
    max_seq_len: int | None = setting(F.integer, None, lo=1, hi=MAX_SEQ_LEN_LIMIT)
    #: Budget of the weight store in bytes (all tenants, shared tensors once); an upload that
    #: would exceed it is refused with RESOURCE_EXHAUSTED. None: no budget.
    max_weight_bytes: int | None = setting(F.size, None, lo=1, hi=64 * TiB)
    #: Weight tiers (``itif.weights.tiers``): the device tier's budget in bytes (the store the
    #: forward reads, shared tensors once). Set, every uploaded tenant stays servable beyond it:
    #: a request for a tenant not resident promotes it and evicts the least recently used idle
    #: unpinned one; with ``max_weight_bytes`` also set, the smaller applies. None: no tiers.
    device_weight_bytes: int | None = setting(F.size, None, lo=1, hi=64 * TiB)
    #: Weight tiers: bytes of evicted tenants' weights kept in host memory (pinned on CUDA)
    #: for a fast promotion; beyond it they are read back from disk. 0: no host tier.
    host_weight_bytes: int = setting(F.size, 0, lo=0, hi=64 * TiB)
    #: A decoder backbone: bytes of the KV cache pool, preallocated on the device at start (a
    #: request that does not fit waits for others to finish). None: the engine's default.
    kv_cache_bytes: int | None = setting(F.size, None, lo=MiB, hi=64 * TiB)

    @property
    def is_preset(self) -> bool:
        return self.config in backbone_presets()

    @property
    def is_decoder(self) -> bool:
        """Whether ``config`` names a decoder (GPT-2, BART, Marian): the daemon generates."""
        return F.is_decoder_backbone(self.config)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = setting(F.integer, 8192, lo=1, hi=1 << 24)
    max_batch_size: int = setting(F.integer, 256, lo=1, hi=1 << 16)
    max_wait_ms: float = setting(F.number, 5.0, lo=0.0, hi=60_000.0)
    strategy: str = setting(F.strategy, "auto")
    #: Never mix tenants in one batch (each tenant batched alone, as separate models are in
    #: Triton): the per-tenant baseline of ``itif bench``, not a production setting.
    isolate_tenants: bool = setting(F.flag, False)
    #: Stop growing a batch when the next request would make a member that can still meet its
    #: tenant's latency target miss it (``itif.scheduler``); off (the default): grow to the
    #: batch limits.
    latency_sizing: bool = setting(F.flag, False)


#: ``tenants[].compress``: none, or a delta tenant's format (``itif.weights.delta``).
COMPRESS = ("none", "int8", "sign")
DEFAULT_MAX_ERROR = 0.05


@dataclass(frozen=True)
class Tenant:
    id: str = setting(F.tenant_id)
    token_sha256: str = setting(F.sha256)
    #: Requests the tenant may have queued; at least 1 (a tenant that may queue nothing could
    #: never be served: remove it instead).
    max_queue: int = setting(F.integer, 64, lo=1, hi=1_000_000)
    weight: float = setting(F.number, 1.0, lo=0.0, hi=1e6, lo_open=True)
    max_seq_len: int | None = setting(F.integer, None, lo=1, hi=MAX_SEQ_LEN_LIMIT)
    latency_target_ms: float = setting(F.number, 100.0, lo=0.0, hi=3_600_000.0, lo_open=True)
    #: A LoRA tenant: the id of the tenant whose weights it adapts. It uploads a PEFT adapter
    #: (``itif upload --adapter DIR``) and reads every other weight from that tenant, which
    #: must be a full tenant (no ``base`` of its own). Fixed for the tenant's life.
    base: str | None = setting(F.tenant_id, None)
    #: Calls of the tenant the server holds at once (queued, running, or whose reply is being
    #: sent); one more answers RESOURCE_EXHAUSTED before its request is parsed. None: twice
    #: ``max_queue``.
    max_inflight: int | None = setting(F.integer, None, lo=1, hi=1_000_000)
    #: Weight tiers: keep the tenant's weights resident on the device (never evicted).
    pinned: bool = setting(F.flag, False)
    #: A delta tenant (``itif.weights.delta``): ``int8`` or ``sign`` stores its uploaded full
    #: checkpoint as ``base`` (required; a full tenant) plus a compressed delta. ``none``: a
    #: full (or, with ``base``, LoRA) tenant. Fixed for the tenant's life.
    compress: str = setting(F.choice, "none", choices=COMPRESS)
    #: A delta tenant: the largest max abs logit difference between its exact weights and the
    #: compressed ones, measured on a probe batch at upload, that the upload accepts (above:
    #: refused, nothing stored). Only with ``compress``; None: :data:`DEFAULT_MAX_ERROR`.
    max_error: float | None = setting(F.number, None, lo=0.0, hi=1e6, lo_open=True)

    @property
    def is_delta(self) -> bool:
        return self.compress != "none"

    @property
    def error_limit(self) -> float:
        """``max_error``, or its default."""
        return DEFAULT_MAX_ERROR if self.max_error is None else self.max_error


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    backbone: BackboneConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    tenants: tuple[Tenant, ...] = ()

    @property
    def tenant_ids(self) -> tuple[str, ...]:
        return tuple(t.id for t in self.tenants)

    def tenant(self, tenant_id: str) -> Tenant | None:
        """The tenant with this id, or ``None`` (a dict lookup: per request, at any count)."""
        return self._by_id.get(tenant_id)

    def tenant_by_token_sha256(self, digest: str) -> Tenant | None:
        """The tenant whose ``token_sha256`` is ``digest``, or ``None``. A dict lookup keyed by
        the digest of the presented token: its time depends on neither the tenant count nor
        how much of a stored digest matches (the caller cannot choose digests)."""
        return self._by_token.get(digest)

    def tenants_on(self, base: str) -> tuple[Tenant, ...]:
        """The tenants whose ``base`` is ``base`` (LoRA and delta tenants), in file order; a
        dict lookup, not a scan: an upload asks it for every tenant it commits."""
        return self._by_base.get(base, ())

    @functools.cached_property
    def _by_base(self) -> dict[str, tuple[Tenant, ...]]:
        out: dict[str, list[Tenant]] = {}
        for t in self.tenants:
            if t.base is not None:
                out.setdefault(t.base, []).append(t)
        return {b: tuple(ts) for b, ts in out.items()}

    @functools.cached_property
    def _by_id(self) -> dict[str, Tenant]:
        return {t.id: t for t in self.tenants}

    @functools.cached_property
    def _by_token(self) -> dict[str, Tenant]:
        return {t.token_sha256: t for t in self.tenants}


def hash_token(token: str) -> str:
    """Lowercase hex sha256 of the UTF-8 token: the value to put in ``*token_sha256``."""
    if not isinstance(token, str):
        raise TypeError(f"token must be str, got {type(token).__name__}")
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenDigests:
    """:func:`hash_token` of the tokens that named a caller, remembered: a call presents its
    token twice (the auth interceptor, then the method), and under load every hash is the one
    interpreter's time. A pure function of the token, so a config reload invalidates nothing;
    at ``limit`` entries it starts over (a stream of distinct tokens costs no memory)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._known: dict[str, str] = {}

    def __contains__(self, token: str) -> bool:
        return token in self._known

    def lookup(self, token: str) -> tuple[str, bool]:
        """(the token's digest, whether it was remembered)."""
        digest = self._known.get(token)
        return (digest, True) if digest is not None else (hash_token(token), False)

    def keep(self, token: str, digest: str) -> None:
        """Remember a token that named a caller (never one that did not)."""
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known[token] = digest
