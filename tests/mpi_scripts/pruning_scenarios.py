"""GraSP on DIFFERENT per-rank batches, with ``comm``, gives identical masks: a scenario every
rank runs under mpirun (tests/test_pruning.py, in the shared launches of tests/mpi_util.py).
Every rank:

1. prunes a copy of the same model locally (no ``comm``) -- negative control: with
   different data these masks must NOT all agree, otherwise the check below proves nothing;
2. prunes with ``comm=MPI.COMM_WORLD`` -- all fingerprints must agree, equal rank 0's local
   decision, have the exact ratio and leave pruned weights exactly zero;
3. makes rank 0's scoring fail (empty data there) -- every rank must raise, none may hang.

Rank 0 judges; every rank fails with its list of failures.
"""
import copy

import torch
from mpi4py import MPI

from pacmpi.adapters.pruning import masks_digest, named_prunable_parameters, prune
from pacmpi.experiments.data import iterate_minibatches, load_digits_split, shard
from pacmpi.experiments.models import DigitsCNN

RATIO = 0.8


def exact_and_zero(model, masks) -> bool:
    params = named_prunable_parameters(model)
    total = sum(m.numel() for m in masks.values())
    pruned = sum(int((~m).sum()) for m in masks.values())
    zero = all(bool((params[name][~mask] == 0).all()) for name, mask in masks.items())
    return zero and pruned == round(RATIO * total)


def failure_is_collective(comm, model, batches) -> bool:
    data = [] if comm.Get_rank() == 0 else batches
    try:
        prune(model, RATIO, "grasp", data=data, comm=comm)
    except (ValueError, RuntimeError):
        return True
    return False


def test_grasp_masks_identical_across_ranks_with_different_data():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)  # identical weights on every rank, as after the initial broadcast
    model = DigitsCNN(width=8)
    split = load_digits_split()
    x, y = shard((split.x_train, split.y_train), rank, size)
    batches = list(iterate_minibatches(x, y, 32, seed=rank, epoch=0))

    local = prune(copy.deepcopy(model), RATIO, "grasp", data=batches, grasp_batches=2)
    shared = prune(model, RATIO, "grasp", data=batches, grasp_batches=2, comm=comm)
    raised = failure_is_collective(comm, copy.deepcopy(model), batches)

    local_fps = comm.gather(masks_digest(local), root=0)
    shared_fps = comm.gather(masks_digest(shared), root=0)
    checks = comm.gather(exact_and_zero(model, shared), root=0)
    raised_all = comm.gather(raised, root=0)
    failures = []
    if rank == 0:
        if len(set(local_fps)) == 1:
            failures.append("negative control: local GraSP masks agree although the data differ")
        if len(set(shared_fps)) != 1:
            failures.append(f"masks differ across ranks: {shared_fps}")
        if shared_fps[0] != local_fps[0]:
            failures.append("broadcast masks are not rank 0's decision")
        if not all(checks):
            bad = [r for r, ok in enumerate(checks) if not ok]
            failures.append(f"ratio/zero check failed on ranks {bad}")
        if not all(raised_all):
            bad = [r for r, ok in enumerate(raised_all) if not ok]
            failures.append(f"rank-0 failure did not raise on ranks {bad}")
    failures = comm.bcast(failures, root=0)
    assert not failures, "; ".join(failures)
