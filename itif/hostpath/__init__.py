"""The engine side of the columnar host path (issue #61, item 2).

Front-end processes do every per-call cost (protocols, auth, validation, tokenizing) and hand
the engine process batches of requests as numpy columns through shared memory; the engine
process queues, schedules and runs them without a Python object a request, and answers the
same way::

    front end (N processes)                      engine process (one)
    calls -> rows -> Arrivals.pack_into(slot) ==> Ring ==> Arrivals.unpack(slot)  (views)
                       one byte a batch  -------->        ColumnQueue.push   (limits, refusals)
                                                          ColumnQueue.take   (fair, deadlines)
                                                          Engine.infer_columns (one forward)
    replies <- Results.unpack(slot) <========== Ring <== Results.pack_into(slot)

Modules: ``columns`` (the two batch formats, one bytes buffer each), ``ring`` (a
single-producer single-consumer ring of buffers in ``multiprocessing.shared_memory``, one
notification a batch, back pressure when full), ``colqueue`` (per-tenant queues and start-time
fair queueing in tokens on numpy arrays). ``Engine.infer_columns``
(``itif.runtime.engine_columns``) runs a taken batch. Nothing here imports torch or the engine.
The wiring into the daemon and the ingress processes is the next step (docs/architecture.md,
"Host path, next: columns").
"""

from itif.hostpath.columns import STATUS, Arrivals, Results, status_code

__all__ = ["STATUS", "Arrivals", "Results", "status_code"]
