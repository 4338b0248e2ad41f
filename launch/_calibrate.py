"""Dense all-reduce micro-benchmark run under ``mpirun`` by :func:`pacmpi.launch.testbed.calibrate`.

Usage: ``python -m pacmpi.launch._calibrate NBYTES REPEATS`` (or run this file directly).
Every rank all-reduces a float32 buffer of NBYTES bytes with ``MPI.SUM``; one untimed warm-up
call opens the TCP connections first. Rank 0 prints one JSON line with the per-call times
(the slowest rank's time per call, since the link is shared and the call ends for everybody
only when the last byte has crossed it).
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main(argv):
    nbytes, repeats = int(argv[1]), int(argv[2])
    comm = MPI.COMM_WORLD
    send = np.ones(max(nbytes // 4, 1), dtype=np.float32)
    recv = np.empty_like(send)
    comm.Allreduce(send, recv, op=MPI.SUM)  # warm-up: connection set-up is not bandwidth
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        elapsed = time.perf_counter() - start
        times.append(comm.allreduce(elapsed, op=MPI.MAX))
    if not np.all(recv == comm.size):
        raise SystemExit(f"rank {comm.rank}: wrong all-reduce result")
    if comm.rank == 0:
        print(json.dumps({"n": comm.size, "nbytes": send.nbytes, "times": times}), flush=True)


if __name__ == "__main__":
    main(sys.argv)
