"""Sharded PacTrain under DDP (``pacmpi.adapters.sharded.sharded_hook``): every rank runs these
tests in this order under torchrun (gloo; tests/test_sharded.py), each reported on its own.

1. A DDP model hooked with a ShardedOptimizer equals replicated PacTrain (PacTrainHookState +
   pactrain_hook, the same optimizer over the whole model) bit for bit on integer-valued data
   (SGD with momentum, Adam), with DDP's rebuilt buckets, gradient_as_bucket_view and one
   bucket, float32 + bfloat16 parameters, and masks changed midway (set_masks); pruned
   weights stay exactly 0; ranks end bit-identical; ``optimizer.step()`` after a hooked
   backward does nothing; the optimizer state per rank is its shard of the survivors; the
   bytes sent are the survivors'.
2. Bad input raises on every rank together: a mask of the wrong shape on one rank (at
   construction), an optimizer over part of the DDP model (from backward), a mask moved on
   one rank between steps (MaskMismatchError from backward); the process group stays usable.
"""
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pacmpi import MaskMismatchError, RankInputError
from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.sharded import ShardedOptimizer, sharded_hook
from pacmpi.adapters.torch_collectives import TorchDistCollectives

import torch_world
from mismatch_checks import expect_raise

RANK, SIZE = torch_world.join()
SMALL = {"bucket_cap_mb": 0.0002}  # ~200 bytes: several buckets once DDP rebuilds them
STEPS = 4


class Net(nn.Module):
    """Three linear heads on integer inputs, summed; the masked weights start pruned (0). A
    loss linear in the output gives integer gradients that do not depend on the weights, so
    every sum over ranks is exact at any world size and step (a deeper net's gradients would
    round, and the two reductions add in different orders on 4 ranks)."""

    def __init__(self, bf16=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(12, 10), nn.Linear(12, 10), nn.Linear(12, 10)
        if bf16:  # a model of two dtypes: DDP gives c's gradients a bucket of their own
            self.c.to(torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-3, 4, p.shape))
            for name, keep in masks_of(self).items():
                self.get_parameter(name).mul_(keep)

    def forward(self, x):
        return self.a(x) + self.b(x.flip(1)) + self.c((x * x).to(self.c.weight.dtype)).float()


def masks_of(model, density=0.5):
    gen = torch.Generator().manual_seed(1)
    return {name: torch.rand(p.shape, generator=gen) < density
            for name, p in model.named_parameters() if name.endswith("weight")}


def batch(step):
    gen = torch.Generator().manual_seed(1000 * step + RANK)
    return (torch.randint(-2, 3, (8, 12), generator=gen).float(),
            torch.randint(-2, 3, (8, 10), generator=gen).float())


def repruned(masks):
    gen = torch.Generator().manual_seed(5)
    return {name: keep ^ (torch.rand(keep.shape, generator=gen) < 0.3)
            for name, keep in masks.items()}


def run(sharded, optimizer_class, steps=STEPS, ddp_kw=SMALL, bf16=False, reprune_at=None,
        **options):
    """``steps`` of DDP training; returns the model and the optimizer (sharded or plain).
    ``reprune_at``: before that step the masks change to :func:`repruned`'s, newly pruned
    weights are zeroed (and kept at 0 in the replicated run, whose Adam would move them)."""
    model = Net(bf16)
    masks = masks_of(model)
    if sharded:
        optimizer = ShardedOptimizer(model, optimizer_class, masks=masks,
                                     collectives=TorchDistCollectives(), **options)
    ddp = DDP(model, **ddp_kw)
    if sharded:
        ddp.register_comm_hook(optimizer, sharded_hook)
    else:
        ddp.register_comm_hook(PacTrainHookState(ddp, masks), pactrain_hook)
        optimizer = optimizer_class(model.parameters(), **options)
    for step in range(steps):
        if step == reprune_at:
            after = repruned(masks)
            if sharded:
                optimizer.set_masks(after)
            else:  # the hook state re-reads its masks at every verification
                for name, keep in masks.items():
                    keep.copy_(after[name])
            prune(model, after)
        optimizer.zero_grad()
        x, t = batch(step)
        (ddp(x) * t).sum().backward()
        if sharded:
            before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        if sharded:  # the hook stepped in backward
            assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
        if not sharded and reprune_at is not None and step >= reprune_at:
            prune(model, after)
    return model, optimizer


def prune(model, masks):
    with torch.no_grad():
        for name, keep in masks.items():
            model.get_parameter(name).mul_(keep)


def digest(model):
    return hashlib.sha256(b"".join(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def assert_same_weights(model, reference, masks=None):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs from replicated PacTrain's"
    for name, keep in (masks or masks_of(model)).items():
        assert not model.get_parameter(name)[~keep].any(), f"a pruned weight of {name} moved"
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1, "ranks ended with different weights"


def test_matches_replicated_pactrain():
    momentum = dict(lr=2.0 ** -6, momentum=0.5)  # dyadic: every sum stays exact
    for ddp_kw in (SMALL, dict(SMALL, gradient_as_bucket_view=True), {}):
        model, optimizer = run(True, torch.optim.SGD, ddp_kw=ddp_kw, **momentum)
        reference, _ = run(False, torch.optim.SGD, ddp_kw=ddp_kw, **momentum)
        assert_same_weights(model, reference)
        assert not torch.equal(model.a.weight, Net().a.weight), "nothing trained"
        if ddp_kw:  # DDP rebuilt its first bucket into several: each reduce-scattered alone
            assert len({index for index, _ in optimizer._parts}) > 2, optimizer._parts
    stats = optimizer.reducer.stats
    survivors = optimizer.reducer.layout.total
    assert stats["steps"] == STEPS and stats["verifications"] == STEPS, stats
    assert stats["bytes_sent"] == STEPS * survivors * 4, (stats, survivors)
    dense = sum(p.numel() for p in model.parameters())
    assert survivors < dense, (survivors, dense)
    state = optimizer.optimizer.state[optimizer.shard]["momentum_buffer"]
    assert state.numel() == optimizer.reducer.layout.shard_size <= -(-survivors // SIZE)
    model, _ = run(True, torch.optim.Adam, lr=0.01)  # elementwise on the same gradients
    reference, _ = run(False, torch.optim.Adam, lr=0.01)
    assert_same_weights(model, reference)
    # float32 + bfloat16 (small integers: exact bfloat16 sums): a shard per dtype.
    model, optimizer = run(True, torch.optim.Adam, bf16=True, lr=0.01)
    reference, _ = run(False, torch.optim.Adam, bf16=True, lr=0.01)
    assert_same_weights(model, reference)
    assert sorted(str(s.dtype) for s in optimizer.shards) == ["torch.bfloat16", "torch.float32"]
    # Masks changed between steps: the survivors are sharded anew, the hook goes on.
    model, optimizer = run(True, torch.optim.Adam, reprune_at=2, lr=0.01)
    reference, _ = run(False, torch.optim.Adam, reprune_at=2, lr=0.01)
    assert_same_weights(model, reference, repruned(masks_of(Net())))
    assert optimizer.reducer.layout.total == sum(
        int(keep.sum()) for keep in repruned(masks_of(Net())).values()) + 3 * 10


def test_bad_input_raises_on_every_rank():
    last = SIZE - 1
    model = Net()
    masks = masks_of(model)
    if RANK == last:
        masks["a.weight"] = masks["a.weight"][:, :5]
    expect_raise(RankInputError, lambda: ShardedOptimizer(
        model, torch.optim.SGD, masks=masks, collectives=TorchDistCollectives(), lr=0.1),
        f"rank {last}: ValueError: mask 'a.weight' has shape (10, 5)")

    # An optimizer over part of the DDP model: the first bucket holding the rest raises.
    model = Net()
    partial = ShardedOptimizer(model.c, torch.optim.SGD, collectives=TorchDistCollectives(),
                               lr=0.1)
    ddp = DDP(model)
    ddp.register_comm_hook(partial, sharded_hook)
    x, t = batch(0)
    expect_raise(RankInputError, lambda: (ddp(x) * t).sum().backward(),
                 "parameter this optimizer does not train")

    # Ternary shards the whole step (ShardedOptimizer.step): the hook says so, on every rank.
    model = Net()
    ternary = ShardedOptimizer(model, torch.optim.SGD, masks=masks_of(model), lr=0.1,
                               collectives=TorchDistCollectives(), quantize="ternary")
    ddp = DDP(model)
    ddp.register_comm_hook(ternary, sharded_hook)
    expect_raise(RankInputError, lambda: (ddp(x) * t).sum().backward(),
                 "sharded_hook is lossless, this optimizer has quantize='ternary'")

    # The last rank moves a survivor of its mask (the same count) before step 2.
    model = Net()
    optimizer = ShardedOptimizer(model, torch.optim.SGD, masks=masks_of(model),
                                 collectives=TorchDistCollectives(), lr=0.1)
    ddp = DDP(model, **SMALL)
    ddp.register_comm_hook(optimizer, sharded_hook)
    finished = []
    for step in range(STEPS):
        if step == 2 and RANK == last:
            keep = optimizer.masks["b.weight"].view(-1)
            first_kept, first_pruned = int(keep.nonzero()[0]), int((~keep).nonzero()[0])
            keep[first_kept], keep[first_pruned] = False, True
        x, t = batch(step)
        try:
            (ddp(x) * t).sum().backward()
        except MaskMismatchError as exc:
            assert f"offending ranks: [{last}]" in str(exc), str(exc)
            break
        finished.append(step)
    assert finished == [0, 1], finished
    flag = torch.ones(1)  # the process group is still in step
    dist.all_reduce(flag)
    assert flag.item() == SIZE
