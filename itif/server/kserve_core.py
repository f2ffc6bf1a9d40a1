"""KServe v2 / Open Inference Protocol without a wire format: what the gRPC servicer
(``itif.server.kserve``) and the REST routes (``itif.server.http.kserve_rest``) share.

Each method takes plain values (the ``authorization`` header, names, numpy tensors, JSON-like
parameters) and returns plain values: dicts in the shape of the protocol's JSON (the REST
answer as is; the gRPC servicer parses them into its protobuf messages with
``google.protobuf.json_format``), or numpy arrays. Domain errors (``itif.errors``) leave as they
are; each protocol maps them in one place (``itif.server.errors``).

Every tenant is a "model" named by its tenant id, with one version, ``"1"``; a tenant sees only
its own model (another tenant's answers exactly like an unknown one). See ``itif.server.kserve``
for the tensors and outputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, Collection, Mapping, Sequence

import numpy as np

import itif
from itif import daemon_tiers
from itif.daemon import Daemon, Identity, State, TenantView
from itif.errors import (
    InvalidRequest,
    InvalidWeights,
    NoWeights,
    TenantNotFound,
    Unavailable,
    shown,
)
from itif.metrics import TenantCallStats
from itif.runtime.engine import OUTPUTS, Request, Result
from itif.server.infer_calls import await_tickets, convert_inputs

VERSION = "1"
PLATFORM = "itif"
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "binary_tensor_data",
              "parameters")
TEXT = "TEXT"
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", TEXT)
STATE = {State.READY: "READY", State.LOADING: "LOADING", State.NO_WEIGHTS: "UNAVAILABLE",
         State.FAILED: "UNAVAILABLE"}
PADDING_NOTE = ("last_hidden_state rows are zero-padded to the longest row of the call; a row's "
                "own length is its attention_mask sum (or its token count)")
_SEQUENCE_PARAMS = ("sequence_id", "sequence_start", "sequence_end")

# ---- parameters -------------------------------------------------------------------------------
#: The types the protocol gives the parameters itif reads (KServe v2 with Triton's extensions:
#: schedule policy, sequence, binary tensor data, classification), as the messages name them.
UINT64 = "a non-negative integer"
BOOL = "a boolean"
SEQUENCE_ID = "a non-negative integer or a string"
#: A call's parameters: ``timeout`` in microseconds (0: none), ``priority`` (type-checked, not
#: used: itif orders a tenant's calls by arrival), the sequence extension's (refused unless
#: they ask for no sequence: itif models are not sequence models).
REQUEST_PARAMS = {"timeout": UINT64, "priority": UINT64, "sequence_id": SEQUENCE_ID,
                  "sequence_start": BOOL, "sequence_end": BOOL}
#: An output's: ``classification`` (the number of classes; refused: not supported).
OUTPUT_PARAMS = {"classification": UINT64}


def _of_kind(value: Any, kind: str) -> bool:
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == SEQUENCE_ID and isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def check_params(params: Mapping[str, Any], kinds: Mapping[str, str], where: str) -> None:
    """Refuse (INVALID_ARGUMENT) a parameter of ``kinds`` whose value is not of its type,
    naming it and the type (before: a ``timeout`` given as a string was ignored, and the call
    ran without one). Parameters itif does not read are left alone (the parameters extension:
    a client's own)."""
    for key, kind in kinds.items():
        if key in params and not _of_kind(params[key], kind):
            raise InvalidRequest(f"{where}: parameter {key!r} must be {kind}, got "
                                 f"{shown(params[key])}")


def _ints(name: str, a: np.ndarray, ids_shape: tuple[int, ...]) -> np.ndarray:
    if a.dtype.kind not in "iu":
        raise InvalidRequest(f"input {name!r} must be INT64 or INT32, got a float tensor")
    if a.shape != ids_shape:
        raise InvalidRequest(
            f"input {name!r} has shape {list(a.shape)}; it must match input_ids {list(ids_shape)}")
    return a.astype(np.int64, copy=False)


def mask_lengths(mask: np.ndarray) -> np.ndarray:
    """Row lengths from an attention mask that is, in every row, ones followed by zeros."""
    ones = mask != 0
    lengths = ones.sum(axis=1)
    expected = np.arange(mask.shape[1])[None, :] < lengths[:, None]
    wrong = (ones != expected).any(axis=1) | ~np.isin(mask, (0, 1)).all(axis=1)
    if wrong.any():
        raise InvalidRequest(
            f"attention_mask row {int(np.flatnonzero(wrong)[0])} is not a run of ones followed "
            "by zeros: itif takes unpadded rows, so a mask may only mark right padding")
    if (lengths == 0).any():
        raise InvalidRequest(
            f"attention_mask row {int(np.flatnonzero(lengths == 0)[0])} has no tokens")
    return lengths


def gather(results: Sequence[Result], outs: Sequence[str] | None) -> list[tuple[str, np.ndarray]]:
    """The call's output tensors (FP32, batch first): ``last_hidden_state`` rows zero-padded to
    the longest row. ``outs`` None: the outputs the engine chose (the same for every row)."""
    if outs is None:
        outs = tuple(results[0].as_dict())
    tensors = []
    for o in outs:
        got = [getattr(r, o) for r in results]
        if any(v is None for v in got) or len({v.shape[1:] if o == "last_hidden_state"
                                               else v.shape for v in got}) > 1:
            # rows of one call can run in several batches, and the tenant's weights (its
            # head) were replaced between them: no one tensor holds both answers
            raise Unavailable(f"output {o!r}: the model's weights were replaced while this "
                              "call's rows ran, and they were answered by both: send it again")
        if o == "last_hidden_state":
            rows = [r.last_hidden_state for r in results]
            longest = max(len(r) for r in rows)
            a = np.zeros((len(rows), longest, rows[0].shape[-1]), np.float32)
            for i, r in enumerate(rows):
                a[i, : len(r)] = r
        else:
            a = np.stack([getattr(r, o) for r in results])
        tensors.append((o, np.ascontiguousarray(a, dtype="<f4")))
    return tensors


def _stat(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


# ---- the protocol -------------------------------------------------------------------------------
class KServeCore:
    def __init__(self, daemon: Daemon, health=None) -> None:
        self.daemon = daemon
        self.health = health  # HealthService: its shutting_down turns server readiness false

    # -- callers and models --------------------------------------------------------------------
    def who(self, authorization: str | None) -> Identity:
        if not self.daemon.ready:
            raise Unavailable("the daemon is starting or shutting down")
        return self.daemon.identify(authorization)

    def model(self, who: Identity, name: str, version: str = "") -> TenantView:
        view = self.daemon.get_tenant(who, name)  # unknown and invisible answer alike
        if version not in ("", VERSION):
            raise TenantNotFound(f"model {name!r} has no version {version!r} (only {VERSION!r})")
        return view

    def loaded(self, who: Identity, name: str, version: str = ""):
        view = self.model(who, name, version)
        if view.state is not State.READY:
            why = f": {view.error}" if view.error else ""
            raise NoWeights(f"model {name!r} is not loaded ({view.state.name}){why}; load it with "
                            "load_model(name, files={'file:model.safetensors': ...})")
        return view, daemon_tiers.tenant_info(self.daemon, name)

    def signature(self, info):
        """(inputs, outputs): (name, datatype, dims without the batch dimension[, optional])."""
        spec = self.daemon.engine.spec
        if spec.is_text:
            tok = self.daemon.engine.tokenizer is not None
            inputs = [("input_ids", "INT64", [-1], tok), ("attention_mask", "INT64", [-1], True),
                      ("token_type_ids", "INT64", [-1], True)]
            if tok:
                inputs.append((TEXT, "BYTES", [1], True))
            seq = -1
        else:
            inputs = [("pixel_values", "FP32",
                       [spec.num_channels, spec.image_size, spec.image_size], False)]
            seq = spec.num_patches + 1
        outputs = []
        if info.num_labels:
            outputs.append(("logits", "FP32", [info.num_labels]))
        if info.has_pooler:
            outputs.append(("pooled", "FP32", [spec.hidden]))
        outputs.append(("last_hidden_state", "FP32", [seq, spec.hidden]))
        return inputs, outputs

    def max_batch(self, name: str) -> int:
        d = self.daemon
        try:
            queue = d.config.tenant(name).max_queue
        except Exception:  # removed concurrently
            queue = 1
        return max(1, min(d.config.scheduler.max_batch_size, queue or 1))

    # -- server --------------------------------------------------------------------------------
    def server_ready(self) -> bool:
        down = self.health is not None and self.health.shutting_down
        return self.daemon.ready and not down

    def server_metadata(self, authorization: str | None) -> dict:
        self.daemon.identify(authorization)
        return {"name": "itif", "version": itif.__version__, "extensions": list(EXTENSIONS)}

    # -- models --------------------------------------------------------------------------------
    def model_ready(self, who: Identity, name: str, version: str = "") -> bool:
        try:
            view = self.model(who, name, version)
        except TenantNotFound:
            return False
        return self.daemon.ready and view.state is State.READY

    def model_metadata(self, who: Identity, name: str, version: str = "") -> dict:
        _, info = self.loaded(who, name, version)
        inputs, outputs = self.signature(info)
        return {"name": name, "versions": [VERSION], "platform": PLATFORM,
                "inputs": [{"name": n, "datatype": dt, "shape": [-1, *dims]}
                           for n, dt, dims, _ in inputs],
                "outputs": [{"name": n, "datatype": dt, "shape": [-1, *dims]}
                            for n, dt, dims in outputs]}

    def model_config(self, who: Identity, name: str, version: str = "") -> dict:
        """Triton's model configuration, as its JSON (the protobuf's field names)."""
        view, info = self.loaded(who, name, version)
        inputs, outputs = self.signature(info)
        types = {"INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}
        d = self.daemon
        params = {
            "backbone": d.engine.spec.name,
            "weights_sha256": view.sha256,
            "last_hidden_state": PADDING_NOTE,
            "attention_mask": "optional; every row must be ones then zeros (right padding)",
        }
        return {
            "name": name, "platform": PLATFORM, "backend": PLATFORM,
            "max_batch_size": self.max_batch(name),
            "version_policy": {"latest": {"num_versions": 1}},
            "input": [{"name": n, "data_type": types[dt], "dims": dims, "optional": opt}
                      for n, dt, dims, opt in inputs],
            "output": [{"name": n, "data_type": types[dt], "dims": dims}
                       for n, dt, dims in outputs],
            "dynamic_batching": {
                "max_queue_delay_microseconds": int(d.config.scheduler.max_wait_ms * 1000)},
            "parameters": {k: {"string_value": v} for k, v in params.items()},
        }

    def statistics(self, who: Identity, name: str = "", version: str = "") -> dict:
        d = self.daemon
        if name:
            names = [self.model(who, name, version).id]
        else:
            names = [v.id for v in d.list_tenants(who)]
        metrics = d.metrics
        out = []
        for tenant in names:
            s = metrics.tenant_stats(tenant) if metrics is not None else TenantCallStats()
            # Triton counts compute_input, compute_infer and compute_output once per executed
            # call, and perf_analyzer aborts unless the three counts are equal. itif measures
            # one compute span (batch start to result, which includes copying the rows in and
            # the outputs out), so compute_infer carries it and the other two have the same
            # count with 0 ns: no time is reported twice.
            out.append({
                "name": tenant, "version": VERSION, "last_inference": s.last_inference_ms,
                "inference_count": s.inferences, "execution_count": s.executions,
                "inference_stats": {
                    "success": _stat(s.success, s.success_ns), "fail": _stat(s.fail, s.fail_ns),
                    "queue": _stat(s.queue, s.queue_ns),
                    "compute_input": _stat(s.compute, 0),
                    "compute_infer": _stat(s.compute, s.compute_ns),
                    "compute_output": _stat(s.compute, 0)},
            })
        return {"model_stats": out}

    # -- repository ----------------------------------------------------------------------------
    def repository_index(self, who: Identity, ready_only: bool = False) -> list[dict]:
        models = []
        for v in self.daemon.list_tenants(who):
            if ready_only and v.state is not State.READY:
                continue
            reason = v.error or ("no weights loaded" if v.state is State.NO_WEIGHTS else "")
            models.append({"name": v.id, "version": VERSION, "state": STATE[v.state],
                           "reason": reason})
        return models

    async def load(self, who: Identity, name: str, files: Mapping[str, bytes],
                   config: str | None = None) -> None:
        """Upload ``files`` (``{"file:<name>.safetensors": bytes}``) as the model's weights, through
        the very path UploadWeights takes; without files, succeed for a loaded model only."""
        if config is not None:
            try:
                json.loads(config or "{}")
            except ValueError as e:
                raise InvalidRequest(f"parameter 'config' is not JSON: {e}") from None
            # the backbone fixes the model's configuration; nothing to apply
        d = self.daemon
        if not files:
            view = self.model(who, name)
            if view.state is not State.READY:
                raise NoWeights(f"model {name!r} has no weights ({view.state.name}); send them "
                                "with files={'file:model.safetensors': <bytes>}")
            return  # already loaded: nothing to do
        self.model(who, name)  # unknown and invisible models answer NOT_FOUND first
        if len(files) != 1 or not next(iter(files)).endswith(".safetensors"):
            raise InvalidWeights(
                f"send exactly one 'file:<name>.safetensors' parameter (got {sorted(files)})")
        (data,) = files.values()
        digest = hashlib.sha256(data).hexdigest()

        def upload() -> None:  # the UploadWeights path, in one worker thread
            up = d.begin_upload(who, name, digest, len(data))
            try:
                up.write(data)
                d.finish_upload(name, up, who)  # a tenant's upload: charged as UploadWeights
            finally:
                up.abort()  # no-op after a commit; removes the temp file on any failure

        await asyncio.to_thread(upload)

    async def unload(self, who: Identity, name: str) -> None:
        await asyncio.to_thread(self.daemon.delete_weights, who, name)

    # -- inference -----------------------------------------------------------------------------
    def check_input(self, model_name: str, name: str, seen: Collection[str]) -> None:
        """Refuse an input name the backbone does not take, or one ``seen`` already."""
        allowed = TEXT_INPUTS if self.daemon.engine.spec.is_text else ("pixel_values",)
        if name not in allowed:
            raise InvalidRequest(
                f"unknown input {name!r}; model {model_name!r} takes {list(allowed)}")
        if name in seen:
            raise InvalidRequest(f"input {name!r} is given twice")

    def requests(self, model_name: str, tensors: Mapping[str, np.ndarray],
                 outputs: Sequence[str], classification: Collection[str] = (),
                 ) -> tuple[list[Request], tuple[str, ...]]:
        """The itif requests of one call (one per row) and the outputs it asked for, in order.
        ``classification``: the outputs that asked for the classification extension."""
        d = self.daemon
        spec = d.engine.spec
        for name in tensors:
            self.check_input(model_name, name, ())
        outs = []
        for o in outputs:
            if o not in OUTPUTS:
                raise InvalidRequest(f"unknown output {o!r}; choose from {list(OUTPUTS)}")
            if o in classification:
                raise InvalidRequest(f"output {o!r}: the classification extension is not "
                                     "supported; ask for logits")
            if o not in outs:
                outs.append(o)
        # None: the engine's default (logits with a head, else pooled), decided where the
        # weights are read, so it cannot depend on which tier holds them now.
        outs = tuple(outs) or None

        if not spec.is_text:
            if "pixel_values" not in tensors:
                raise InvalidRequest("input 'pixel_values' FP32 [batch, C, H, W] is required")
            pix = tensors["pixel_values"]
            if pix.dtype != np.float32 or pix.ndim != 4 or pix.size < 1:
                raise InvalidRequest(f"input 'pixel_values' must be FP32 [batch, C, H, W], got "
                                     f"{pix.dtype} {list(pix.shape)}")
            return [Request("", pixel_values=pix[i], outputs=outs) for i in range(len(pix))], outs

        if TEXT in tensors:
            extra = sorted(set(tensors) - {TEXT})
            if extra:
                raise InvalidRequest(f"input 'TEXT' cannot be combined with {extra}")
            texts = tensors[TEXT]
            if texts.dtype != object or texts.ndim not in (1, 2) or texts.size < 1 or (
                    texts.ndim == 2 and texts.shape[1] != 1):
                raise InvalidRequest(f"input 'TEXT' must be BYTES [batch] or [batch, 1], got "
                                     f"{list(texts.shape)}")
            reqs = []
            for i, b in enumerate(texts.reshape(-1)):
                try:
                    s = b.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequest(f"input 'TEXT' element {i} is not UTF-8") from None
                reqs.append(Request("", input_ids=d.tokenize(s), outputs=outs))
            return reqs, outs

        if "input_ids" not in tensors:
            raise InvalidRequest("input 'input_ids' INT64 [batch, seq] is required"
                                 + (" (or 'TEXT')" if d.engine.tokenizer is not None else ""))
        ids = tensors["input_ids"]
        if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise InvalidRequest(f"input 'input_ids' must be INT64 [batch, seq] with batch, seq "
                                 f">= 1, got {ids.dtype} {list(ids.shape)}")
        ids = ids.astype(np.int64, copy=False)
        lengths = np.full(ids.shape[0], ids.shape[1])
        if "attention_mask" in tensors:
            lengths = mask_lengths(_ints("attention_mask", tensors["attention_mask"], ids.shape))
        types = None
        if "token_type_ids" in tensors:
            types = _ints("token_type_ids", tensors["token_type_ids"], ids.shape)
        return [Request("", input_ids=ids[i, :n],
                        token_type_ids=None if types is None else types[i, :n], outputs=outs)
                for i, n in enumerate(lengths.tolist())], outs

    @staticmethod
    def deadline(params: Mapping[str, Any], remaining: float | None) -> float | None:
        """Seconds left: the transport's (a gRPC deadline) and the ``timeout`` parameter (µs),
        whichever is sooner."""
        us = params.get("timeout")
        if us:  # checked (check_params): a non-negative integer
            remaining = us / 1e6 if remaining is None else min(remaining, us / 1e6)
        return remaining

    async def infer(self, who: Identity, name: str, version: str,
                    tensors: Mapping[str, np.ndarray], outputs: Sequence[str],
                    classification: Collection[str] = (), params: Mapping[str, Any] = {},
                    remaining: float | None = None) -> list[tuple[str, np.ndarray]]:
        """Queue every row of the call at once (all-or-nothing); the output tensors."""
        self.model(who, name, version)  # unknown, invisible or wrong version: refused here
        check_params(params, REQUEST_PARAMS, "the inference request")
        for key in _SEQUENCE_PARAMS:
            if params.get(key):
                raise InvalidRequest(f"parameter {key!r}: itif models are not sequence models")
        rows = max((t.shape[0] for t in tensors.values() if t.ndim), default=0)
        reqs, outs = await convert_inputs(
            self.daemon, who, name, rows,
            lambda: self.requests(name, tensors, outputs, classification))
        results = await await_tickets(self.daemon, who, name, reqs,
                                      self.deadline(params, remaining))
        return gather(results, outs)


__all__ = ["BOOL", "EXTENSIONS", "OUTPUT_PARAMS", "PLATFORM", "REQUEST_PARAMS", "SEQUENCE_ID",
           "TEXT", "UINT64", "VERSION", "KServeCore", "check_params", "gather"]
