"""The README's front-end snippets, run verbatim on every rank under mpirun, then checked
(tests/test_readme.py; in the shared launches of tests/mpi_util.py, Horovod's in
readme_hvd_scenarios.py). Every rank trains on data of its own, so only a working all-reduce
keeps the weights identical.

- raw loop: the snippet gets ``comm``, ``model``, ``batches`` and ``loss_fn`` and trains; then
  the ranks' weights are identical, pruned weights exactly 0 and packed all-reduces happened.
- sharded: the snippet gets ``model``, ``masks`` and ``torch`` and builds the optimizer; 3 steps
  with it leave the ranks' weights identical, the pruned weights as they were, and Adam's
  state on each rank as large as its shard, about 1/N of the survivors.
- outer: the snippet gets ``model``, ``optimizer``, ``masks``, ``batches`` and ``loss_fn`` and
  trains 16 steps, one period: then the ranks' weights are identical (packed), pruned ones 0.
"""
import torch
from mpi4py import MPI

from pacmpi.adapters.pruning import prune
from pacmpi.experiments.data import iterate_minibatches, load_digits_split, shard
from pacmpi.experiments.models import build_model

from doc_snippets import snippet

loss_fn = torch.nn.functional.cross_entropy
comm = MPI.COMM_WORLD
DATA = load_digits_split()


def batches_of(rank, size, count):
    x, y = shard((DATA.x_train, DATA.y_train), rank, size)
    return list(iterate_minibatches(x, y, 32, seed=0, epoch=0))[:count]


def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def pruned_model():
    """The same weights, hence the same magnitude masks, on every rank: (model, masks)."""
    torch.manual_seed(0)
    model = build_model("digits_cnn", width=8, hidden=32)
    return model, prune(model, 0.8)


def train_three_steps(model, masks, optimizer, rank, size, allgather):
    """3 steps on this rank's data: the ranks' weights identical, every parameter updated,
    the pruned ones as they were (their gradients come back 0)."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for x, y in batches_of(rank, size, 3):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    everyone = allgather(flat_weights(model))
    assert all((w == everyone[0]).all() for w in everyone), "ranks diverged"
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), (name, "never updated")
        if name in masks:
            pruned = ~masks[name].bool()
            assert torch.equal(p.detach()[pruned], before[name][pruned]), (name, "pruned moved")


def test_raw_loop():
    torch.manual_seed(comm.rank)  # different initial weights: broadcast_parameters must fix that
    model = build_model("digits_cnn", width=8, hidden=32)
    names = dict(comm=comm, model=model, batches=batches_of(comm.rank, comm.size, 5),
                 loss_fn=loss_fn)
    exec(snippet("raw-loop"), names)
    enforcer, sync = names["enforcer"], names["sync"]
    everyone = comm.allgather(flat_weights(model))
    assert all((w == everyone[0]).all() for w in everyone), "ranks diverged"
    assert all(bool((p[~m] == 0).all()) for p, m in zip(enforcer.parameters.values(),
                                                          enforcer.masks.values()))
    assert sync.stats["packed_reductions"] > 0, sync.stats


def test_sharded():
    model, masks = pruned_model()
    names = dict(model=model, masks=masks, torch=torch)
    exec(snippet("sharded"), names)
    optimizer = names["optimizer"]
    train_three_steps(model, masks, optimizer, comm.rank, comm.size, comm.allgather)
    survivors = sum(int(m.sum()) for m in masks.values()) + sum(
        p.numel() for name, p in model.named_parameters() if name not in masks)
    moments = optimizer.optimizer.state[optimizer.shard]["exp_avg"]
    assert moments.numel() == optimizer.shard.numel() <= -(-survivors // comm.size), (
        moments.numel(), survivors)


def test_outer():
    model, masks = pruned_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    names = dict(model=model, optimizer=optimizer, masks=masks, loss_fn=loss_fn,
                 batches=batches_of(comm.rank, comm.size, 16))  # period 16: one outer step
    exec(snippet("outer"), names)
    outer = names["outer"]
    everyone = comm.allgather(flat_weights(model))
    assert all((w == everyone[0]).all() for w in everyone), "ranks diverged"
    assert outer.outer_steps == 1 and outer.stats["packed_reductions"] > 0, outer.stats
    assert all(bool((p[~masks[n]] == 0).all()) for n, p in model.named_parameters() if n in masks)
