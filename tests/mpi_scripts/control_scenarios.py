"""Negative controls for the scenario runner (tests/test_scenario_runner.py): a scenario that
fails on rank 1 only, after its collectives, one that ends rank 1's process and one that hangs
(asleep, not spinning in a collective: the machine is shared)."""
import os
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD


def test_passes():
    assert comm.allreduce(1) == comm.size


def test_fails_on_rank_1():
    total = comm.allreduce(comm.rank)
    assert comm.rank != 1, f"deliberate failure on rank {comm.rank} (rank sum {total})"


def test_exits_on_rank_1():
    comm.Barrier()
    if comm.rank == 1:
        os._exit(3)


def test_hangs():
    time.sleep(3600)


def test_passes_after_them():
    assert comm.allreduce(1) == comm.size
