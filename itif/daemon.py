"""Daemon: the domain core behind the gRPC server (no protobuf here).

It owns the fused Engine, the durable BlobStore of uploaded weights, the Scheduler, and the
live configuration, and keeps every tenant's state (NO_WEIGHTS, LOADING, READY, FAILED).

Upload path (client-streamed): bytes stream into a temp file in the data directory while being
hashed; at the end the file is checked (size, sha256), read with the hostile-input-safe
safetensors reader, validated against the backbone (names, shapes, dtypes, finite values) and
the memory budget, committed atomically (fsync, rename, fsync dir), and only then swapped into
the weight store. A failure at any step leaves the previous weights serving. On start every
configured tenant with a stored file is restored after its sha256 is re-checked; a file that
fails marks that tenant alone FAILED.

A decoder backbone (``backbone.config`` such as ``gpt2-tiny``, or a GPT-2 / BART / Marian
config) makes the engine an ``itif.decoder_backend.DecoderBackend`` around a GenEngine: uploads,
restore and deletes run unchanged, Infer answers UNIMPLEMENTED, and Generate
(:meth:`Daemon.submit_generate`) runs in the GenEngine's own iteration loop.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from contextlib import ExitStack, nullcontext
from dataclasses import replace
from typing import Callable, Iterable

from itif import daemon_config, daemon_state, daemon_tiers, faults
from itif.backbones.hf import CanonicalWeights
from itif.batching.strategies import DEFAULT_STRATEGY
from itif.config import Config, ConfigDiff, Tenant, TokenDigests
from itif.daemon_state import Identity, State, TenantStatus, TenantView
from itif.daemon_tenants import TenantTable
from itif.decoder_backend import DecoderBackend, build_generator
from itif.errors import (
    InvalidRequest,
    ItifError,
    NoWeights,
    PermissionDenied,
    TenantNotFound,
    Unauthenticated,
    Unimplemented,
)
from itif.generation.api import GenerateRequest, check_request
from itif.observer import DaemonObserver
from itif.requests import check_tenant_lengths, utf8_text
from itif.runtime.engine import Engine, Request, Result
from itif.scheduler import Scheduler, SchedulerTicket
from itif.weights import delta
from itif.weights.blobstore import BlobStore, Upload

log = logging.getLogger("itif.daemon")


class Daemon:
    def __init__(self, config: Config, engine: Engine | None = None) -> None:
        self.config = config
        self.ready = False
        self.engine = engine
        self.blobs = BlobStore(config.server.data_dir / "store",
                               max_upload_bytes=config.server.max_upload_bytes)
        #: each tenant's state, visibility and locks (``itif.daemon_tenants``)
        self.tenants = TenantTable(t.id for t in config.tenants)
        self.scheduler: Scheduler | None = None
        self.tiers = None  # itif.weights.tiers.TierManager with backbone.device_weight_bytes
        self.config_lock = threading.Lock()  # one config edit at a time
        self._digests = TokenDigests()
        self.reloads_ok = 0
        self.reloads_failed = 0
        self.last_reload_error = ""
        #: What observes the daemon (``itif.observer``; the server sets ``itif.metrics.Metrics``
        #: before start()); None: nothing does.
        self.metrics: DaemonObserver | None = None
        self.kernel_checks: list = []  # itif.ops.selftest.KernelCheck of the start-up self-test
        self._generating: set = set()  # GenEngine tickets of running Generate calls
        self.delta_reports: dict[str, delta.DeltaReport] = {}  # delta tenants' last measure
        #: what each stored file was committed as (``daemon_state.identity``; from its note)
        self.stored_as: dict[str, tuple[str | None, str]] = {}
        self._gen_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Load the backbone, restore stored tenants, start the scheduler (slow: run it after
        the server already answers health checks with NOT_SERVING)."""
        cfg = self.config
        if self.engine is None and cfg.backbone.is_decoder:
            self.engine = DecoderBackend(build_generator(
                cfg.backbone.config, cfg.backbone.device, cfg.backbone.dtype,
                cfg.backbone.kv_cache_bytes, cfg.server.max_new_tokens))
        if self.engine is None:
            strategy = cfg.scheduler.strategy
            self.engine = Engine(cfg.backbone.config, device=cfg.backbone.device,
                                 dtype=cfg.backbone.dtype, max_seq_len=cfg.backbone.max_seq_len,
                                 max_weight_bytes=daemon_tiers.device_budget(cfg.backbone),
                                 strategy=DEFAULT_STRATEGY if strategy == "auto" else strategy)
        faults.install(self.engine, daemon=self)  # test-only (ITIF_FAULT_INJECT); none if unset
        if self.engine.device.type == "cuda":
            self.kernel_checks = _kernel_self_test(self.engine.device, self.engine.dtype)
        sch = cfg.scheduler
        gen = self.generator
        # a decoder daemon queues no Infer batches (submit refuses them): the scheduler only
        # keeps the tenants' quotas, as the reload path expects
        run = (self.engine.infer if gen is not None or self.metrics is None
               else self.metrics.run_batch(self.engine))
        self.scheduler = Scheduler.from_config(run, sch, cfg.tenants)
        self.tiers = daemon_tiers.build(self)
        self.stored_as = {t.id: daemon_state.noted(self, t) for t in cfg.tenants
                          if self.blobs.exists(t.id)}
        (self.restore if self.tiers is None else lambda: daemon_tiers.restore(self))()
        self.scheduler.start()
        if gen is not None:  # tenants' shares of the KV cache under contention (``weight``)
            gen.set_tenant_weights({t.id: t.weight for t in cfg.tenants})
            gen.start()
        self.ready = True
        log.info("ready: backbone %s on %s (%s), %d tenants, %d with weights",
                 self.engine.spec.name, self.engine.device, self.engine.dtype,
                 len(cfg.tenants), sum(s.state is State.READY for s in self.status.values()))

    def degraded_kernels(self) -> list:
        """Ops whose CUDA kernel is not used (``itif.ops.dispatch.KernelState`` with
        ``fallback``): failed the start-up self-test or failed to build at run time. They run
        the torch reference; the health List and ``itif_kernel_fallback`` report them."""
        from itif.ops import dispatch  # noqa: PLC0415

        return dispatch.fallbacks()

    @property
    def status(self) -> dict[str, TenantStatus]:
        """Tenant id -> state, of the configured tenants (the tenant table's)."""
        return self.tenants.status

    @property
    def generator(self):
        """The GenEngine of a decoder daemon; None for an encoder daemon."""
        return self.engine.gen if isinstance(self.engine, DecoderBackend) else None

    def stop(self, grace_s: float | None = None) -> None:
        self.ready = False
        grace = self.config.server.grace_s if grace_s is None else grace_s
        if self.scheduler is not None:
            self.scheduler.stop(grace)
        if self.tiers is not None:
            self.tiers.close()
        gen = self.generator
        if gen is not None:  # running generations finish within the grace period
            end = time.monotonic() + grace
            while self._generating and time.monotonic() < end:
                time.sleep(0.02)
            gen.stop()

    def restore(self) -> None:
        """Reload every configured tenant that has a committed weights file (full tenants
        first: a LoRA tenant needs its base)."""
        for t in sorted(self.config.tenants, key=lambda t: t.base is not None):
            if self.blobs.exists(t.id):
                self.load_stored(t.id)

    def base_of(self, tenant: str) -> str | None:
        conf = self.config.tenant(tenant)
        return None if conf is None else conf.base

    def load_weights(self, tenant: str, path, upload: bool = False,
                     ) -> tuple[CanonicalWeights, str | None]:
        """(validated weights, base) of a file for ``tenant``: a checkpoint, or for a LoRA
        tenant an adapter on its base, which must be serving; for a delta tenant
        (``compress``) the uploaded checkpoint compressed against its base (refused above its
        ``max_error``), or its stored blob (``upload`` False) on the base it was taken against."""
        conf = self.config.tenant(tenant)
        base = None if conf is None else conf.base
        if base is None:
            return self.engine.load_weights(path), None
        held = nullcontext()
        if self.tiers is not None and base in self.status:  # not evicted while it is read
            held = self.tiers.holding(base)
        with held:
            return self._load_on_base(tenant, conf, path, base, upload)

    def _load_on_base(self, tenant: str, conf, path, base: str, upload: bool,
                      ) -> tuple[CanonicalWeights, str | None]:
        if base not in self.engine.store and self.tiers is not None and base in self.status:
            self.tiers.promote(base)  # on disk or host: read (LoRA: added on its slots)
        kind = "a delta" if conf.is_delta else "a LoRA"
        if base not in self.engine.store:
            raise NoWeights(f"tenant {tenant!r} is {kind} tenant of {base!r}, which has no "
                            "weights yet: upload the base first")
        if not conf.is_delta:
            return self.engine.load_lora(path, base), base
        base_sha = self.tenants.sha256(base)
        if upload:
            weights, report = self.engine.load_delta(path, base, conf.compress, base_sha)
            log.info("tenant %s: %s delta on %s: max abs %s difference %.4g (max_error %g), "
                     "%d -> %d bytes", tenant, conf.compress, base, report.output,
                     report.max_abs_error, conf.error_limit, report.exact_bytes,
                     report.stored_bytes)
            delta.check_error(tenant, report, conf.error_limit)
        else:  # restore, promotion (tiers), re-derivation
            weights = self.engine.load_delta_blob(path, base, base_sha)
            self.delta_reports[tenant] = weights.report
        return weights, base

    def load_stored(self, tenant: str) -> None:
        """Serve ``tenant``'s committed file, or mark it FAILED (refused, or misplaced)."""
        st = self.status.setdefault(tenant, TenantStatus())
        why = daemon_state.misplaced(self, tenant)
        if why is not None:  # committed for another base or compress: not served as this one
            st.state, st.sha256, st.error = State.FAILED, "", why
            if self.tiers is not None:  # its waiting requests fail (FAILED first: see queue)
                self.tiers.forget(tenant, fail=NoWeights(f"tenant {tenant!r}: {why}"))
            elif tenant in self.engine.store:
                self.engine.remove_tenant(tenant)
            log.error("tenant %s: %s", tenant, why)
            return
        if self.tiers is not None:  # registered, loaded on demand (pinned: loaded now)
            self.tiers.forget(tenant)  # out of the store too
            daemon_tiers.register(self, tenant)
            conf = self.config.tenant(tenant)
            if conf is not None and conf.pinned and st.state is State.READY:
                self.tiers.ensure(tenant)
            return
        st.state = State.LOADING
        try:
            sha = self.blobs.verify(tenant)
            weights, base = self.load_weights(tenant, self.blobs.path_for(tenant))
            self.engine.add_tenant(tenant, weights, base=base, tag=sha)
            st.state, st.sha256, st.error = State.READY, sha, ""
            log.info("tenant %s restored (sha256 %s)", tenant, sha[:12])
        except ItifError as e:
            if tenant in self.engine.store:  # re-derived (its base changed): unloaded
                self.engine.remove_tenant(tenant)
            st.state, st.error = State.FAILED, f"stored weights refused: {e}"
            log.error("tenant %s: stored weights refused: %s", tenant, e)

    def _rederive(self, base: str) -> None:
        """The LoRA tenants of ``base`` follow its weights: reloaded from their stored adapters
        after the base changed, unloaded (FAILED, files kept) when it has none. Its delta
        tenants come back only on the base their delta was taken against (the same sha256);
        on other base weights they are FAILED: "upload the fine-tune again"."""
        for t in self.config.tenants_on(base):
            if t.id not in self.status:
                continue
            with self.tenants.lock(t.id):
                served = base in self.engine.store or (  # tiers: or on disk, loaded on demand
                    self.tiers is not None and self.blobs.exists(base))
                if served and self.blobs.exists(t.id):
                    self.load_stored(t.id)
                elif t.id in self.engine.store or (self.tiers is not None
                                                   and self.blobs.exists(t.id)):
                    st = self.status[t.id]
                    st.state, st.error = State.FAILED, f"its base {base!r} has no weights"
                    if self.tiers is not None:  # its waiting requests fail too
                        self.tiers.forget(t.id, fail=NoWeights(f"tenant {t.id!r}: {st.error}"))
                    else:
                        self.engine.remove_tenant(t.id)

    # ---- auth ------------------------------------------------------------------------------
    def identify(self, authorization: str | None) -> Identity:
        """Resolve ``Bearer <token>``: the admin's hash compared in constant time, the
        tenants' by a lookup keyed by the token's sha256 (``Config.tenant_by_token_sha256``):
        the cost does not grow with the tenant count."""
        authorization = (authorization or "").strip()  # perf_analyzer -H 'k: v' keeps the space
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        token = authorization[len("Bearer "):].strip()
        digest, known = self._digests.lookup(token)
        cfg = self.config
        if hmac.compare_digest(digest, cfg.server.admin_token_sha256):
            return Identity(None, admin=True, token_sha256=digest)
        found = cfg.tenant_by_token_sha256(digest)
        if found is None:
            raise Unauthenticated("invalid token")
        if not known:
            self._digests.keep(token, digest)
        self._note_tenant(found.id)
        return Identity(found.id, token_sha256=digest)

    def _visible(self, who: Identity, tenant: str) -> None:
        """Refuse a tenant ``who`` may not see (``TenantTable.check_visible``)."""
        self.tenants.check_visible(who, tenant)
        if self.metrics is not None:  # _note_tenant, inline: once per call
            self.metrics.note_tenant(tenant)

    def _note_tenant(self, tenant: str) -> None:
        if self.metrics is not None:
            self.metrics.note_tenant(tenant)

    @staticmethod
    def _require_admin(who: Identity) -> None:
        if not who.admin:
            raise PermissionDenied("this operation needs the admin token")

    # ---- uploads ---------------------------------------------------------------------------
    def begin_upload(self, who: Identity, tenant: str, sha256: str, total_size: int) -> Upload:
        """Open a streamed upload for a tenant the caller may see (size cap, one at a time)."""
        self._visible(who, tenant)
        return self.blobs.begin_upload(tenant, sha256, total_size)

    def finish_upload(self, tenant: str, upload: Upload, who: Identity | None = None) -> TenantView:
        """Verify, validate, probe, then commit durably and swap in (module docstring). The
        slow checks run first without the tenant's lock; the commit and swap run under it and
        refuse a tenant removed from the config meanwhile (nothing is committed then)."""
        try:
            upload.seal()  # size and sha256
            base_sha = self.tenants.sha256(self.base_of(tenant))
            try:
                weights, base = self.load_weights(tenant, upload.temp_path, upload=True)
            except ItifError as e:  # the reader names the file: not the server's paths
                e.args = tuple(str(a).replace(os.fspath(upload.temp_path), "the upload")
                               for a in e.args)
                raise
            sha = upload.expected_sha256
            # a tenant's own upload is not credited with what other tenants hold (see
            # WeightStore.check_budget); the operator's is
            owner = None if who is None or who.admin else tenant
            # Lock order, everywhere: a base's lock, then its tenant's, then the tiers' io (which
            # room_for holds to the swap). Without tiers the probe runs without the locks.
            held = ExitStack()
            with held:
                if self.tiers is not None:
                    self.tenants.lock_with_base(held, tenant, base)
                rides = None if isinstance(weights, delta.DeltaWeights) else base  # LoRA: kept
                with daemon_tiers.room_for(self, tenant, weights, rides, owner) as digests:
                    if digests is None:
                        digests = self.engine.store.check_budget(weights, owner=owner)
                    self.engine.probe(weights, base, digests)  # keys reused, left for the add
                    if self.tiers is None:
                        self.tenants.lock_with_base(held, tenant, base)
                    if tenant not in self.status:
                        raise TenantNotFound(
                            f"tenant {tenant!r} was removed from the configuration during its "
                            "upload; nothing was stored")
                    if who is not None and not who.still_accepted(self.config):
                        raise Unauthenticated("the token of this upload was rotated or revoked "
                                              "while it streamed; nothing was stored")
                    if base is not None and self.tenants.sha256(base) != base_sha:
                        raise NoWeights(
                            f"tenant {tenant!r}: its base {base!r} was deleted or replaced "
                            "during this upload; nothing was stored: upload it again")
                    if isinstance(weights, delta.DeltaWeights):  # the disk keeps the blob
                        sha = delta.replace_upload(upload, weights)
                    conf = self.config.tenant(tenant)
                    self.blobs.stage_note(tenant, daemon_state.note(conf))
                    upload.publish()
                    self.blobs.set_note(tenant)  # what it is for, before it is acknowledged
                    self.stored_as[tenant] = daemon_state.identity(conf)
                    self.engine.add_tenant(tenant, weights, base=base, tag=sha)
                    if self.tiers is not None:
                        self.tiers.installed(tenant, weights, rides)
                    st = self.status[tenant]
                    st.state, st.sha256, st.error = State.READY, sha, ""
                    if isinstance(weights, delta.DeltaWeights):
                        self.delta_reports[tenant] = weights.report
        finally:
            self.blobs.discard_note(tenant)  # a no-op once set
            upload.abort()  # a no-op once published
        self._rederive(tenant)
        log.info("tenant %s uploaded %d bytes (sha256 %s)", tenant, upload.total_size,
                 upload.expected_sha256[:12])
        return self.tenant_view(tenant, who)

    def upload(self, who: Identity, tenant: str, sha256: str, total_size: int,
               chunks: Iterable[bytes]) -> TenantView:
        """Blocking form of an upload from an iterable of chunks (tools and tests)."""
        with self.begin_upload(who, tenant, sha256, total_size) as up:
            for chunk in chunks:
                up.write(chunk)
            return self.finish_upload(tenant, up, who)

    def delete_weights(self, who: Identity, tenant: str) -> tuple[bool, int]:
        self._require_admin(who)
        self._visible(who, tenant)
        with self.tenants.lock(tenant):
            self._visible(who, tenant)  # removed from the config while waiting for the lock
            freed = 0
            self.status[tenant] = TenantStatus()  # first: a request queued from now on fails
            if self.tiers is not None:  # parked, out of every tier, the store included; the
                freed = self.tiers.forget(tenant, fail=NoWeights(  # requests waiting fail
                    f"tenant {tenant!r}: its weights were deleted while this request waited "
                    "for them to load"))
            if tenant in self.engine.store:
                freed = self.engine.tenant_info(tenant).exclusive_bytes
                self.engine.remove_tenant(tenant)
            deleted = self.blobs.delete(tenant)
            self.stored_as.pop(tenant, None)
        self._rederive(tenant)
        return deleted or freed > 0, freed

    # ---- inference -------------------------------------------------------------------------
    def _ready_tenant(self, who: Identity, tenant: str) -> Tenant:
        """The config of a tenant ``who`` may see (checked once a call) that serves now."""
        self._visible(who, tenant)
        self.tenants.check_ready(tenant)
        return self.config.tenant(tenant)

    def tokenize(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequest("this backbone ships no tokenizer: send input_ids")
        return tok.encode(utf8_text(text, "text", self.engine.spec.max_position)).ids

    def admit(self, who: Identity, tenant: str, requests: list[Request], *,
              deadline: float | None = None, priority: int = 0,
              reserve: Callable[[list[Request]], None] | None = None) -> list[SchedulerTicket]:
        """The front door of Infer: every server's Infer call (gRPC, KServe, the HTTP APIs)
        comes in here, all-or-nothing. In order, each step once: a tenant ``who`` may not see
        is NotFound (unknown and other tenants' alike); a decoder daemon is Unimplemented; a
        tenant without ready weights is NoWeights (FAILED_PRECONDITION); the requests are
        validated (InvalidRequest naming the request and field: nothing bad reaches the
        engine); ``reserve(requests)``, when given, holds the reply's bytes (the server's
        ``itif.server.admission``: raises to refuse, RESOURCE_EXHAUSTED) before anything is
        queued; then all are queued (the tenant's quota: Overloaded, RESOURCE_EXHAUSTED).
        ``deadline``: ``time.monotonic()`` by which the results are wanted. Returns one ticket
        per request, in order."""
        self._visible(who, tenant)
        if self.generator is not None:
            raise Unimplemented(f"backbone {self.engine.spec.name!r} is a decoder: call "
                                "Generate (itif generate); Infer serves encoder backbones")
        self.tenants.check_ready(tenant)
        conf = self.config.tenant(tenant)
        requests = [r if r.tenant == tenant else replace(r, tenant=tenant) for r in requests]
        if self.tiers is None:
            self.engine.check(requests)
        else:  # a tenant not resident is checked without its weights
            daemon_tiers.check(self, tenant, requests)
        tokens = [self.engine.request_tokens(r) for r in requests]
        check_tenant_lengths(tokens, tenant, conf.max_seq_len)
        if reserve is not None:
            reserve(requests)

        def queue() -> list[SchedulerTicket]:
            return self.scheduler.submit_many(requests, tokens=tokens, deadline=deadline,
                                              priority=priority)

        tickets = queue() if self.tiers is None else daemon_tiers.queue(
            self, tenant, len(requests), queue)
        if self.metrics is not None:
            self.metrics.watch(tenant, tickets)
        return tickets

    def submit(self, who: Identity, tenant: str, requests: list[Request],
               deadline: float | None = None, priority: int = 0) -> list[SchedulerTicket]:
        """:meth:`admit` without a reply to reserve (in-process callers, tests)."""
        return self.admit(who, tenant, requests, deadline=deadline, priority=priority)

    # ---- generation (a decoder backbone) -------------------------------------------------
    def submit_generate(self, who: Identity, tenant: str, request: GenerateRequest,
                        on_event, text: str | None = None,
                        reserve: Callable[[GenerateRequest], None] | None = None) -> object:
        """Validate one Generate request of ``tenant`` and hand it to the GenEngine's loop;
        returns its ticket (:meth:`cancel_generate` frees it). ``on_event(GenEvent)`` is
        called from the loop thread ("tokens", then "done" or "error") and must not block.
        Refusals, in order: an encoder daemon (Unimplemented), a tenant the caller may not see
        (NotFound), no weights (NoWeights), bad parameters (InvalidRequest naming the field,
        against the live ``server.max_new_tokens``). ``text``: the input, tokenized with the
        tenant's tokenizer (its ids replace ``request.input_ids``). The front door of Generate,
        as :meth:`admit` is Infer's: the tenant's visibility is checked once, and
        ``reserve(request)``, when given, holds the reply's bytes once every check above passed
        (the GenEngine's own included: ranges, positions, the whole KV cache), before it is
        queued (raises to refuse it, RESOURCE_EXHAUSTED)."""
        gen = self.generator
        if gen is None:
            raise Unimplemented(
                f"backbone {self.engine.spec.name!r} is an encoder: Generate needs a decoder "
                "backbone (GPT-2, BART, Marian); call Infer")
        conf = self._ready_tenant(who, tenant)
        request = replace(request, tenant=tenant)
        if text is not None:
            tok = self.engine.tokenizer_of(tenant)
            if tok is None:
                raise InvalidRequest(f"text: tenant {tenant!r} ships no tokenizer; send input_ids")
            request = replace(request, input_ids=list(
                tok.encode(utf8_text(text, "text", gen.spec.max_position)).ids))
        check_request(request, self.config.server.max_new_tokens, gen.spec.vocab_size)
        if conf.max_seq_len is not None and len(request.input_ids) > conf.max_seq_len:
            raise InvalidRequest(f"input_ids: length {len(request.input_ids)} exceeds tenant "
                                 f"{tenant!r}'s max_seq_len {conf.max_seq_len}")
        if reserve is not None:
            if tenant in gen.store:  # what submit() refuses, before the reply is held
                gen.check(request)
            reserve(request)
        on_event = daemon_tiers.generating(self, tenant, request, on_event)  # tiers: resident
        box: list = [None, False]  # the ticket, finished; under _gen_lock (never held while
        # the engine runs: its loop thread calls event())

        def event(ev) -> None:
            if ev.kind in ("done", "error"):
                with self._gen_lock:
                    box[1] = True
                    self._generating.discard(box[0])
            on_event(ev)

        ticket = gen.submit(request, event)
        with self._gen_lock:
            box[0] = ticket
            if not box[1]:
                self._generating.add(ticket)
        return ticket

    def cancel_generate(self, ticket) -> None:
        """Free a Generate call's sequences and cache blocks (its client went away, or its
        deadline passed); nothing when it already finished."""
        with self._gen_lock:
            self._generating.discard(ticket)
        gen = self.generator
        if gen is not None:
            gen.cancel(ticket)

    def infer(self, who: Identity, tenant: str, requests: list[Request],
              timeout: float | None = None, priority: int = 0) -> list[Result]:
        """Blocking form (CLI, tests); the gRPC server awaits the tickets instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tickets = self.submit(who, tenant, requests, deadline, priority)
        return [t.result(timeout) for t in tickets]

    # ---- tenants ---------------------------------------------------------------------------
    def tenant_view(self, tenant: str, who: Identity | None = None) -> TenantView:
        """``who``: the caller, when not the operator. A tenant is told nothing that depends on
        other tenants (``daemon_state.own_view``)."""
        st = self.status[tenant]
        total = exclusive = labels = 0
        if self.engine is not None and tenant in self.engine.store:
            info = self.engine.tenant_info(tenant)
            total, exclusive, labels = info.bytes, info.exclusive_bytes, info.num_labels or 0
        elif self.tiers is not None and (sig := self.tiers.signature(tenant)) is not None:
            labels = sig[0] or 0  # its head wherever its weights are now
        depth = self.scheduler.queue_depth(tenant) if self.scheduler is not None else 0
        tv = self.tiers.view(tenant) if self.tiers is not None else None
        tier = tv.tier.value if tv is not None else ("device" if total else "none")
        rep = self.delta_reports.get(tenant) if st.state is State.READY else None
        conf = self.config.tenant(tenant)
        error = st.error or (tv.error if tv is not None else "")  # or its last promotion's
        view = TenantView(tenant, st.state, st.sha256, total, exclusive, labels, depth, error,
                          tier, tv.host_bytes if tv is not None else 0,
                          rep.as_dict() if rep is not None else None,
                          conf.compress if conf is not None and conf.is_delta else "")
        return view if who is None or who.admin else daemon_state.own_view(view, tv)

    def get_tenant(self, who: Identity, tenant: str) -> TenantView:
        self._visible(who, tenant)
        return self.tenant_view(tenant, who)

    def list_tenants(self, who: Identity) -> list[TenantView]:
        if not who.admin:  # a tenant sees itself: no walk over every tenant
            return [self.tenant_view(who.tenant, who)] if who.tenant in self.status else []
        return [self.tenant_view(t, who) for t in sorted(self.status)]

    # ---- live configuration ---------------------------------------------------------------
    def apply_config(self, new: Config) -> ConfigDiff:
        """Apply a validated tenants.yaml edit (``itif.daemon_config.apply``)."""
        return daemon_config.apply(self, new)

    def config_failed(self, exc: Exception) -> None:
        self.reloads_failed += 1
        self.last_reload_error = str(exc)
        log.error("config reload refused, keeping the last good config: %s", exc)

    def outstanding(self, tenant: str) -> int:
        """The tenant's accepted calls that have not finished: Infer rows (queued or running)
        and Generate calls (waiting or running)."""
        return self.scheduler.outstanding(tenant) + self._generating_of(tenant)

    def _generating_of(self, tenant: str) -> int:
        with self._gen_lock:
            return sum(getattr(t, "request", None) is not None and t.request.tenant == tenant
                       for t in self._generating)


def _kernel_self_test(device, dtype) -> list:
    """Run every CUDA kernel once against its torch reference (``itif.ops.selftest``); a kernel
    that fails is disabled in dispatch. Never stops the start: the reference still serves."""
    from itif.ops import selftest  # noqa: PLC0415

    try:
        checks = selftest.self_test(device, dtype)
    except Exception:  # noqa: BLE001 - the self-test itself broke: keep serving, say so
        log.exception("kernel self-test failed to run")
        return []
    line = selftest.summary(checks)
    (log.info if all(c.ok for c in checks) else log.warning)("kernel self-test: %s", line)
    return checks

