"""Does a posted MPI all-reduce move while the rank computes? The measurement behind
``PacTrainReducer.progress``: post an in-place ``Iallreduce`` of NBYTES, compute (a Python
busy loop, no MPI call) for SECONDS, then wait; once left alone during the computation, once
with ``MPI_Test`` every few milliseconds. Rank 0 prints each case's time from posting to the
end of the wait (the slowest rank's), twice.

    pacmpi-run -n 4 --link 100mbit -- python scripts/mpi_progress.py 8000000 2.0

Open MPI (coll/libnbc) moves a non-blocking collective only inside MPI calls: left alone, the
all-reduce starts when the wait does (computation + transfer); tested, it overlaps.
"""
import sys
import time

import numpy as np
from mpi4py import MPI


def compute(seconds, request=None):
    """Busy for ``seconds``; ``MPI_Test`` on ``request`` every 2000 additions when given."""
    end, x = time.perf_counter() + seconds, 0.0
    while time.perf_counter() < end:
        for _ in range(2000):
            x += 1.0
        if request is not None:
            request.Test()


def main(argv):
    comm = MPI.COMM_WORLD
    buf = np.ones(int(argv[1]) // 4, np.float32)
    for tested in (False, True, False, True):
        comm.Barrier()
        started = time.perf_counter()
        request = comm.Iallreduce(MPI.IN_PLACE, buf)
        compute(float(argv[2]), request if tested else None)
        request.Wait()
        total = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
        if comm.rank == 0:
            print(f"{'tested' if tested else 'left alone'}: {total:.2f} s from posting to the "
                  f"end of the wait", flush=True)


if __name__ == "__main__":
    main(sys.argv)
