"""Shared pieces of the reliability suite (tests/test_reliability_*.py).

Every test drives a REAL ``itif serve`` subprocess on loopback (``tests.daemon_harness.Daemon``,
re-exported here), and records what it tried in a ``Tally`` (``rel`` fixture): inputs sent,
faults injected, unexpected outcomes. With
``ITIF_RELIABILITY_REPORT=<file>`` each test appends one JSON line to that file at teardown;
``python -m itif.bench.reliability_doc --run`` records a run under bench/results/ and generates
the recorded-run section of docs/reliability.md from it.

Test hooks reach the daemon only through the environment variable ``ITIF_FAULT_INJECT``
(itif/faults.py): ``oom:<tenant>``, ``slow:<ms>``, ``start_delay:<ms>``, ``kill_at:<point>``...
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc
import pytest

from itif.client import Client
from itif.safetensors_io import save_safetensors
from itif.server._proto.itif.v1 import itif_pb2
from tests.daemon_harness import ADMIN, ROOT, TLS, Daemon, free_port

# The harness (tests/daemon_harness.py: ADMIN ... free_port) is re-exported for the suite.
__all__ = [
    "ADMIN", "ROOT", "TLS", "Daemon", "free_port",
    "OK", "REPORT_ENV", "SUSTAIN_ENV", "Tally", "code_of", "error_of", "flood_main", "infer_sha",
    "make_tokens", "metric", "promise", "rel", "scrape", "sha256", "state_dict",
    "sustain_seconds", "upload_bytes", "upload_messages", "wait_until", "weights_bytes",
    "weights_file",
]

REPORT_ENV = "ITIF_RELIABILITY_REPORT"
SUSTAIN_ENV = "ITIF_RELIABILITY_SUSTAIN_S"
OK = grpc.StatusCode.OK


# ---- bookkeeping ----------------------------------------------------------------------------
def promise(*numbers: int):
    """Mark a test with the reliability.md promise numbers it demonstrates."""

    def mark(fn):
        fn.reliability_promises = numbers
        return fn

    return mark


@dataclass
class Tally:
    """What one test did: ``inputs`` sent, ``faults`` injected, ``failures`` (unexpected
    outcomes; a passing test ends with 0), and free-form ``notes`` (measurements)."""

    inputs: int = 0
    faults: int = 0
    failures: int = 0
    notes: dict = field(default_factory=dict)
    codes: Counter = field(default_factory=Counter)

    def saw(self, code: grpc.StatusCode, n: int = 1) -> None:
        self.codes[code.name] += n


@pytest.fixture
def rel(request) -> Iterator[Tally]:
    tally = Tally()
    start = time.monotonic()
    yield tally
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    rep = getattr(request.node, "rep_call", None)
    record = {
        "test": request.node.nodeid,
        "promises": list(getattr(request.function, "reliability_promises", ())),
        "doc": (request.function.__doc__ or "").strip().split("\n")[0],
        "passed": bool(rep is not None and rep.passed),
        "inputs": tally.inputs,
        "faults": tally.faults,
        "failures": tally.failures + (0 if rep is not None and rep.passed else 1),
        "codes": dict(tally.codes),
        "notes": tally.notes,
        "seconds": round(time.monotonic() - start, 2),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ---- gRPC helpers ---------------------------------------------------------------------------
def code_of(fn: Callable[[], object]) -> grpc.StatusCode:
    """The status code a call ends with (OK when it returns)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    except grpc.FutureCancelledError:  # the result of a call this client cancelled
        return grpc.StatusCode.CANCELLED
    return OK


def error_of(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return OK, ""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload_messages(tenant: str, data: bytes, *, sha: str | None = None,
                    size: int | None = None, chunk: int = 64 * 1024,
                    pace_s: float = 0.0) -> Iterator[itif_pb2.UploadWeightsRequest]:
    """An UploadWeights stream: the header (its sha/size may lie), then the chunks."""
    yield itif_pb2.UploadWeightsRequest(header=itif_pb2.UploadHeader(
        tenant=tenant, sha256=sha256(data) if sha is None else sha,
        total_size=len(data) if size is None else size))
    for i in range(0, len(data), chunk):
        if pace_s:
            time.sleep(pace_s)
        yield itif_pb2.UploadWeightsRequest(chunk=data[i:i + chunk])


def upload_bytes(c: Client, tenant: str, data: bytes, timeout: float = 60, **kw):
    return c.stub.UploadWeights(upload_messages(tenant, data, **kw), metadata=c.metadata,
                                timeout=timeout)


def infer_sha(c: Client, tenant: str, ids, timeout: float = 30) -> tuple[bytes, str]:
    """(logits bytes, weights_sha256 that produced them)."""
    resp = c.stub.Infer(itif_pb2.InferRequest(tenant=tenant, input=c.make_input(ids)),
                        metadata=c.metadata, timeout=timeout)
    return resp.outputs[0].data, resp.weights_sha256


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, step: float = 0.02,
               what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


# ---- weights --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def state_dict(seed: int, num_labels: int = 2, preset: str = "bert-tiny") -> dict:
    """HF-named tensors of a random fine-tune (cached; tensors are shared, copy to modify)."""
    from tests.oracle import make_hf_model  # noqa: PLC0415 - imports transformers

    m = make_hf_model(preset, num_labels, seed=seed)
    return {k: v.detach().contiguous().clone() for k, v in m.state_dict().items()}


@functools.lru_cache(maxsize=None)
def weights_bytes(seed: int, num_labels: int = 2) -> bytes:
    """A valid safetensors file for bert-tiny (distinct per seed)."""
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "w.safetensors"
        save_safetensors(state_dict(seed, num_labels), p)
        return p.read_bytes()


def weights_file(dirpath: Path, seed: int, num_labels: int = 2) -> Path:
    p = dirpath / f"w{seed}-{num_labels}.safetensors"
    if not p.exists():
        p.write_bytes(weights_bytes(seed, num_labels))
    return p


def make_tokens(names: Iterable[str]) -> dict[str, str]:
    return {n: f"{n}-token-{hashlib.sha256(n.encode()).hexdigest()[:12]}" for n in names}


def sustain_seconds(default: float = 60.0) -> float:
    """Length of the sustained mixed run: ``ITIF_RELIABILITY_SUSTAIN_S`` (seconds)."""
    return float(os.environ.get(SUSTAIN_ENV, default))


# ---- a load generator in its own process ------------------------------------------------------
def flood_main() -> None:
    """``python -c 'from tests.reliability_util import flood_main; flood_main()' ADDR TOKEN
    TENANT RATE DIR [invalid]``: send Infer calls of TENANT at RATE per second (open loop: one
    call started every 1/RATE s, whatever the answers) while ``DIR/on`` exists; write the
    cumulative counts by status code to ``DIR/counts.json`` twice a second. Runs until killed.
    With ``invalid``, every call carries an out-of-vocabulary id: the daemon does all the work
    of a call up to the queue (auth, parsing, validation) and refuses it there
    (INVALID_ARGUMENT): the same load on the daemon's CPU, without using the queue.

    A separate process, so that the flood's client work never competes for the GIL of the
    process that measures the quiet tenant's latency."""
    addr, token, tenant, rate, folder = sys.argv[1:6]
    from itif.server._proto.itif.v1 import itif_pb2 as pb  # noqa: PLC0415

    folder_p = Path(folder)
    ids = list(range(1, 17))
    if sys.argv[6:7] == ["invalid"]:
        ids[-1] = 10**6
    raw = pb.InferRequest(tenant=tenant, input=pb.InferInput(
        input_ids=pb.TokenIds(ids=ids))).SerializeToString()
    channel = grpc.insecure_channel(addr)
    call = channel.unary_unary("/itif.v1.Itif/Infer")
    md = (("authorization", f"Bearer {token}"),)
    counts: Counter = Counter()
    lock = threading.Lock()
    period = 1.0 / float(rate)

    def done(fut) -> None:
        try:
            fut.result()
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            counts[code] += 1

    next_at = last_dump = time.monotonic()
    while True:
        now = time.monotonic()
        if now - last_dump >= 0.5:
            tmp = folder_p / "counts.tmp"
            with lock:
                tmp.write_text(json.dumps(dict(counts)))
            os.replace(tmp, folder_p / "counts.json")
            last_dump = now
        if not (folder_p / "on").exists():
            time.sleep(0.01)
            next_at = time.monotonic()
            continue
        if now < next_at:
            time.sleep(min(next_at - now, 0.01))
            continue
        next_at += period
        with lock:
            counts["sent"] += 1
        call.future(raw, metadata=md, timeout=30).add_done_callback(done)


# ---- Prometheus -------------------------------------------------------------------------------
def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """The daemon's /metrics as {(sample name, labels): value}."""
    from itif.bench.daemon_probe import scrape_metrics  # noqa: PLC0415

    return scrape_metrics(port)


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)
