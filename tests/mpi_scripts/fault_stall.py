"""Reducer steps with the stall watchdog on; one rank sleeps before step STEP.

Usage: fault_stall.py SLEEP_RANK STEP SLEEP_S WARN_AFTER ABORT_AFTER STEPS
  ABORT_AFTER "none": warn only. Prints "STALL-DONE rank R" at the end when nothing aborted.
"""
import sys
import time

import numpy as np

from pacmpi import MPICollectives, PacTrainReducer
from pacmpi.watchdog import StallWatchdog

SLEEP_RANK, STEP, SLEEP_S = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
WARN_AFTER = float(sys.argv[4])
ABORT_AFTER = None if sys.argv[5] == "none" else float(sys.argv[5])
STEPS = int(sys.argv[6])

dog = StallWatchdog(warn_after=WARN_AFTER, abort_after=ABORT_AFTER)
collectives = MPICollectives(watchdog=dog)
# A mask, so each step runs the verification all-reduce and a nonblocking bucket reduction.
mask = np.arange(1000) % 3 != 0
reducer = PacTrainReducer([mask, None], collectives=collectives)
rank, size = collectives.rank, collectives.size
for step in range(STEPS):
    if step == STEP and rank == SLEEP_RANK:
        time.sleep(SLEEP_S)
    grads = [np.full(1000, rank + 1.0), np.full(10, rank + 1.0)]
    reducer.reduce(grads)
    assert np.all(grads[1] == (size + 1) / 2), grads[1]
collectives.allgather_object(rank)  # also covers the watched allgather path
dog.close()
print(f"STALL-DONE rank {rank} after {STEPS} steps", flush=True)
