"""The ``Generate`` RPC: one request of one tenant's decoder, its tokens streamed as decided.

A call is authenticated and admitted like Infer (``itif.server.service.AuthInterceptor`` and
``itif.server.admission``: counted in per tenant and server-wide before its request is parsed).
Then :meth:`itif.daemon.Daemon.submit_generate`, the daemon's front door for Generate,
validates it (an encoder daemon: UNIMPLEMENTED; an unknown tenant: NOT_FOUND; bad parameters:
INVALID_ARGUMENT naming the field), reserves its reply bytes through the callback it is given,
and hands it to the GenEngine's iteration loop. Each step's new tokens of every call on one
event loop reach that loop in bulk: the loop's consumer (``_LoopTokens``,
``itif.generation.streams``) is handed one array per step by the GenEngine's thread, posts it
to the loop in one callback, and there gives each call its token (tokens decided before the
consumer was given, and the result or error, come through the call's own callback); this
handler turns them into ``tokens`` messages (greedy search and sampling), then one ``result``
message at the end.

Leaving early frees the work: a client that cancels or goes away cancels the handler's task,
a deadline that passes ends it with DEADLINE_EXCEEDED, and either way the request's ticket is
cancelled in the GenEngine, which frees its sequences and KV cache blocks at its next step.

Metrics (``itif.metrics``): time to first token (the first ``tokens`` message, or for beam
search the result), the gap between consecutive token messages of a call, and the tokens
generated per tenant.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from itif.errors import DeadlineExceeded, InvalidRequest, ItifError, Unavailable
from itif.generation.api import HF_TOP_K, GenerateRequest
from itif.server._proto.itif.v1 import itif_pb2
from itif.server.admission import finish_reply, reserve_reply

log = logging.getLogger("itif.server")

__all__ = ["GenerationStream", "generate_call", "load_evicted", "to_request"]

_EARLY = {itif_pb2.EARLY_STOPPING_UNSPECIFIED: False, itif_pb2.EARLY_STOPPING_FALSE: False,
          itif_pb2.EARLY_STOPPING_TRUE: True, itif_pb2.EARLY_STOPPING_NEVER: "never"}
#: Optional scalar fields copied as they are when set (unset: GenerateRequest's default).
_OPTIONAL = ("max_new_tokens", "num_beams", "length_penalty", "no_repeat_ngram_size",
             "num_return_sequences", "temperature", "top_k", "top_p", "seed", "eos_token_id")
#: Reply bytes reserved per possible new token of each returned sequence (its id in a token
#: message and in the result, and its text in both) and per call.
_BYTES_PER_TOKEN, _CALL_BYTES = 64, 512


def to_request(msg: itif_pb2.GenerateRequest) -> tuple[GenerateRequest, str | None]:
    """(the domain request, the text to tokenize or None) of a Generate message. Values are
    taken as sent, so ``check_request`` names whatever is out of range."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input: set input_ids or text")
    kw: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    if msg.do_sample:  # unset: generate()'s default, as the proto says (sampling only)
        kw.setdefault("top_k", HF_TOP_K)
    if msg.early_stopping not in _EARLY:
        raise InvalidRequest(f"early_stopping: unknown value {msg.early_stopping}")
    req = GenerateRequest(msg.tenant, list(msg.input_ids.ids) if kind == "input_ids" else [],
                          early_stopping=_EARLY[msg.early_stopping], do_sample=msg.do_sample, **kw)
    return req, (msg.text if kind == "text" else None)


def _reply_bytes(req: GenerateRequest) -> int:
    rows = max(1, req.num_return_sequences)
    return _CALL_BYTES + rows * max(1, req.max_new_tokens) * _BYTES_PER_TOKEN


def _token_lists(ev: Any) -> list[tuple[int, list[int]]]:
    """(sequence, new ids) of a "tokens" event: ``ev.tokens`` is the ids of one sequence
    (``ev.sequence``, default 0) or a list of per-sequence id lists."""
    tokens = ev.tokens
    if tokens is None or len(tokens) == 0:
        return []
    first = tokens[0]
    if isinstance(first, (list, tuple)) or hasattr(first, "tolist") and getattr(first, "ndim", 0):
        return [(i, [int(t) for t in ids]) for i, ids in enumerate(tokens) if len(ids)]
    return [(int(getattr(ev, "sequence", 0) or 0), [int(t) for t in tokens])]


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` leaves out: a ``tokenizers.Tokenizer``'s
    added tokens marked special (a transformers tokenizer: its ``all_special_ids``)."""
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if added is not None:
        return frozenset(i for i, t in added().items() if t.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class _Text:
    """Incremental detokenization of the sequences of one call: each token message carries
    what its ids add to the sequence's text. Only the last few ids are decoded per message (the
    text of ``ids[prefix:]`` minus that of ``ids[prefix:read]``, as vLLM does), so a long
    generation costs no more per token than a short one; a character still incomplete (a
    byte-level token ending mid-character decodes to U+FFFD) waits for the ids that complete it.

    As in vLLM, special tokens are dropped before the windows are cut (they are skipped in the
    text anyway), and the window moves on only once it added text: a window that started at a
    skipped special token, or at a token that decodes to nothing, decoded the word after it as
    a sequence's first word, without the space a decoder puts between two words."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.special = frozenset() if tokenizer is None else _special_ids(tokenizer)
        self.ids: dict[int, list[int]] = {}  # sequence -> its ids so far, specials left out
        self.offsets: dict[int, tuple[int, int]] = {}  # sequence -> (prefix, read)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tok is None else self.tok.decode(ids, skip_special_tokens=True)

    def add(self, seq: int, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        all_ids = self.ids.setdefault(seq, [])
        all_ids.extend(i for i in ids if i not in self.special)
        prefix, read = self.offsets.get(seq, (0, 0))
        if read == len(all_ids):  # special tokens only: no text
            return ""
        before = self.decode(all_ids[prefix:read])
        text = self.decode(all_ids[prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""  # nothing new yet, or incomplete: sent with the next ids' text
        self.offsets[seq] = (read, len(all_ids))
        return text[len(before):]


@dataclass(frozen=True)
class _StepTokens:
    """A "tokens" event of one call as its loop's consumer hands it: one step's token."""

    tokens: list[int]
    kind: str = "tokens"
    sequence: int = 0


class _LoopTokens:
    """The token consumer of one event loop and one GenEngine (``itif.generation.streams``;
    ticket ids are an engine's own): the engine's thread hands it a step's tokens of every
    streaming call on this loop in one ``put``; one callback on the loop then gives each call
    its token. Calls register by ticket id."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gen: Any) -> None:
        self.loop, self.gen = loop, weakref.ref(gen)
        self.calls: dict[int, asyncio.Queue] = {}

    def put(self, ids: Any, tokens: Any) -> None:  # the GenEngine's thread: never blocks
        self.loop.call_soon_threadsafe(self._deliver, ids, tokens)

    def _deliver(self, ids: Any, tokens: Any) -> None:
        calls = self.calls
        for key, tok in zip(ids.tolist(), tokens.tolist()):
            q = calls.get(key)
            if q is not None:  # a call that ended meanwhile wants nothing more
                q.put_nowait(_StepTokens([tok]))


_CONSUMERS: dict[tuple[int, int], _LoopTokens] = {}  # (id(loop), id(engine)) -> consumer


def _loop_tokens(loop: asyncio.AbstractEventLoop, gen: Any) -> _LoopTokens:
    """The consumer of ``loop`` and ``gen``, made on their first call (those of closed loops
    and of engines gone are dropped then)."""
    key = (id(loop), id(gen))
    c = _CONSUMERS.get(key)
    if c is None or c.loop is not loop or c.gen() is not gen:
        for k, other in list(_CONSUMERS.items()):
            if other.loop.is_closed() or other.gen() is None:
                _CONSUMERS.pop(k, None)
        c = _CONSUMERS[key] = _LoopTokens(loop, gen)
    return c


async def load_evicted(daemon: Any, who: Any, tenant: str) -> None:
    """Load ``tenant`` on a worker thread when the weight tiers evicted it (on the host or
    disk), before its :class:`GenerationStream` is submitted: there it would be loaded on the
    event loop's thread (``itif.daemon_tiers.generating``), stalling every other call for as
    long as its weights take to read. Only a tenant ``who`` may see is loaded: what anyone
    else asks for is left to the submission to refuse (NotFound), having loaded nothing, as
    are every other refusal and a failed load (``itif.daemon_tiers.preload``)."""
    if (daemon.tiers is None or daemon.generator is None or tenant in daemon.engine.store
            or tenant not in daemon.tenants or not who.may_see(tenant)):
        return
    from itif import daemon_tiers  # noqa: PLC0415 - only with weight tiers

    try:
        await asyncio.to_thread(daemon_tiers.preload, daemon, tenant)
    except ItifError:  # its file refused (the tenant is FAILED now), its base has no weights:
        pass  # the submission answers, after the checks that come first (bad parameters)


class GenerationStream:
    """One submitted generation, its events delivered on the event loop: what the gRPC
    ``Generate`` call and the HTTP ``/v1/completions`` route share.

    Constructing it submits the request (:meth:`itif.daemon.Daemon.submit_generate`, with
    ``reserve``, the reply's reservation: its refusals are raised here, before any answer has
    started); :meth:`events` then yields
    ``("tokens", [(sequence, ids, text), ...])`` as the GenEngine decides them (greedy search
    and sampling) and ``("done", Generation)`` once at the end, records the generation metrics,
    and raises the engine's error, or DeadlineExceeded past ``deadline`` (``time.monotonic()``).
    Leaving early (a cancelled task, a client gone, an error) frees the request's sequences and
    cache blocks in the GenEngine: :meth:`close`, which :meth:`events` calls on its way out and
    which may be called again (nothing once it finished)."""

    def __init__(self, daemon: Any, who: Any, tenant: str, req: GenerateRequest,
                 text: str | None = None, reserve: Any = None) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()

        def on_event(ev: Any) -> None:  # the GenEngine's loop thread: never blocks
            loop.call_soon_threadsafe(self._events.put_nowait, ev)

        self.daemon, self.tenant = daemon, tenant
        self.start = time.perf_counter()
        self.finished = False
        self.ticket = daemon.submit_generate(who, tenant, req, on_event, text=text,
                                             reserve=reserve)
        self.words = _Text(daemon.engine.tokenizer_of(tenant))
        self._tokens: _LoopTokens | None = None
        gen = getattr(daemon, "generator", None)
        if hasattr(gen, "stream_to"):  # the step's tokens in bulk, with the loop's other calls'
            self._tokens = _loop_tokens(loop, gen)
            self._tokens.calls[self.ticket.id] = self._events
            gen.stream_to(self.ticket, self._tokens)

    async def events(self, deadline: float | None = None) -> AsyncIterator[tuple[str, Any]]:
        metrics, tenant = self.daemon.metrics, self.tenant
        first = last = None
        streamed = 0
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    ev = await asyncio.wait_for(self._events.get(), timeout)
                except TimeoutError:
                    raise DeadlineExceeded("the deadline passed before the generation ended; "
                                           "its sequences were freed") from None
                now = time.perf_counter()
                if ev.kind == "tokens":
                    parts = _token_lists(ev)
                    if not parts:
                        continue
                    count = sum(len(ids) for _, ids in parts)
                    streamed += count
                    if metrics is not None:
                        metrics.observe_tokens(tenant, now - (last if last is not None
                                                              else self.start),
                                               count, first=first is None)
                    first = first if first is not None else now
                    last = now
                    yield "tokens", [(seq, ids, self.words.add(seq, ids)) for seq, ids in parts]
                elif ev.kind == "done":
                    self.finished = True
                    g = ev.generation
                    if metrics is not None:
                        metrics.observe_generation(
                            tenant, sum(len(s) for s in g.sequences) - streamed,
                            None if first is not None else now - self.start)
                    yield "done", g
                    return
                elif ev.kind == "error":
                    self.finished = True
                    err = getattr(ev, "error", None)
                    raise err if isinstance(err, BaseException) else Unavailable(str(err))
        finally:
            self.close()

    def close(self) -> None:
        """Free the request's rows now unless it finished (cancelled, disconnected, expired or
        failed)."""
        if self._tokens is not None:
            self._tokens.calls.pop(self.ticket.id, None)
        if not self.finished:
            self.finished = True
            self.daemon.cancel_generate(self.ticket)


async def generate_call(daemon: Any, who: Any, msg: itif_pb2.GenerateRequest, context: Any
                        ) -> AsyncIterator[itif_pb2.GenerateResponse]:
    """The Generate stream of one authenticated caller (``who``)."""
    req, text = to_request(msg)
    if not msg.HasField("max_new_tokens"):  # the default never over the server's limit
        req = replace(req, max_new_tokens=min(req.max_new_tokens,
                                              daemon.config.server.max_new_tokens))
    tenant = msg.tenant

    def reserve(checked: GenerateRequest) -> None:  # in an admitted call, before any work;
        # called once every check passed: a reply sized from out-of-range values must not
        # answer RESOURCE_EXHAUSTED for what is INVALID_ARGUMENT
        reserve_reply(daemon, _reply_bytes(checked),
                      "ask for fewer sequences (num_return_sequences) or fewer new tokens")

    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    await load_evicted(daemon, who, tenant)
    call = GenerationStream(daemon, who, tenant, req, text, reserve)
    sha = daemon.tenants.sha256(tenant)
    try:
        async for kind, value in call.events(deadline):
            if kind == "tokens":
                for seq, ids, words in value:
                    yield itif_pb2.GenerateResponse(tokens=itif_pb2.GenerateTokens(
                        sequence=seq, ids=ids, text=words))
            else:
                yield await finish_reply(daemon, _result(value, call.words, sha))
    finally:
        call.close()


def _result(g: Any, words: _Text, sha: str) -> itif_pb2.GenerateResponse:
    scores = g.scores
    reasons = list(getattr(g, "finish_reasons", None) or [])
    seqs = []
    for i, ids in enumerate(g.sequences):
        ids = [int(t) for t in ids]
        seq = itif_pb2.GeneratedSequence(ids=ids, text=words.decode(ids),
                                         finish_reason=reasons[i] if i < len(reasons) else "")
        if scores is not None:
            seq.score = float(scores[i])
        seqs.append(seq)
    return itif_pb2.GenerateResponse(result=itif_pb2.GenerateResult(sequences=seqs,
                                                                     weights_sha256=sha))
