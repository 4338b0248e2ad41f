"""A short ``pacmpi bench masks`` with every fault, both policies and the zero-size controls,
through the command line on every rank (tests/test_bench_masks.py, in the shared launches of
tests/mpi_util.py); the report goes to $PACMPI_TEST_WORKDIR/bench_masks_<ranks>.json, which
the outer test reads."""
import os

from mpi4py import MPI

from pacmpi.cli import main


def test_short_run():
    path = os.path.join(os.environ["PACMPI_TEST_WORKDIR"],
                        f"bench_masks_{MPI.COMM_WORLD.Get_size()}.json")
    assert main(["bench", "masks", "--steps", "32", "--prune-every", "4", "--pretrain-epochs",
                 "2", "--controls", "--json", path]) == 0
