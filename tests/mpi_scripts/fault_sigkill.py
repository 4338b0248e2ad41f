"""One rank SIGKILLs itself in a loop of all-reduces; the launcher must end the job.

Usage: fault_sigkill.py KILL_RANK STEP
"""
import os
import signal
import sys

import numpy as np

from pacmpi import MPICollectives

KILL_RANK, STEP = int(sys.argv[1]), int(sys.argv[2])

collectives = MPICollectives()
buf = np.ones(256)
for step in range(1000000):
    if step == STEP and collectives.rank == KILL_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    buf[:] = 1.0
    collectives.allreduce(buf)
print("loop ended without the kill", flush=True)
