"""Large JSON bodies parsed, and large JSON answers written, in worker processes.

The HTTP routes run on the daemon's event loop, the one that also serves gRPC and hands work to
the forward. Python's ``json`` holds the GIL for a whole parse or dump, so a worker *thread*
does not help: a KServe request carrying one 224x224 image as JSON numbers (3 MB) is about 75
ms of ``json.loads`` on a 2-core EPYC, and one ViT ``last_hidden_state`` written back as JSON
about 110 ms, during which every other tenant's call waits. With ``server.http_json_processes``
(default 2) a body over :data:`OFFLOAD_BYTES` is parsed in one of that many processes and comes
back as Python objects, each KServe input's ``data`` already turned into its numpy tensor
(:func:`load_infer`, :class:`Decoded`), an OpenAI embeddings ``input`` of token-id lists
already one int64 array (:func:`load_embeddings`, :class:`TokenLists`); an answer of more than
:data:`ANSWER_NUMBERS` numbers is written there (:func:`json_bytes`). What crosses back is a
pickle whose arrays are one copy each, so the daemon's share is a small fraction of the parse.
``bench/http_json_stall.py`` measures what the loop feels.

A daemon embedded in a script of one's own: the workers start with ``spawn``, which imports
the script again, so it must keep its start under ``if __name__ == "__main__":`` (``itif
serve``, ``python -m itif`` and Ray Serve's replicas do).

Nothing a client sees changes: the same checks run in the same order, with the same messages (a
worker keeps a decoding error in the :class:`Decoded` it returns; the route raises it where it
would have decoded the input; token lists that any check would refuse stay as they are, for
the route to refuse). A worker that dies (killed, out of memory) breaks its pool, which is
replaced; each call the pool held runs again in a process of its own, so only a call that
kills that one too fails, with UNAVAILABLE (503); a result that cannot come back (a
pickling error) is computed in a thread of the daemon instead. 0 processes: a thread, as before.

This module imports only the standard library, numpy and ``itif.server.tensors``: a worker
starts (``spawn``) without torch or the HTTP stack.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import multiprocessing
import pickle
import signal
import threading
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import numpy as np

from itif.errors import InvalidRequest, Unavailable
from itif.server.tensors import decode_values

log = logging.getLogger("itif.server.json_procs")

#: Bodies larger than this are parsed off the event loop (about 6 ms of ``json.loads``).
OFFLOAD_BYTES = 256 << 10
#: The longest token list or list of inputs a JSON body may carry: no backbone has this many
#: positions, no tenant queues this many requests (``max_queue`` <= 1,000,000). Checked before
#: the per-element checks, which run on the event loop that also serves gRPC.
MAX_LIST = 1 << 20
#: Answers with more JSON numbers than this are written off the event loop: a float32 value
#: written as a Python float takes about 0.7 us of ``json.dumps`` (~18 characters), 3 ms here.
ANSWER_NUMBERS = 4096


# ---- what a worker runs (also run in a thread: 0 processes, or a fallback) ----------------------
def json_load(data: bytes, what: str = "the request body") -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"{what} is not valid JSON: {str(e)[:200]}") from None


class Decoded:
    """A KServe input's JSON ``data`` after :func:`load_infer`: its tensor, or the message of
    the error decoding it raised (raised again by :meth:`tensor`, where the route reads it)."""

    __slots__ = ("array", "error")

    def __init__(self, array: np.ndarray | None, error: str | None = None) -> None:
        self.array, self.error = array, error

    def tensor(self) -> np.ndarray:
        if self.error is not None:
            raise InvalidRequest(self.error)
        return self.array


def load_infer(data: bytes, what: str) -> Any:
    """A KServe inference request: :func:`json_load`, then each input whose ``data`` the route
    would decode turned into a :class:`Decoded` (by ``decode_values``, as the route calls it).
    Inputs the route refuses before it reads their data (no string name or datatype, a shape
    that is not a list of integers) keep it as it is."""
    obj = json_load(data, what)
    inputs = obj.get("inputs") if isinstance(obj, dict) else None
    for t in inputs if isinstance(inputs, list) else ():
        if not isinstance(t, dict) or "data" not in t:
            continue
        name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
        if not (isinstance(name, str) and isinstance(datatype, str) and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            continue
        values = t["data"] if isinstance(t["data"], list) else [t["data"]]
        try:
            t["data"] = Decoded(decode_values(name, datatype, shape, values))
        except InvalidRequest as e:
            t["data"] = Decoded(None, str(e))
    return obj


class TokenLists:
    """An OpenAI embeddings ``input`` of token-id lists (or one list) after
    :func:`load_embeddings`: every id of every list, one int64 array, and where each list ends."""

    __slots__ = ("flat", "ends")

    def __init__(self, flat: np.ndarray, ends: np.ndarray) -> None:
        self.flat, self.ends = flat, ends

    def arrays(self) -> list[np.ndarray]:
        return np.split(self.flat, self.ends[:-1])


def _id_rows(value: Any) -> list[list] | None:
    """``value``'s token-id lists when it is an ``input`` the embeddings route takes as it is
    (one list of ids, or a list of such lists; each non-empty, none over :data:`MAX_LIST`,
    every id an integer in [0, 2**63)); None for anything else, which the route checks."""
    if not isinstance(value, list) or not value or len(value) > MAX_LIST:
        return None
    rows = value if all(type(v) is list for v in value) else [value]
    for r in rows:
        if not 0 < len(r) <= MAX_LIST or not all(type(v) is int for v in r):
            return None
        if min(r) < 0 or max(r) >= 2**63:
            return None
    return rows


def load_embeddings(data: bytes, what: str) -> Any:
    """An OpenAI embeddings request: :func:`json_load`, then an ``input`` of valid token-id
    lists turned into :class:`TokenLists` (one array crosses back, not a Python int per id)."""
    obj = json_load(data, what)
    rows = _id_rows(obj.get("input")) if isinstance(obj, dict) else None
    if rows is not None:
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(lengths.sum()))
        obj["input"] = TokenLists(flat, np.cumsum(lengths))
    return obj


def model_of(body: bytes) -> str | None:
    """The ``model`` string of an OpenAI request body; None for anything else (the replica that
    gets the request answers a malformed one). What Ray Serve's router needs of a body."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.ravel().tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def json_bytes(obj: Any, allow_nan: bool = True) -> bytes:
    """``obj`` as compact JSON; numpy arrays become flat lists of their values (row-major).
    ASCII, so that a string a client sent (a request id with a lone surrogate) cannot fail it."""
    return json.dumps(obj, allow_nan=allow_nan, separators=(",", ":"), default=_plain).encode()


def _worker_start() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when its workers stop


# ---- the daemon's side ---------------------------------------------------------------------------
class JsonProcs:
    """``processes`` worker processes, started (``spawn``) when first needed; 0: none, every
    call runs in a thread of this process."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._solo_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> slots

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_start)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, in a worker process when there are any."""
        if not self.processes:
            return await asyncio.to_thread(fn, *args)
        pool = self._executor()
        try:
            return await self._in(pool, fn, args)
        except BrokenProcessPool:  # every call it held fails so: each runs again alone
            self._discard(pool)
            log.warning("an HTTP JSON worker process died; its pool is replaced and the calls "
                        "it held run again, each in a process of its own")
        return await self._alone(fn, args)

    @staticmethod
    async def _in(pool: ProcessPoolExecutor, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            return await asyncio.wrap_future(pool.submit(fn, *args))
        except (RecursionError, pickle.PicklingError) as e:  # the result could not come back
            log.warning("an HTTP JSON worker could not return %s (%s: %s); run in a thread",
                        getattr(fn, "__name__", fn), type(e).__name__, str(e)[:200])
            return await asyncio.to_thread(fn, *args)

    async def _alone(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` once more, in a process of its own (as many at once per event loop as
        the pool has workers), after a worker died holding it: a call whose own work kills its
        process fails (UNAVAILABLE) without the others it shared a pool with."""
        loop = asyncio.get_running_loop()
        with self._lock:
            slots = self._solo_slots.get(loop)
            if slots is None:
                slots = self._solo_slots[loop] = asyncio.Semaphore(self.processes)
        async with slots:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
            solo = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_worker_start)
            try:
                return await self._in(solo, fn, args)
            except BrokenProcessPool:
                raise Unavailable("the process parsing this call's JSON died; try again") from None
            finally:
                solo.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Start a worker now (in the background), so the first large body does not wait for
        one to import numpy."""
        if self.processes:
            self._executor().submit(int)

    def close(self) -> None:
        """Stop the workers once what they hold is done; later calls answer UNAVAILABLE."""
        with self._lock:
            self._closed, pool, self._pool = True, self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


#: No processes: what an app built without a pool uses.
IN_THREAD = JsonProcs(0)

__all__ = ["ANSWER_NUMBERS", "IN_THREAD", "MAX_LIST", "OFFLOAD_BYTES", "Decoded", "JsonProcs",
           "TokenLists", "json_bytes", "json_load", "load_embeddings", "load_infer", "model_of"]
