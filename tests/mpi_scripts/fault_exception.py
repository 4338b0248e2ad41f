"""One rank fails inside a loop of collectives; the job must end, not hang.

Usage: fault_exception.py MECHANISM WHERE FAIL_RANK STEP
  MECHANISM: "hook" (faults.install_excepthook), "run_main" (faults.run_main) or "context"
             (faults.abort_on_exception as a decorator).
  WHERE:     "user" (RuntimeError raised by the script), "exit" (sys.exit(3)) or "pacmpi" (a
             float32 gradient where float64 is expected, on FAIL_RANK only, in a step without
             verification: the TypeError is raised on that rank alone while the others wait
             in the reduction).
"""
import sys

import numpy as np

from pacmpi import MPICollectives, PacTrainReducer, faults

MECHANISM, WHERE, FAIL_RANK, STEP = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def train(_argv=None):
    collectives = MPICollectives()
    reducer = PacTrainReducer([None], collectives=collectives, verify_every=1000)
    rank = collectives.rank
    for step in range(100000):
        grads = [np.full(64, rank + 1.0)]
        if step == STEP and rank == FAIL_RANK:
            if WHERE == "user":
                raise RuntimeError(f"injected failure on rank {rank} at step {step}")
            if WHERE == "exit":
                sys.exit(3)
            grads = [grads[0].astype(np.float32)]
        reducer.reduce(grads)
        expected = collectives.size * (collectives.size + 1) / 2 / collectives.size
        assert np.all(grads[0] == expected), grads[0][:4]
    print("loop ended without the injected failure", flush=True)


if MECHANISM == "hook":
    faults.install_excepthook()
    train()
elif MECHANISM == "run_main":
    sys.exit(faults.run_main(train, sys.argv[1:]))
elif MECHANISM == "context":
    faults.abort_on_exception()(train)()
else:
    raise SystemExit(f"unknown mechanism {MECHANISM!r}")
