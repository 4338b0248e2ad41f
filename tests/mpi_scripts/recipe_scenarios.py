"""The gradual-pruning recipe (pacmpi.adapters.recipe) under PacTrainSync, per-rank data, Adam:
every rank runs these tests in this order under mpirun (tests/test_recipe.py), each reported on
its own.

1. every update leaves the masks bit-identical on every rank (digest), the last one at the
   final ratio exactly; pruned weights and Adam's state are exactly 0 after every step; only
   the linear layers outside the head are masked; the reduction falls back to dense exactly on
   the ``stable_steps`` steps after each update and packs everywhere else;
2. control: the same schedule deciding locally (no broadcast) on each rank's own data diverges
   (the masks' digests differ), and the step after the update raises MaskMismatchError on
   every rank, before the optimizer moves a weight;
3. a bad schedule raises naming the bad value on every rank.
"""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi import MaskMismatchError
from pacmpi.adapters.pruning import MaskEnforcer, masks_digest, prune
from pacmpi.adapters.recipe import cubic_milestones, gradual_schedule, linear_weights
from pacmpi.adapters.torch_sync import PacTrainSync, broadcast_parameters

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
STABLE = 2


class Tagger(nn.Module):
    """Embedding, two linear layers, a norm and a classifier head: the shape of a transformer
    encoder as far as the recipe's selection goes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)
        self.classifier = nn.Linear(16, 5)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        return self.classifier(self.norm(h + self.down(torch.relu(self.up(h)))))


def batch(step):
    g = torch.Generator().manual_seed(1000 * rank + step)  # different data on every rank
    return torch.randint(0, 40, (8, 6), generator=g), torch.randint(0, 5, (8,), generator=g)


def start():
    torch.manual_seed(rank)  # different init per rank: the broadcast must fix it
    model = Tagger()
    broadcast_parameters(model, comm=comm)
    masks = prune(model, 0.0, include=linear_weights(model), comm=comm)  # all kept
    enforcer = MaskEnforcer(model, masks)
    sync = PacTrainSync(model, comm=comm, masks=masks, stable_steps=STABLE, bucket_bytes=2048)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sync.attach(optimizer)
    enforcer.attach(optimizer)
    return model, enforcer, sync, optimizer


def train_step(model, optimizer, step):
    x, y = batch(step)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_updates_agree_and_dense_steps_follow_them():
    model, enforcer, sync, optimizer = start()
    assert list(enforcer.masks) == ["up.weight", "down.weight"]
    schedule = gradual_schedule(model, final=0.8, steps=9, every=3)
    updates = [s for s, _ in schedule.milestones]
    assert updates == [3, 6, 9], schedule.milestones
    dense = []
    for step in range(14):
        new = schedule.step(model, step, comm=comm)
        assert (new is not None) == (step in updates), step
        if new is not None:
            digests = comm.allgather(masks_digest(new))
            assert len(set(digests)) == 1, f"step {step}: masks differ: {digests}"
            enforcer.update(new)
            sync.set_masks(new)
        train_step(model, optimizer, step)
        dense.append(sync.last_step["dense_fallbacks"] > 0)
        for name, param in enforcer.parameters.items():
            pruned = ~enforcer.masks[name]
            assert (param[pruned] == 0).all(), f"step {step}: pruned {name} moved"
            for key, value in optimizer.state[param].items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    assert (value[pruned] == 0).all(), f"step {step}: Adam's {key} of {name}"
    kept = sum(int(m.sum()) for m in enforcer.masks.values())
    total = sum(m.numel() for m in enforcer.masks.values())
    assert total - kept == round(0.8 * total), (kept, total)
    expected = [any(u <= s < u + STABLE for u in updates) for s in range(14)]
    assert dense == expected, (dense, expected)
    assert sync.stats["dense_fallbacks"] > 0 and sync.last_step["packed_reductions"] > 0


def test_local_decisions_diverge_and_are_caught():
    model, enforcer, sync, optimizer = start()
    schedule = gradual_schedule(model, final=0.5, steps=2, every=2, method="taylor")
    train_step(model, optimizer, 0)
    train_step(model, optimizer, 1)
    # Taylor scores each rank's own batch: without comm every rank decides for itself.
    new = schedule.step(model, 2, data=[batch(2)], loss_fn=F.cross_entropy)
    digests = comm.allgather(masks_digest(new))
    assert len(set(digests)) == size, f"the control needs diverging masks: {digests}"
    enforcer.update(new)
    sync.set_masks(new)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MaskMismatchError, match="offending ranks"):
        train_step(model, optimizer, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), \
        "a weight moved in the step that raised"


BAD = [({"final": 0.5, "initial": 0.6}, "final ratio 0.5 is below the initial ratio 0.6"),
       ({"final": 1.0}, "final ratio must be a number in [0, 1), got 1.0"),
       ({"final": -0.1}, "final ratio must be a number in [0, 1), got -0.1"),
       ({"final": 0.5, "initial": 1.2}, "initial ratio must be a number in [0, 1), got 1.2"),
       ({"final": 0.5, "steps": 0}, "steps must be an int >= 1, got 0"),
       ({"final": 0.5, "every": -2}, "every must be an int >= 1, got -2"),
       ({"final": 0.5, "every": 0}, "every must be an int >= 1, got 0"),
       ({"final": 0.0}, "a final ratio of 0.0 prunes nothing")]


def test_bad_schedules_raise_on_every_rank():
    for kwargs, named in BAD:
        arguments = {"steps": 10, "every": 2, **kwargs}
        with pytest.raises(ValueError) as caught:
            cubic_milestones(arguments.pop("final"), **arguments)
        assert named in str(caught.value), str(caught.value)
        assert comm.allgather(str(caught.value)) == [str(caught.value)] * size
