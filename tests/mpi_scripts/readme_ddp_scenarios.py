"""The README's and the user guide's DDP snippets, run verbatim on every rank of a torchrun job
(tests/test_readme.py, in the shared torchrun launches of tests/mpi_util.py), then checked on
different data per rank.

- ddp: the two-liner, then 3 steps (DDP rebuilds its buckets after the first): pruned
  coordinates' gradients exactly 0 (DDP's default all-reduce would average nonzero ones), kept
  ones not, every rank's gradients identical, DDP names the hook.
- sharded-ddp: 3 Adam steps (only optimizer.step() after backward, which the hook already did)
  leave every rank's weights identical and updated, the pruned ones as they were, and each
  rank's Adam state its shard of the survivors.
- outer-ddp: the loop with outer steps (period 4): 8 steps end on an outer step, so every rank
  holds the same weights, pruned ones exactly 0; DDP reduced nothing (no comm hook ran, the
  outer steps sent the bytes).
"""
import torch
import torch.distributed as dist

import torch_world
from doc_snippets import snippet

RANK, SIZE = torch_world.join()


def small_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def magnitude_masks(model):
    return {name: p.detach().abs() > p.detach().abs().median()
            for name, p in model.named_parameters() if p.dim() > 1}


def identical_everywhere(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(SIZE)]
    dist.all_gather(everyone, tensor)
    return all(torch.equal(t, tensor) for t in everyone)


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_ddp():
    torch.manual_seed(0)  # the same weights, hence the same magnitude masks, on every rank
    model = small_model()
    masks = magnitude_masks(model)
    names = {"torch": torch, "model": model, "masks": masks}
    exec(snippet("ddp"), names)
    ddp_model = names["ddp_model"]
    assert ddp_model._get_ddp_logging_data().get("comm_hook") == "pactrain_hook"
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    torch.manual_seed(1 + RANK)  # different data per rank
    for step in range(3):
        optimizer.zero_grad()
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
        for name, p in model.named_parameters():
            if name in masks:
                assert bool((p.grad[~masks[name]] == 0).all()), (step, name, "pruned grads not 0")
                assert bool((p.grad[masks[name]] != 0).any()), (step, name)
            assert identical_everywhere(p.grad), (step, name, "ranks differ")
        optimizer.step()


def test_sharded_ddp():
    torch.manual_seed(0)
    model = small_model()
    masks = magnitude_masks(model)
    before = [p.detach().clone() for p in model.parameters()]
    names = {"torch": torch, "model": model, "masks": masks}
    exec(snippet("sharded-ddp"), names)
    ddp_model, optimizer = names["ddp_model"], names["optimizer"]
    assert ddp_model._get_ddp_logging_data().get("comm_hook") == "sharded_hook"
    torch.manual_seed(1 + RANK)
    for _ in range(3):
        optimizer.zero_grad()
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    assert identical_everywhere(flat_weights(model)), "ranks differ"
    for (name, p), old in zip(model.named_parameters(), before):
        assert not torch.equal(p, old), (name, "never updated")
        if name in masks:
            assert torch.equal(p.detach()[~masks[name]], old[~masks[name]]), (name, "pruned moved")
    survivors = sum(int(m.sum()) for m in masks.values()) + 32 + 4
    moments = optimizer.optimizer.state[optimizer.shard]["exp_avg"]
    assert moments.numel() == optimizer.shard.numel() <= -(-survivors // SIZE), moments.numel()


def test_outer_ddp():
    torch.manual_seed(RANK)  # different weights: OuterSync starts every rank from rank 0's
    model = small_model()
    masks = {name: torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) < 0.5
             for name, p in model.named_parameters() if p.dim() > 1}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(8)]
    names = {"torch": torch, "model": model, "masks": masks, "optimizer": optimizer,
             "batches": batches, "loss_fn": torch.nn.functional.cross_entropy}
    exec(snippet("outer-ddp"), names)
    outer = names["outer"]
    assert outer.outer_steps == 2 and outer.stats["packed_reductions"] > 0, outer.stats
    assert identical_everywhere(flat_weights(model)), "ranks differ"
    for name, p in model.named_parameters():
        if name in masks:
            assert bool((p[~masks[name]] == 0).all()), (name, "pruned weights moved")
