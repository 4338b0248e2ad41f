"""Runs one of the README's front-end snippets verbatim on every rank, then checks what it did.

Usage: readme_quickstart.py raw-loop|horovod|sharded|outer SNIPPET_FILE (under mpirun). Every rank
trains on data of its own, so only a working all-reduce keeps the weights identical. Prints
"OK readme <front end> rank <r>" on every rank that passed.

- raw-loop: the snippet gets ``comm``, ``model``, ``batches`` and ``loss_fn`` and trains; then
  the ranks' weights are identical, pruned weights exactly 0 and packed all-reduces happened.
- horovod: the snippet gets ``model``, ``masks`` and ``optimizer`` (the same magnitude masks
  on every rank) and wraps the optimizer; 3 steps with it leave the ranks' weights identical,
  the pruned weights as they were (their gradients come back 0) and some tensors packed.
- sharded: the snippet gets ``model``, ``masks`` and ``torch`` and builds the optimizer; 3 steps
  with it leave the ranks' weights identical, the pruned weights as they were, and Adam's
  state on each rank as large as its shard, about 1/N of the survivors.
- outer: the snippet gets ``model``, ``optimizer``, ``masks``, ``batches`` and ``loss_fn`` and
  trains 16 steps, one period: then the ranks' weights are identical (packed), pruned ones 0.
"""
import sys
from pathlib import Path

import torch

from pacmpi.adapters.pruning import prune
from pacmpi.experiments.data import iterate_minibatches, load_digits_split, shard
from pacmpi.experiments.models import build_model

front_end, snippet = sys.argv[1], Path(sys.argv[2]).read_text()
loss_fn = torch.nn.functional.cross_entropy
data = load_digits_split()


def batches_of(rank, size, count):
    x, y = shard((data.x_train, data.y_train), rank, size)
    return list(iterate_minibatches(x, y, 32, seed=0, epoch=0))[:count]


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


if front_end == "raw-loop":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.rank
    torch.manual_seed(rank)  # different initial weights: broadcast_parameters must fix that
    model = build_model("digits_cnn", width=8, hidden=32)
    names = dict(comm=comm, model=model, batches=batches_of(rank, comm.size, 5), loss_fn=loss_fn)
    exec(snippet, names)
    enforcer, sync = names["enforcer"], names["sync"]
    everyone = comm.allgather(flat_weights(model))
    assert all(bool((p[~m] == 0).all()) for p, m in zip(enforcer.parameters.values(),
                                                          enforcer.masks.values()))
    assert sync.stats["packed_reductions"] > 0, sync.stats
elif front_end in ("horovod", "sharded"):
    torch.manual_seed(0)  # the same weights, hence the same magnitude masks, on every rank
    model = build_model("digits_cnn", width=8, hidden=32)
    masks = prune(model, 0.8)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if front_end == "horovod":
        import horovod.torch as hvd

        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        names = dict(model=model, masks=masks, optimizer=optimizer)
        exec(snippet, names)
        rank, size, allgather = hvd.rank(), hvd.size(), hvd.allgather_object
    else:
        from mpi4py import MPI

        names = dict(model=model, masks=masks, torch=torch)
        exec(snippet, names)
        rank, size, allgather = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, \
            MPI.COMM_WORLD.allgather
    optimizer = names["optimizer"]
    for x, y in batches_of(rank, size, 3):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    everyone = allgather(flat_weights(model))
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), (name, "never updated")
        if name in masks:
            pruned = ~masks[name].bool()
            assert torch.equal(p.detach()[pruned], before[name][pruned]), (name, "pruned moved")
    if front_end == "horovod":
        assert names["compression"].stats["packed_reductions"] > 0, names["compression"].stats
    else:
        survivors = sum(int(m.sum()) for m in masks.values()) + sum(
            p.numel() for name, p in model.named_parameters() if name not in masks)
        moments = optimizer.optimizer.state[optimizer.shard]["exp_avg"]
        assert moments.numel() == optimizer.shard.numel() <= -(-survivors // size), (
            moments.numel(), survivors)
elif front_end == "outer":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.rank
    torch.manual_seed(0)  # the same weights, hence the same magnitude masks, on every rank
    model = build_model("digits_cnn", width=8, hidden=32)
    masks = prune(model, 0.8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    names = dict(model=model, optimizer=optimizer, masks=masks, loss_fn=loss_fn,
                 batches=batches_of(rank, comm.size, 16))  # period 16: one outer step, at the end
    exec(snippet, names)
    outer = names["outer"]
    everyone = comm.allgather(flat_weights(model))
    assert outer.outer_steps == 1 and outer.stats["packed_reductions"] > 0, outer.stats
    assert all(bool((p[~masks[n]] == 0).all()) for n, p in model.named_parameters() if n in masks)
else:
    raise SystemExit(f"unknown front end {front_end!r}: raw-loop, horovod, sharded or outer")

assert all((w == everyone[0]).all() for w in everyone), "ranks diverged"
print(f"OK readme {front_end} rank {rank}", flush=True)
