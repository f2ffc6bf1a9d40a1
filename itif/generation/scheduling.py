"""The running batch's side of the generation loop (``GenEngine``'s step, split from
``itif.generation.engine``): preempting requests when the KV pool is full, the decode of the
running rows (apart, when it fails together), joining requests into the search and the batch.
``StepParts`` is a mixin of ``GenEngine``: its methods use the engine's state (``_running``,
``_sinks``, ``_resume``, ``_cv``, ``_fail``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from itif.errors import Busy, ItifError, is_out_of_memory
from itif.generation.gen_tickets import GenTicket
from itif.generation.running import RunningBatch

log = logging.getLogger("itif.generation")


class StepParts:
    def _preempt(self, batch: RunningBatch, sb: Any) -> None:
        """Preempt running requests, the one that joined last first (as vLLM's scheduler),
        until the blocks the running rows take at the next decode are free: a victim's rows
        leave the search (their state kept: ``SearchBatch.preempt``) and the batch (its
        blocks freed), and it waits at the front of the queue to be resumed by recomputing
        each row's history (``JoiningRequest.histories``). A request alone always fits (``_prepare``
        refuses one whose full length exceeds the pool), so preemption ends."""
        while batch.grow_need() > batch.pool.free_blocks and batch.requests > 1:
            key = batch.newest()
            state, keep = sb.preempt(key)
            if not torch.equal(keep.to(self.device), batch.remove([key]).to(self.device)):
                raise ItifError("search and cache disagree on the surviving rows")
            t = self._running.pop(key)
            n = len(state.histories[0])
            t.admission = replace(t.admission, histories=state.histories)
            t.resume = state
            self.preemptions += 1
            log.info("generation request %s (tenant %s) preempted after %d positions: the KV "
                     "cache is full", key, t.request.tenant, n)
            with self._cv:
                self._resume.appendleft(t)  # the earlier joiner resumes first

    def _decode(self, batch: RunningBatch, sb: Any) -> torch.Tensor:
        """The running rows' decode forward; their logits. If it fails for all of them together
        (out of memory, most often), the requests run again in halves, halves again
        (``RunningBatch.decode_apart``), so only a request that fails alone fails; it leaves the
        batch and the search, and the others go on. Rows of requests joining this step are in
        the search only, after the running ones: removing running rows leaves them in place."""
        try:
            return batch.decode()
        except Exception as e:  # noqa: BLE001 - the running requests must not all end with it
            if batch.requests == 1:
                failed = {next(iter(batch.ids)): e}
                logits = None
            else:
                log.warning("the decode step of %d generation requests failed (%s); they run "
                            "again in halves", batch.requests, type(e).__name__)
                logits, failed = batch.decode_apart()
        if not failed:
            return logits
        keys = list(failed)
        sb.remove(keys)
        keep = batch.remove(keys)
        for k, e in failed.items():
            t = self._running.pop(k)
            log.warning("generation request %s (tenant %s) failed in its decode step: %r", k,
                        t.request.tenant, e)
            self._fail([t], error_for(e, "the device ran out of memory running this generation's "
                                      "next token: retry, or ask for fewer rows or tokens",
                                   "generation failed"))
        if logits is None:
            return keep.new_empty(0, 0, dtype=batch.dtype)
        return logits.index_select(0, keep)

    def _admit(self, batch: RunningBatch, sb: Any, joins: list[GenTicket],
               parts: list[torch.Tensor]) -> list[GenTicket]:
        """Admit ``joins`` (their prompts run, their first logits appended to ``parts``); the
        ones admitted. If their prompts fail together (out of memory, most often: one long
        prompt), each runs again alone, in order, so only those that still fail fail; a failed
        admission leaves the batch as it was (``RunningBatch.admit``), and the running rows go
        on."""
        try:
            parts.append(batch.admit([t.admission for t in joins]))
            return joins
        except Exception as e:  # noqa: BLE001 - the running rows must not end with them
            if len(joins) == 1:
                self._refuse_join(sb, joins[0], e)
                return []
            log.warning("%d generation requests failed to start together (%s); each again alone",
                        len(joins), type(e).__name__)
        admitted = []
        for t in joins:  # in join order: the search holds their rows in this order
            try:
                parts.append(batch.admit([t.admission]))
                admitted.append(t)
            except Exception as e:  # noqa: BLE001
                self._refuse_join(sb, t, e)
        return admitted

    def _refuse_join(self, sb: Any, t: GenTicket, e: Exception) -> None:
        """Fail a request whose prompt could not run: out of the search and the running set."""
        log.warning("generation request %s (tenant %s) could not start: %r", t.id,
                    t.request.tenant, e)
        sb.remove([t.id])
        del self._running[t.id]
        self._fail([t], error_for(e, "the device ran out of memory running this generation's "
                                  "prompt: retry, or send a shorter prompt or fewer rows",
                               "generation could not start"))

    def _join_search(self, sb: Any, t: GenTicket) -> bool:
        """Add ``t``'s rows to the search (before the cache admits it: the rows of both stay in
        the same order). A request the search refuses fails alone; the others go on."""
        try:
            if t.resume is not None:  # preempted: its search state back as it was
                sb.resume(t.id, t.resume)
                t.resume = None
            else:
                sb.add(t.id, t.params, t.history)
            if t.stream:  # its tokens handed out at each step (``itif.generation.streams``)
                sb.stream(t.id, t.id, self._sinks.slot(t.sink))
        except Exception as e:  # noqa: BLE001 - one request's parameters must not end the others'
            log.warning("generation request %s refused by the search: %r", t.id, e)
            del self._running[t.id]
            self._fail([t], e if isinstance(e, ItifError)
                       else ItifError(f"generation could not start: {e!r}"))
            return False
        return True


def error_for(e: Exception, out_of_memory: str, failed: str) -> ItifError:
    """What a request that failed with ``e`` is told: ``e`` itself if it is an ItifError,
    Busy (RESOURCE_EXHAUSTED, retry later) with ``out_of_memory`` for the device's out-of-memory
    error,
    else ``failed`` and the exception's type (its text may name another request's data)."""
    if isinstance(e, ItifError):
        return e
    err = Busy(out_of_memory) if is_out_of_memory(e) else ItifError(f"{failed}: {type(e).__name__}")
    err.__cause__ = e
    return err


__all__ = ["StepParts", "error_for"]
