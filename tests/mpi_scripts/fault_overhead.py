"""Micro-benchmark: small all-reduces through MPICollectives without and with the watchdog.

Usage: fault_overhead.py CALLS ROUNDS
Prints, on rank 0, the best per-call time (µs) of each variant over ROUNDS interleaved rounds
of CALLS all-reduces of 8 float64 values: raw mpi4py, watchdog=None, watchdog on.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from pacmpi import MPICollectives
from pacmpi.watchdog import StallWatchdog

CALLS, ROUNDS = int(sys.argv[1]), int(sys.argv[2])

comm = MPI.COMM_WORLD.Dup()
dog = StallWatchdog(warn_after=60.0, abort_after=600.0)
plain = MPICollectives(comm=comm)
watched = MPICollectives(comm=comm, watchdog=dog)
buf = np.ones(8)


def raw(n):
    for _ in range(n):
        comm.Allreduce(MPI.IN_PLACE, buf)


def through(collectives):
    def run(n):
        for _ in range(n):
            collectives.allreduce(buf)
    return run


variants = {"raw mpi4py": raw, "watchdog=None": through(plain), "watchdog on": through(watched)}
best = dict.fromkeys(variants, float("inf"))
for name, run in variants.items():
    run(CALLS // 10)  # warm-up
for _ in range(ROUNDS):
    for name, run in variants.items():
        comm.Barrier()
        start = time.perf_counter()
        run(CALLS)
        best[name] = min(best[name], (time.perf_counter() - start) / CALLS)
dog.close()
if comm.rank == 0:
    for name, seconds in best.items():
        print(f"OVERHEAD {name}: {seconds * 1e6:.2f} us/call", flush=True)
