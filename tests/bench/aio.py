# SPDX-License-Identifier: MIT OR Apache-2.0
"""`make bench`, figure 12py (issue 36 item 3, Python): 1,000 job handles
awaited with ``asyncio.gather`` against 1,000 blocking ``wait()`` calls of
the same kind of jobs, interleaved round by round, in ns per job. Prints
``BENCH {json}`` lines like tests/guest/src/bin/bench.rs.

Each job copies 4 KiB in 17 pieces: the software device runs a job of at
most 16 descriptors inside SUBMIT when it is idle, and then there would be
nothing to await. Usage: python3 aio.py [/dev/tdrvN]
"""

import asyncio
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
import tdrv
from selfpipe import pipe_pair, socketpair_works

JOBS = 1000
PIECES = 17
WARM = 1
ROUNDS = 7


def emit(fig, case, method, unit, samples, extra):
    v = sorted(samples)
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    rec = {"fig": fig, "case": case, "method": method, "unit": unit,
           "n": len(v), "median": statistics.median(v), "p25": q[0], "p75": q[2],
           "min": v[0], "max": v[-1], "p99": v[-1]}
    rec.update(extra)
    print("BENCH " + json.dumps(rec), flush=True)


def job(src, dst):
    j = tdrv.Job()
    step = 4096 // PIECES
    for i in range(PIECES):
        off = i * step
        size = 4096 - off if i + 1 == PIECES else step
        j.copy(src, dst, src_offset=off, dst_offset=off, size=size)
    return j


def self_pipe_without_af_unix():
    """asyncio's loop wakes itself through socket.socketpair(), which needs
    AF_UNIX; the bench kernel, like the test kernel, has no networking.
    There a pipe stands in for it (selfpipe.py, shipped next to this file
    from python/tests)."""
    if not socketpair_works():
        socket.socketpair = pipe_pair


def threads():
    return len(os.listdir("/proc/self/task"))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/dev/tdrv0"
    self_pipe_without_af_unix()
    dev = tdrv.Device(path)
    src = tdrv.from_buffer(np.arange(4096, dtype=np.uint8) % 251, device=dev)
    dst = dev.empty(4096, "uint8")
    before = threads()
    during = [before]

    def blocking():
        hs = [job(src, dst).submit() for _ in range(JOBS)]
        for h in hs:
            h.wait()

    async def gathered():
        hs = [job(src, dst).submit() for _ in range(JOBS)]
        fut = asyncio.gather(*hs)
        await asyncio.sleep(0)
        during[0] = max(during[0], threads())
        await fut

    loop = asyncio.new_event_loop()
    cases = [("blocking_wait", blocking),
             ("asyncio_gather", lambda: loop.run_until_complete(gathered()))]
    samples = {name: [] for name, _ in cases}
    for r in range(WARM + ROUNDS):
        for name, f in cases:
            t = time.perf_counter_ns()
            f()
            ns = (time.perf_counter_ns() - t) / JOBS
            if r >= WARM:
                samples[name].append(ns)
    loop.close()
    print("BENCH " + json.dumps({"fig": "env", "device": path, "device_kind": dev.kind,
                                 "python": sys.version.split()[0]}), flush=True)
    for name, _ in cases:
        emit("12py", dev.kind, name, "ns", samples[name],
             {"jobs": JOBS, "threads_before": before, "threads_during": during[0]})


if __name__ == "__main__":
    main()
