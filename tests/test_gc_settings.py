"""The serving process's garbage-collector settings (``itif.platform.tune_gc``): in force once
startup is done, off with ``ITIF_GC=default``, and what they change in a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import gc, json
from itif.platform import GC_THRESHOLD0, tune_gc
before = gc.get_threshold()
on = tune_gc()
again = tune_gc()  # once a process: a second call changes nothing
print(json.dumps({"on": on, "again": again, "before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "threshold0": GC_THRESHOLD0}))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, **env})
    return json.loads(out.stdout)


def test_tune_gc_freezes_startup_and_collects_the_youngest_generation_less_often():
    r = _probe(ITIF_GC="")
    assert r["on"] is True and r["again"] is True
    assert r["before"][0] == 700  # Python's default, for the record of what changed
    assert r["after"] == [r["threshold0"], r["before"][1], r["before"][2]]
    assert r["threshold0"] > 700
    assert r["frozen"] > 10_000  # the interpreter's and torch's startup objects


def test_itif_gc_default_leaves_the_collector_as_it_is():
    r = _probe(ITIF_GC="default")
    assert r["on"] is False and r["again"] is False
    assert r["after"] == r["before"] and r["frozen"] == 0
