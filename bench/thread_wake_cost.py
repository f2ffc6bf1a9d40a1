"""What a thread waking from a timer costs in CPU: the column path's reader thread
(``itif.server.column_door``) wakes every ``READ_GAP_S`` during forwards, so its looks cost at
least this each.

    python bench/thread_wake_cost.py [--gap-ms 15] [--seconds 3] [--out OUT.json]

A thread loops on ``Event.wait(gap)`` for ``--seconds``, once while the main thread sleeps and
once while it runs small torch ops on one thread (as a forward does: each op releases the GIL,
so the woken thread takes it between two ops); reported: the waking thread's CPU
(``time.thread_time``) a wake-up. Linux or macOS; needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch


def wake_cost(gap_s: float, seconds: float, busy: bool) -> dict:
    stop = threading.Event()
    got: dict = {}

    def waker() -> None:
        n, cpu = 0, time.thread_time()
        while not stop.is_set():
            stop.wait(gap_s)
            n += 1
        got["wakes"], got["cpu_s"] = n, time.thread_time() - cpu

    th = threading.Thread(target=waker, name="waker")
    th.start()
    end = time.monotonic() + seconds
    if busy:
        a, w = torch.randn(64, 128), torch.randn(128, 128)
        while time.monotonic() < end:
            torch.nn.functional.gelu(a @ w)
    else:
        time.sleep(seconds)
    stop.set()
    th.join()
    return {"main_thread": "torch ops" if busy else "asleep", "wakes": got["wakes"],
            "cpu_us_per_wake": round(got["cpu_s"] / got["wakes"] * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-ms", type=float, default=15.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=str)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [wake_cost(args.gap_ms / 1000.0, args.seconds, busy) for busy in (False, True)]
    for r in rows:
        print(f"main thread {r['main_thread']}: {r['wakes']} wake-ups, "
              f"{r['cpu_us_per_wake']} us of CPU each")
    doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
                    "cpu_count": os.cpu_count(), "gap_ms": args.gap_ms}, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
