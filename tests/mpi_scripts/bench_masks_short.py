"""MPI worker: a short ``pacmpi bench masks`` with every fault, both policies and the
zero-size controls; writes the report to argv[1] (the test reads it)."""
import sys

from pacmpi.cli import main

sys.exit(main(["bench", "masks", "--steps", "32", "--prune-every", "4", "--pretrain-epochs", "2",
               "--controls", "--json", sys.argv[1]]))
