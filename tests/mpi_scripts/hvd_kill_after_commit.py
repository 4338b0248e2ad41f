"""``hvd_kill_after_commit.py SCRIPT``: run SCRIPT (a Horovod elastic worker) with
``TorchState.commit`` wrapped so that rank 1 SIGKILLs itself right after its first commit, once
per job (tests/test_horovod_elastic.py)."""
import os
import runpy
import signal
import sys

import horovod.torch as hvd

commit = hvd.elastic.TorchState.commit


def commit_then_die(state):
    commit(state)
    if hvd.rank() == 1 and not os.path.exists("killed"):
        with open("killed", "w") as note:  # in the working directory: the test checks it
            note.write(f"rank 1 after the commit at step {state.step}")
        os.kill(os.getpid(), signal.SIGKILL)


hvd.elastic.TorchState.commit = commit_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
