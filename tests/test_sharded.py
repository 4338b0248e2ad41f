"""Sharded PacTrain (pacmpi.sharded and pacmpi.adapters.sharded) across 2 and 4 real MPI ranks:
each scenario of mpi_scripts/sharded_scenarios.py (mpi4py, the all-reduce fallback and
torch.distributed transports), of mpi_scripts/sharded_ddp_scenarios.py (the DDP hook, under
torchrun) and of mpi_scripts/hvd_sharded_scenarios.py (Horovod's) reported on its own, one
bounded launch per module and rank count."""
import importlib.util

import numpy as np
import pytest
import torch
from mpi4py import MPI

from pacmpi import RankInputError
from pacmpi.adapters.sharded import ShardedOptimizer
from pacmpi.buckets import BucketLayout
from pacmpi.sharded import ShardLayout, balanced_counts

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

MODULE = "sharded_scenarios.py"
HOROVOD = "hvd_sharded_scenarios.py"
DDP = "sharded_ddp_scenarios.py"


def test_shard_layout_gathers_and_scatters_survivors_in_order():
    """Packed positions run through the arrays in order; any [lo, hi) window, one spanning
    arrays included, gathers and scatters exactly those survivors."""
    bucket = BucketLayout([(3, 4), (5,), (2, 2)], [np.float32] * 3, 1 << 30).buckets[0]
    mask = np.random.default_rng(1).random(bucket.size) < 0.5
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(12, 17, dtype=np.float32),
              np.arange(17, 21, dtype=np.float32).reshape(2, 2)]
    packed = np.arange(bucket.size, dtype=np.float32)[mask]  # element k holds value k
    for size in (1, 2, 3, 7, 30):
        for rank in range(size):
            layout = ShardLayout(bucket, np.flatnonzero(mask), size, rank)
            assert layout.counts == balanced_counts(packed.size, size)
            out = np.full(layout.shard_size, -1, dtype=np.float32)
            layout.gather(arrays, out, layout.start, layout.stop)
            assert np.array_equal(out, packed[layout.start:layout.stop])
            written = [np.zeros_like(a) for a in arrays]
            layout.scatter(out, written, layout.start, layout.stop)
            flat = np.concatenate([w.reshape(-1) for w in written])
            expected = np.zeros(bucket.size, dtype=np.float32)
            expected[np.flatnonzero(mask)[layout.start:layout.stop]] = out
            assert np.array_equal(flat, expected)


def test_shard_parts_fill_each_rank_shard():
    """A DDP bucket's ShardPart: rank r's block of its payload (split by its counts) placed
    into rank r's shard, over a partition of the arrays in any order, rebuilds exactly that
    rank's shard of the survivors; an array the layout lacks is refused."""
    shapes = [(3, 4), (5,), (2, 2), (7,)]
    bucket = BucketLayout(shapes, [np.float32] * 4, 1 << 30).buckets[0]
    mask = np.random.default_rng(2).random(bucket.size) < 0.6
    arrays = [np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) + 100 * i
              for i, s in enumerate(shapes)]
    for size in (1, 2, 3, 4, 9):
        for partition in ([[3, 1], [0], [2]], [[2, 0, 1, 3]], [[0], [1], [2], [3]]):
            for rank in range(size):
                layout = ShardLayout(bucket, np.flatnonzero(mask), size, rank)
                shard = np.full(layout.shard_size, np.nan, dtype=np.float32)
                for members in partition:
                    part = layout.part(members)
                    payload = part.gather(arrays, np.empty(part.size, dtype=np.float32))
                    start = sum(part.counts[:rank])
                    part.place(payload[start:start + part.counts[rank]], shard)
                want = layout.gather(arrays, np.empty_like(shard), layout.start, layout.stop)
                assert np.array_equal(shard, want), (size, partition, rank)
    with pytest.raises(ValueError, match=r"arrays \[4\] are not in the layout"):
        layout.part([0, 4])


def test_single_rank_equals_plain_adam_on_masked_gradients():
    """On one rank the shard is every survivor: the model trains as torch's Adam over the
    model with pruned gradients zeroed, bit for bit; the pruned weights never move."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.load_state_dict(reference.state_dict())
    masks = {"0.weight": torch.rand(4, 6) < 0.5, "2.bias": torch.tensor([True, False])}
    with torch.no_grad():
        for m in (model, reference):
            m[0].weight.mul_(masks["0.weight"])
            m[2].bias[1] = 0.5  # pruned and not 0: left as it is
    sharded = ShardedOptimizer(model, torch.optim.Adam, masks=masks, comm=MPI.COMM_SELF,
                               lr=0.05)
    plain = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(5):
        x = torch.randn(8, 6)
        for m, opt in ((model, sharded), (reference, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
        reference[0].weight.grad.mul_(masks["0.weight"])
        reference[2].bias.grad.mul_(masks["2.bias"])
        sharded.step()
        plain.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert model[2].bias[1] == 0.5 and not model[0].weight[~masks["0.weight"]].any()
    unmasked = 4 + 2 * 4  # 0.bias, 2.weight
    assert sharded.shard.numel() == sum(int(m.sum()) for m in masks.values()) + unmasked
    with pytest.raises(RankInputError, match="names no trainable parameter"):
        ShardedOptimizer(model, torch.optim.SGD, masks={"3.weight": torch.ones(1)},
                         comm=MPI.COMM_SELF, lr=0.1)


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, shared_launches(MODULE)))
def test_sharded_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks).check(scenario)


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(DDP, shared_launches(DDP, "torchrun")))
def test_sharded_ddp_scenario(ranks, scenario):
    run_scenarios(DDP, ranks, "torchrun").check(scenario)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="needs Horovod")
@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(HOROVOD, shared_launches(HOROVOD)))
def test_horovod_sharded_scenario(ranks, scenario):
    run_scenarios(HOROVOD, ranks).check(scenario)
