"""The scenario runner's second module for launches that run several (tests/
test_scenario_runner.py): a test named as control_scenarios.py's failing one, which passes
here, and one that ends rank 1's process."""
import os

from mpi4py import MPI

comm = MPI.COMM_WORLD


def test_fails_on_rank_1():
    assert comm.allreduce(1) == comm.size


def test_exits_on_rank_1():
    comm.Barrier()
    if comm.rank == 1:
        os._exit(3)
