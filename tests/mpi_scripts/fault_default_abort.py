"""A plain training script that never calls pacmpi.faults: one rank fails mid-training.

Creating a PacTrainReducer on several ranks installs the abort-on-error hook by default, so
the job must end (every rank, non-zero) instead of hanging.

Usage: fault_default_abort.py WHERE FAIL_RANK STEP
  WHERE: "main"   a RuntimeError in the main thread of FAIL_RANK at step STEP;
         "thread" the batch-prefetch thread of FAIL_RANK dies at step STEP: its main thread
                  would wait for the next batch forever, the other ranks in the all-reduce;
         "custom" as "main", with a custom sys.excepthook installed before the reducer: it
                  still runs (prints CUSTOM-HOOK-RAN) before the job is aborted.
"""
import queue
import sys
import threading

import numpy as np

from pacmpi import MPICollectives, PacTrainReducer

WHERE, FAIL_RANK, STEP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

if WHERE == "custom":
    def custom_hook(exc_type, exc, tb):
        print(f"CUSTOM-HOOK-RAN {exc_type.__name__}: {exc}", file=sys.stderr, flush=True)

    sys.excepthook = custom_hook

collectives = MPICollectives()
reducer = PacTrainReducer([None], collectives=collectives, verify_every=1000)
rank, size = collectives.rank, collectives.size
batches = queue.Queue(maxsize=2)


def prefetch():
    for step in range(100000):
        if WHERE == "thread" and rank == FAIL_RANK and step == STEP:
            raise RuntimeError(f"prefetch thread failed on rank {rank} at step {step}")
        batches.put(np.full(64, rank + 1.0))


threading.Thread(target=prefetch, name="prefetch", daemon=True).start()
print(f"rank {rank}: hook installed: {getattr(sys.excepthook, '_pacmpi_abort', False)}",
      flush=True)
for step in range(100000):
    grads = [batches.get()]
    if WHERE in ("main", "custom") and rank == FAIL_RANK and step == STEP:
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
    reducer.reduce(grads)
    assert np.all(grads[0] == (size + 1) / 2), grads[0][:4]
print("loop ended without the injected failure", flush=True)
