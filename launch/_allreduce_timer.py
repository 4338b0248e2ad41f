"""The MPI library's own all-reduce, timed per payload size: run under ``mpirun`` by
``pacmpi tune``, once per algorithm (the algorithm is fixed when MPI starts).

Usage: ``python -m pacmpi.launch._allreduce_timer ITERS WARMUP [--nonblocking] NBYTES...``.
Every rank all-reduces float32 buffers of each size with ``MPI.SUM`` through mpi4py (no pacmpi
codec in between): ``Allreduce`` into a second buffer, or with ``--nonblocking`` an in-place
``Iallreduce`` waited on at once, as :class:`pacmpi.reducer.PacTrainReducer` calls it (the
libraries choose that algorithm apart, Open MPI by whether the buffer is in place); timed by
:func:`pacmpi.bench.harness.time_op` (ranks start each call together; a call's time is the
slowest rank's). Values are small integers, so every sum is exact in any
order and a validation pass counts wrong elements (#wrong, as nccl-tests). Rank 0 prints one
line ``PACMPI_TUNE {json}``: the algorithm the library says it was told to run for that call
(read back through MPI_T), and per size the times and #wrong.
"""
import json
import sys

import numpy as np

MARK = "PACMPI_TUNE "


def command(sizes, iters, warmup, nonblocking=False):
    """The worker's argv (run it on the ranks)."""
    return [sys.executable, "-m", "pacmpi.launch._allreduce_timer", str(iters), str(warmup),
            *(["--nonblocking"] if nonblocking else []), *map(str, sizes)]


def report(stdout):
    """Rank 0's report in the job's ``stdout`` (a dict), or ``None``."""
    lines = [line.split(MARK, 1)[1] for line in stdout.splitlines() if MARK in line]
    return json.loads(lines[-1]) if lines else None


def main(argv):
    # Imported here: importing mpi4py.MPI initializes MPI, which only the ranks may do.
    from mpi4py import MPI

    from pacmpi.bench import harness
    from pacmpi.collectives import MPICollectives, allreduce_algorithm

    nonblocking = "--nonblocking" in argv
    iters, warmup = int(argv[1]), int(argv[2])
    sizes = [int(a) for a in argv[3:] if a != "--nonblocking"]
    comm = MPI.COMM_WORLD
    collectives = MPICollectives(comm=comm)
    rows = []
    for nbytes in sizes:
        # 0..12 times (rank + 1): sums up to 12 * P(P+1)/2 stay exact in float32 to ~1600 ranks.
        ramp = (np.arange(max(nbytes // 4, 1)) % 13).astype(np.float32)
        send, recv = ramp * (comm.rank + 1), np.empty_like(ramp)
        if nonblocking:
            def call():  # the refill is timed too: a memory-speed copy, the same for each
                recv[:] = send
                comm.Iallreduce(MPI.IN_PLACE, recv, op=MPI.SUM).Wait()
        else:
            def call():
                comm.Allreduce(send, recv, op=MPI.SUM)
        timing = harness.time_op(call, iters, warmup=warmup, collectives=collectives)
        wrong = comm.allreduce(int(np.count_nonzero(recv != ramp * (comm.size * (comm.size + 1)
                                                                     // 2))), op=MPI.SUM)
        rows.append({"bytes": send.nbytes, "median_s": timing.median, "min_s": timing.min,
                     "max_s": timing.max, "wrong": wrong})
    if comm.rank == 0:
        ran = allreduce_algorithm(MPI, nonblocking=nonblocking)
        print(MARK + json.dumps({"ranks": comm.size, "ran": ran, "rows": rows}), flush=True)


if __name__ == "__main__":
    main(sys.argv)
