"""GenEngine: many tenants' fine-tuned decoders in one running batch (iteration-level batching).

One GenEngine serves one backbone (a DecoderSpec): tenants' weights in a ``WeightStore``
(identical tensors once), one ``RunningBatch`` (the KV pool and the rows of every running
request, ``itif.generation.running``) and one ``SearchBatch`` (the decoding search of every
row, ``itif.generation.search``). The iteration loop, each step:

1. cancelled requests leave (rows and cache blocks freed); when the running rows' next blocks
   (decoder-only: taken as rows grow) do not fit, the request that joined last is preempted
   (``scheduling.StepParts._preempt``) until they do: its blocks freed, its search state kept,
   it waits at the front of the queue to be recomputed;
2. waiting requests join, preempted ones first, then in fair order across tenants (start-time
   fair queueing over their generated-token budgets, weighted by ``tenants[].weight``:
   ``itif.generation.join_order``) while the KV pool has room, after the running rows' growth,
   for their prompt and each row's next block (a tenant's cached prefix blocks are shared:
   ``itif.generation.cache``; encoder-decoder: the whole reservation); the next one that does
   not fit waits for blocks to free, never failing the batch;
3. one decode forward over all rows already running (every tenant together), and the prefill
   (GPT-2 prompts) or encoder + decoder start (BART, Marian) of the joining requests; joining
   requests whose prompts fail together (out of memory: a long prompt) run again one by one, and
   only those that still fail fail (RESOURCE_EXHAUSTED for out-of-memory), the running rows
   untouched. A decode forward that fails runs again in halves of the running requests, halved
   again, so only a request that fails alone fails (its rows leave), and the others go on;
4. ``SearchBatch.step`` over all rows' logits decides each row's token and the row it continues;
   the row table is reordered with those parents (indices, never cache contents);
5. the step's new tokens of streaming requests (greedy, one-row sampling) are handed out, one
   array per consumer (``itif.generation.streams``; a request without one: a "tokens" event to
   its own callback); finished requests leave: their results are delivered, blocks freed.

Every part of a decode step works on tensors or numpy arrays over all rows (the search, the
row table, block growth, the streamed tokens), so one step makes the same number of Python calls
whatever the number of running requests (``tests/test_decode_step_calls.py``); what is done per
request is done once per event: a request joining, finishing, cancelled or preempted.

``generate`` runs the loop inline until its requests are done (when the background loop is not
started); ``start`` runs it on a thread for ``submit``/``cancel`` (the daemon).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from itif import threadnames
from itif.backbones.hf import CanonicalWeights
from itif.errors import InvalidRequest, ItifError, TenantNotFound, Unavailable, shown
from itif.generation import decoder_lora, deltas, streams
from itif.generation.api import GenerateRequest, Generation, GenerationDefaults, check_request
from itif.generation.gen_tickets import GenEvent, GenTicket
from itif.generation.hf_import import load_decoder_weights
from itif.generation.join_order import FairWaiting
from itif.generation.running import JoiningRequest, RunningBatch
from itif.generation.scheduling import StepParts, error_for
from itif.generation.spec import PRESET_DEFAULTS, DecoderSpec, defaults_from_dir, load_decoder_spec
from itif.platform import tune_host_malloc
from itif.runtime import cpu_gemm
from itif.weights.store import WeightStore

log = logging.getLogger("itif.generation")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _search():
    from itif.generation import search  # SEARCH's module (imported lazily: built in parallel)

    return search


class GenEngine(StepParts):
    def __init__(self, backbone: str | os.PathLike | DecoderSpec, device="cpu", dtype="float32",
                 kv_cache_bytes: int | None = None, max_new_tokens_limit: int = 512) -> None:
        self.spec = load_decoder_spec(backbone)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.max_new_tokens_limit = max_new_tokens_limit
        cpu_gemm.ensure_for(self.device, self.dtype)  # decode steps' few-rows GEMMs, built now
        tune_host_malloc(self.device)
        self.store = WeightStore(self.device, self.dtype)
        if kv_cache_bytes is None:  # room for 64 sequences of the backbone's full length
            elem = torch.empty((), dtype=self.dtype).element_size()
            sp = self.spec
            kv_cache_bytes = 64 * sp.max_len * sp.dec_layers * 2 * sp.kv_width * elem
        self.kv_cache_bytes = kv_cache_bytes
        self._before_forward: Callable[[set[str]], None] | None = None
        self._rebuild = False  # the batch must be made again before the next step
        # LoRA tenants' adapters
        self.lora = decoder_lora.LoraBank(self.spec, self.device, self.dtype)
        self._batch = RunningBatch(self.spec, self.store, kv_cache_bytes, lora=self.lora)
        self._sb = None
        self._defaults: dict[str, GenerationDefaults] = {}
        self._tokenizers: dict[str, Any] = {}
        base = self.spec.source_dir
        self._base_defaults = (
            (defaults_from_dir(base) if base is not None else None)
            or PRESET_DEFAULTS.get(self.spec.name)
            or GenerationDefaults(
                pad_token_id=self.spec.pad_token_id,
                decoder_start_token_id=self.spec.pad_token_id
                if self.spec.family == "marian"
                else None,
            )
        )
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._waiting: FairWaiting[GenTicket] = FairWaiting()
        self._resume: deque[GenTicket] = deque()  # preempted requests, resumed before any other
        self.preemptions = 0  # requests preempted for lack of KV blocks, since the start
        self._running: dict[int, GenTicket] = {}
        self._sinks = streams.Sinks()  # the streamed tokens' consumers
        self._restream: list[GenTicket] = []  # consumers given (``stream_to``) since the last step
        self._cancel: list[GenTicket] = []
        self._step_lock = threading.Lock()  # one iteration at a time
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def before_forward(self) -> Callable[[set[str]], None] | None:
        """Test hook (``itif.faults``): called with the tenants of every forward (prompt or
        decode) before it runs; what it raises, the forward raises."""
        return self._before_forward

    @before_forward.setter
    def before_forward(self, fn: Callable[[set[str]], None] | None) -> None:
        self._before_forward = self._batch.before_forward = fn

    # ---- tenants ---------------------------------------------------------------------------
    def load_weights(self, source) -> CanonicalWeights:
        """Canonical weights of an HF checkpoint dir, safetensors file or state dict."""
        return load_decoder_weights(self.spec, source)

    #: (source, base, compress) -> (W_hat, report): a full fine-tune as stored tenant ``base``
    #: plus an int8 or sign delta, its error measured (``itif.generation.deltas``)
    load_delta = deltas.load_delta
    load_delta_blob = deltas.load_delta_blob  # (blob path, base, base_sha256) -> W_hat
    load_lora = decoder_lora.load_adapter  # (PEFT adapter, base) -> LoraAdapter, checked, not added

    def add_tenant(self, tenant: str, source, defaults: GenerationDefaults | None = None,
                   base: str | None = None, compress: str | None = None) -> None:
        """Add (or replace) ``tenant``. Its generation settings: ``defaults``, else the
        checkpoint directory's generation_config.json / config.json, else the backbone's; its
        tokenizer: the directory's tokenizer.json when there is one. With ``base`` and
        ``compress`` ("int8" or "sign"): a full checkpoint stored as that stored tenant plus a
        compressed delta, served as W_hat (``load_delta``; or pass what it returned). With
        ``base`` alone: ``source`` is a PEFT LoRA adapter on that stored tenant
        (``itif.generation.decoder_lora``), which keeps the base's settings and tokenizer.

        Replacing a tenant ends its running requests with Unavailable (retryable) between two
        steps, rather than letting them continue on other weights than they started with; its
        waiting requests start on the new weights."""
        adapter = None
        if base is not None and compress in (None, "none"):
            adapter = self.load_lora(source, base)
            weights = CanonicalWeights({}, None, False)  # every tensor the base's, shared
        else:
            weights = (self.load_weights(source) if compress in (None, "none")
                       else self.load_delta(source, base, compress)[0])
        d = defaults
        tok = None
        if adapter is None and isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
            if d is None:
                d = defaults_from_dir(source)
            tj = Path(source) / "tokenizer.json"
            if tj.is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(tj))
        with self._step_lock:
            if adapter is not None:  # checked again: the base may have changed meanwhile
                adapter = self.load_lora(adapter, base)
                d, tok = d or self.defaults(base), self._tokenizers.get(base)
            replaced = self._take_running(tenant) if tenant in self.store else []
            self.lora.put(tenant, adapter, lambda: self.store.add(
                tenant, weights, base=base if adapter is not None else None))
            self._defaults[tenant] = d or self._base_defaults
            self._tokenizers[tenant] = tok
        self._fail(replaced, Unavailable(f"tenant {shown(tenant)}'s weights were replaced during "
                                         "its generation: send the request again"))

    def remove_tenant(self, tenant: str) -> None:
        """Remove ``tenant``; its waiting and running requests end with a TenantNotFound
        "error" event (between two steps: the others carry on)."""
        with self._step_lock:
            with self._cv:
                dropped = [t for t in self._waiting if t.request.tenant == tenant]
                for t in dropped:
                    self._waiting.remove(t)
            dropped += self._take_running(tenant)
            self.store.remove(tenant)
            self.lora.unbind(tenant)
            self._defaults.pop(tenant, None)
            self._tokenizers.pop(tenant, None)
        self._fail(
            dropped, TenantNotFound(f"tenant {shown(tenant)} was removed during its generation")
        )

    def _take_running(self, tenant: str) -> list[GenTicket]:
        """(Step lock held.) Take ``tenant``'s running requests out: rows and blocks freed."""
        with self._cv:
            held = [t for t in self._resume if t.request.tenant == tenant]
            for t in held:  # preempted: their cache was on the weights being replaced
                self._resume.remove(t)
        keys = self._batch.keys_of(tenant)
        if not keys:
            return held
        if self._sb is not None:
            self._sb.remove(keys)
        self._batch.remove(keys)
        return held + [self._running.pop(k) for k in keys]

    def _fail(self, tickets: list[GenTicket], err: ItifError) -> None:
        for t in tickets:
            t.done = True
            if not t.cancelled:
                self._emit(t, GenEvent("error", error=err))

    def _emit(self, t: GenTicket, ev: GenEvent) -> None:
        """``ev`` to ``t``'s caller. A callback that raises (its caller's event loop closed,
        say) ends its own request only: cancelled, its rows leave at the next step; the step
        and every other request go on."""
        try:
            t.on_event(ev)
        except Exception:
            log.exception("generation request %s (tenant %s): its event callback raised; the "
                          "request is cancelled", t.id, t.request.tenant)
            self.cancel(t)

    def tenants(self) -> list[str]:
        return self.store.tenants()

    def defaults(self, tenant: str) -> GenerationDefaults:
        if tenant not in self.store:
            raise TenantNotFound(f"tenant {shown(tenant)} not found")
        return self._defaults.get(tenant, self._base_defaults)

    def tokenizer(self, tenant: str):
        return self._tokenizers.get(tenant)

    # ---- validation --------------------------------------------------------------------------
    def check(self, r: GenerateRequest) -> None:
        """Raise what :meth:`generate` would refuse ``r`` for (InvalidRequest naming the field:
        out of range, over the positions, more than the whole KV cache), running nothing."""
        self._prepare(r)

    def _prepare(self, r: GenerateRequest) -> GenTicket:
        """Validate ``r`` fully (InvalidRequest naming the field) and resolve its search."""
        spec = self.spec
        if r.tenant not in self.store:
            raise TenantNotFound(f"tenant {shown(r.tenant)} not found")
        check_request(r, self.max_new_tokens_limit, spec.vocab_size)
        d = self.defaults(r.tenant)
        n = len(r.input_ids)
        if spec.encoder_decoder:
            start = (
                d.decoder_start_token_id if d.decoder_start_token_id is not None else d.bos_token_id
            )
            if start is None:
                raise InvalidRequest(f"tenant: {shown(r.tenant)}'s checkpoint sets no "
                                     "decoder_start_token_id (nor bos_token_id)")
            if n > spec.max_position:
                raise InvalidRequest(f"input_ids: {n} tokens, over the backbone's "
                                     f"{spec.max_position} positions")
            prompt, source, total = (
                [int(start)],
                [int(t) for t in r.input_ids],
                1 + r.max_new_tokens,
            )
        else:
            if n > spec.max_len:
                raise InvalidRequest(f"input_ids: {n} tokens, over the backbone's "
                                     f"{spec.max_len} positions")
            prompt, source, total = [int(t) for t in r.input_ids], None, n + r.max_new_tokens
        if total - 1 > spec.max_len:  # the last new token is never fed back (generate())
            raise InvalidRequest(f"max_new_tokens: {r.max_new_tokens} new tokens after "
                                 f"{len(prompt)} decoder tokens need {total - 1} positions, "
                                 f"over the backbone's {spec.max_len}")
        params = _search().search_params(r, d, spec.encoder_decoder)
        t = GenTicket(next(self._ids), r, lambda ev: None, params)
        t.admission = JoiningRequest(t.id, r.tenant, prompt, params.rows, r.max_new_tokens - 1,
                                     source)
        t.history = prompt
        t.stream = params.mode != "beam"
        need = self._batch.blocks_full(t.admission)
        if need > self._batch.pool.blocks:  # never fits, however long it waits: not retryable
            field_name = ("max_new_tokens" if params.rows == 1 else
                          "num_beams" if params.mode == "beam" else "num_return_sequences")
            raise InvalidRequest(f"{field_name}: the request needs {need} KV cache blocks "
                                 f"({params.rows} rows of up to {total} positions), the whole "
                                 f"cache has {self._batch.pool.blocks} (kv_cache_bytes "
                                 f"{self.kv_cache_bytes})")
        return t

    # ---- serving -----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        """Generate for every request (all validated before any runs); results in order."""
        tickets = [self._prepare(r) for r in requests]
        out: list[Any] = [None] * len(tickets)
        left = threading.Semaphore(0)

        def sink(i: int) -> Callable[[GenEvent], None]:
            def on(ev: GenEvent) -> None:
                if ev.kind in ("done", "error"):
                    out[i] = ev
                    left.release()
            return on

        for i, t in enumerate(tickets):
            t.on_event = sink(i)
            t.stream = False
        with self._cv:
            for t in tickets:
                self._enqueue(t)
            self._cv.notify_all()
        if self._thread is None:
            while any(o is None for o in out):
                self._iterate()
        for _ in tickets:
            left.acquire()
        for ev in out:
            if ev.kind == "error":
                raise ev.error
        return [ev.generation for ev in out]

    def submit(self, request: GenerateRequest, on_event: Callable[[GenEvent], None],
               sink: streams.Consumer | None = None) -> GenTicket:
        """Queue ``request`` (validated now: InvalidRequest raises here); events come from the
        loop thread and ``on_event`` must not block. ``sink``: the consumer its streamed tokens
        go to, in bulk with its other requests' (``itif.generation.streams``; held weakly);
        without one they come to ``on_event`` as "tokens" events."""
        t = self._prepare(request)
        t.on_event, t.sink = on_event, sink
        with self._cv:
            self._enqueue(t)
            self._cv.notify_all()
        return t

    def stream_to(self, ticket: GenTicket, sink: streams.Consumer) -> None:
        """Hand ``ticket``'s streamed tokens to ``sink`` from the next step on, rather than to
        its callback: for a caller whose ticket came through a front door that takes a
        callback only (``Daemon.submit_generate``). Tokens decided before came through the
        callback, each token once either way, in order."""
        with self._cv:
            ticket.sink = sink
            self._restream.append(ticket)

    def _enqueue(self, t: GenTicket) -> None:
        """Queue ``t`` at its fair place; its cost is its token budget (see ``join_order``)."""
        a = t.admission
        cost = a.rows * a.max_new_tokens + len(a.prompt) + (len(a.source) if a.source else 0)
        self._waiting.append(t, t.request.tenant, cost)

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Tenants' shares of admissions under contention (tenants.yaml's ``weight``)."""
        with self._cv:
            self._waiting.set_weights(weights)

    def cancel(self, ticket: GenTicket) -> None:
        """Free the request's rows and cache blocks (at the loop's next step); no more events."""
        with self._cv:
            if ticket.done or ticket.cancelled:
                return
            ticket.cancelled = True
            try:
                if ticket in self._resume:
                    self._resume.remove(ticket)
                else:
                    self._waiting.remove(ticket)
                ticket.done = True
            except ValueError:
                self._cancel.append(ticket)
            self._cv.notify_all()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="itif-generate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread; requests still waiting or running end with Unavailable."""
        th = self._thread
        if th is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        th.join()
        self._thread = None
        with self._step_lock:
            with self._cv:
                waiting = list(self._resume) + list(self._waiting)
                self._resume.clear()
                for t in waiting[len(waiting) - len(self._waiting):]:
                    self._waiting.remove(t)
            self._fail(waiting, Unavailable("the generation engine stopped"))
            if self._running:  # an emptied batch: the next start begins clean
                self._fail_all(Unavailable("the generation engine stopped"))

    def cache_stats(self) -> dict:
        pool = self._batch.pool
        with self._cv:
            waiting = len(self._waiting) + len(self._resume)
        return {"blocks_total": pool.blocks, "blocks_free": pool.free_blocks,
                "blocks_cached": pool.cached_blocks, "preemptions": self.preemptions,
                "blocks_used": pool.blocks - pool.free_blocks, "block_positions": pool.block,
                "bytes_total": pool.blocks * pool.block_bytes,
                "bytes_used": (pool.blocks - pool.free_blocks) * pool.block_bytes,
                "rows": self._batch.rows, "running": len(self._running), "waiting": waiting}

    def cross_positions(self, ticket: GenTicket) -> int:
        """Pool positions holding a running request's cross-attention K/V (one copy per source)."""
        return self._batch.cross_positions(ticket.id)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        threadnames.adopt()
        while True:
            with self._cv:
                while (not self._stop and not self._waiting and not self._resume
                       and not self._running and not self._cancel):
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self._iterate()
            except Exception:
                log.exception("generation loop error; continuing")
                time.sleep(0.05)

    def _iterate(self) -> None:
        with self._step_lock:
            try:
                self._step()
                return
            except Exception as e:
                log.exception("generation step failed")
                err = error_for(e, "the device ran out of memory running a generation step: "
                                "retry", "generation step failed")
                err.__cause__ = None  # logged: its frames (the step's tensors) can go now
            self._fail_all(err)

    def _step(self) -> None:
        if self._rebuild:  # a failed step could not make its new batch: again now
            self._new_batch()
        batch = self._batch
        if self._sb is None:
            self._sb = _search().SearchBatch(self.spec.vocab_size, self.device)
        sb = self._sb
        with self._cv:
            cancel, self._cancel = self._cancel, []
            restream, self._restream = self._restream, []
            for t in cancel:  # preempted after its cancel came: it waits no more
                if t in self._resume:
                    self._resume.remove(t)
                    t.done = True
        gone = [t for t in cancel if t.id in self._running]
        if gone:
            keys = [t.id for t in gone]
            sb.remove(keys)
            batch.remove(keys)
            for t in gone:
                del self._running[t.id]
                t.done = True
        for t in restream:  # a consumer for a running request (a waiting one: when it joins)
            if t.id in self._running and t.stream:
                sb.stream(t.id, t.id, self._sinks.slot(t.sink))
        self._preempt(batch, sb)  # room for the running rows' next blocks (decode takes them)
        with self._cv:
            joins: list[GenTicket] = []
            free = batch.pool.free_blocks - batch.grow_need()  # the running rows grow first
            while self._resume or self._waiting:
                head = self._resume[0] if self._resume else self._waiting.peek()
                need = batch.blocks_needed(head.admission)
                if need > free:
                    break
                free -= need
                joins.append(self._resume.popleft() if self._resume else self._waiting.pop())
        for t in [t for t in joins if t.request.tenant not in self.store]:
            # removed between its submit's check and now (the store changes under this lock)
            joins.remove(t)
            self._fail([t], TenantNotFound(f"tenant {shown(t.request.tenant)} was removed "
                                           "before its generation started"))
        for t in joins:  # running from here: a failing step below reports to them too
            self._running[t.id] = t
        joins = [t for t in joins if self._join_search(sb, t)]
        if not batch.rows and not joins:
            return
        parts = []
        if batch.rows:
            logits = self._decode(batch, sb)
            if logits.shape[0]:
                parts.append(logits)
        if joins:
            joins = self._admit(batch, sb, joins, parts)
        if not parts:  # every join failed and nothing was running
            return
        res = sb.step(torch.cat(parts) if len(parts) > 1 else parts[0])
        batch.apply(res.tokens, res.parent)
        self._stream(res.streamed)
        if res.finished:
            keys = list(res.finished)
            results, keep = sb.remove(keys)
            mine = batch.remove(keys)
            if not torch.equal(keep.to(mine.device), mine):
                raise ItifError("search and cache disagree on the surviving rows")
            for k in keys:
                t = self._running.pop(k)
                t.done = True
                if not t.cancelled:
                    self._emit(t, GenEvent("done", generation=self._generation(t, results[k])))

    def _stream(self, streamed) -> None:
        """This step's new tokens of streaming requests: one array to each consumer, a
        "tokens" event to each request that has none (``itif.generation.streams``). Requests
        cancelled during the step get nothing more."""
        with self._cv:
            gone = [t.id for t in self._cancel]
        ids, toks = self._sinks.hand_out(streamed, gone, self._consumer_failed)
        for key, tok in zip(ids, toks):
            self._emit(self._running[key], GenEvent("tokens", tokens=[tok]))

    def _consumer_failed(self, ids, err: Exception) -> None:
        """A consumer raised (its event loop closed, say): its requests of the step end, as a
        callback that raises ends its own request (``_emit``)."""
        for key in ids.tolist():
            self.cancel(self._running[key])

    @staticmethod
    def _generation(t: GenTicket, g: Any) -> Generation:
        if isinstance(g, Generation):
            return replace(g, tenant=t.request.tenant)
        return Generation(t.request.tenant, [list(s) for s in g.sequences],
                          None if g.scores is None else list(g.scores), list(g.finish_reasons))

    def _fail_all(self, err: ItifError) -> None:
        """Fail every running request, then empty the batch: its rows are dropped and their
        blocks freed, the KV pool kept (a second pool beside the first could not be had where
        the step ran out of memory; before, that failure ended the loop thread). A batch that
        cannot be emptied is made again (here, else at the next step)."""
        running = list(self._running.values())
        self._running.clear()
        self._sb = None
        self._fail(running, err)
        try:
            self._batch.remove(list(self._batch.ids))
            return
        except Exception:
            log.exception("the running batch could not be emptied; a new one is made")
        self._rebuild = True
        self._new_batch()

    def _new_batch(self) -> None:
        self._batch = RunningBatch(self.spec, self.store, self.kv_cache_bytes,
                                   before_forward=self._before_forward, lora=self.lora)
        self._rebuild = False

__all__ = ["GenEngine", "GenEvent", "GenTicket"]
