"""Sharded PacTrain over Horovod's collectives (its native reduce-scatter and all-gather), under
mpirun (tests/test_sharded.py): the transport equals NumPy bit for bit, uneven splits
included, and a ShardedOptimizer over it trains exactly as one over mpi4py."""
import horovod.torch as hvd
import torch

from pacmpi.adapters.horovod_collectives import HorovodCollectives
from pacmpi.adapters.sharded import ShardedOptimizer

from sharded_scenarios import check_transport, heads, heads_masks, train

hvd.init()


def test_horovod_collectives_match_reference():
    check_transport(HorovodCollectives())


def test_sharded_optimizer_over_horovod_equals_mpi():
    """Lossless and ternary (Horovod's native reduce-scatter of balanced words; other words
    than MPI's uint64, the same decoded values)."""
    masks = heads_masks("mixed")
    for quantize in (None, "ternary"):
        models = []
        for transport in (None, HorovodCollectives()):
            model = heads(masks)
            optimizer = ShardedOptimizer(model, torch.optim.Adam, masks=masks,
                                         collectives=transport, quantize=quantize, lr=0.01)
            train(model, optimizer, optimizer.step)
            models.append(model)
        for a, b in zip(*(m.parameters() for m in models)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), quantize
