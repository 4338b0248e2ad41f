"""``elastic_kill_after_save.py SCRIPT``: run SCRIPT (a torchrun worker) with
``pacmpi.adapters.checkpoint.save_checkpoint`` wrapped so that, on torchrun's first attempt, the
last worker SIGKILLs itself right after its first checkpoint (tests/test_elastic.py)."""
import os
import runpy
import signal
import sys

import torch.distributed as dist

from pacmpi.adapters import checkpoint

save = checkpoint.save_checkpoint


def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    if (os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
            and dist.get_rank() == dist.get_world_size() - 1):
        with open("killed", "w") as note:  # in the working directory: the test checks it
            note.write(f"rank {dist.get_rank()} after a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.save_checkpoint = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
# Past the script's end, as elastic_train.py's leave(): no interpreter finalization, which can
# abort a finished gloo rank (pytorch/pytorch#190489).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
