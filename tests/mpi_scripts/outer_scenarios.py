"""OuterSync invariants at any rank count under mpirun (tests/test_outer.py), each reported on
its own. Every rank trains on data of its own, so only the outer steps make weights agree.

1. period 1, plain SGD inner steps, outer lr 1 and momentum 0 is synchronous PacTrain
   (PacTrainSync) of the same gradients: bit for bit on integer-valued data (a linear model,
   lr a power of two: no sum or difference rounds); on a CNN within float32 rounding (1e-6);
2. period 3, DiLoCo's outer Nesterov: after every outer step all ranks hold bit-identical
   weights (and different ones between outer steps); pruned weights, inner and outer momentum
   exactly 0; inner steps send nothing and an outer step sends what the reducer's packed
   all-reduce of the survivors sends;
3. ternary with error feedback: residuals carried from one outer step to the next (a control
   that clears them ends elsewhere);
4. masks set mid-period take effect at the next outer step (global weights and outer momentum
   zeroed off them, only the new survivors sent there);
5. buffers: "average" makes BatchNorm statistics the ranks' mean at outer steps, "local"
   leaves them;
6. bad input raises on every rank together, naming the value; a mask differing on one rank
   is a MaskMismatchError at the outer step;
7. a checkpoint mid-period (save_checkpoint / load_checkpoint) resumes bit for bit, and at
   another world size (taken on half the ranks) from rank 0's local state and the global
   weights, equal on every rank again after the period's outer step; the object pickles
   without its communicator.
"""
import contextlib
import hashlib
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi import MaskMismatchError, PacTrainReducer
from pacmpi.adapters.checkpoint import load_checkpoint, save_checkpoint
from pacmpi.adapters.convert import as_array
from pacmpi.adapters.outer import OuterSync
from pacmpi.adapters.pruning import MaskEnforcer, prune
from pacmpi.adapters.torch_sync import PacTrainSync, broadcast_parameters
from pacmpi.errors import RankInputError
from pacmpi.experiments.models import DigitsCNN

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])


def digests(tensors):
    return comm.allgather(hashlib.sha256(flat(tensors).numpy().tobytes()).hexdigest())


def images(step):
    g = torch.Generator().manual_seed(1000 * rank + step)  # different data on every rank
    return torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def cnn(seed=0):
    torch.manual_seed(seed + rank)  # different init per rank: OuterSync broadcasts rank 0's
    return DigitsCNN(width=4, hidden=16)


def inner_step(model, optimizer, step):
    x, y = images(step)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def pruned_cnn(ratio=0.5, seed=0, lr=0.05, **outer):
    model = cnn(seed)
    masks = prune(model, ratio, comm=comm)
    enforcer = MaskEnforcer(model, masks)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    enforcer.attach(optimizer)
    return model, masks, optimizer, OuterSync(model, optimizer, masks=masks, **outer)


# ---------------------------------------------------------------------------- 1. period 1
class IntegerLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():  # the same integer weights on every rank
            g = torch.Generator().manual_seed(7)
            self.fc.weight.copy_(torch.randint(-2, 3, (4, 8), generator=g))
            self.fc.bias.copy_(torch.randint(-2, 3, (4,), generator=g))

    def forward(self, x):
        return self.fc(x)


def integer_batch(step):
    # Small integers and lr 2**-4: after 4 steps every value still fits float32's 24 bits.
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randint(-1, 2, (2, 8), generator=g).float(),
            torch.randint(-2, 3, (2, 4), generator=g).float())


def run_period_1(build, batch, loss_fn, lr, steps, synchronous):
    model = build()
    broadcast_parameters(model, comm=comm)
    masks = prune(model, 0.5, comm=comm)
    MaskEnforcer(model, masks)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if synchronous:
        PacTrainSync(model, masks=masks).attach(optimizer)
    else:
        OuterSync(model, optimizer, period=1, masks=masks, outer_lr=1, outer_momentum=0)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return flat(model.parameters())


def test_period_1_is_synchronous_pactrain_bit_for_bit():
    def half_squares(out, y):
        return 0.5 * ((out - y) ** 2).sum()  # integer gradients

    runs = [run_period_1(IntegerLinear, integer_batch, half_squares, 2.0 ** -4, 4, sync)
            for sync in (True, False)]
    assert torch.equal(runs[0], runs[1]), (runs[0] - runs[1]).abs().max()
    assert not torch.equal(runs[0], flat(IntegerLinear().parameters()))


def test_period_1_is_synchronous_pactrain_within_rounding():
    runs = [run_period_1(cnn, images, F.cross_entropy, 0.1, 4, sync) for sync in (True, False)]
    assert torch.allclose(runs[0], runs[1], rtol=1e-6, atol=1e-6), (
        runs[0] - runs[1]).abs().max()


# ---------------------------------------------------------------------------- 2. period 3
def test_identical_after_outer_steps_pruned_zero_and_bytes():
    model, masks, optimizer, outer = pruned_cnn(period=3, buffers="local", bucket_bytes=4096)
    params = dict(model.named_parameters())
    survivors = sum(int(m.sum()) for m in masks.values()) + sum(
        p.numel() for name, p in params.items() if name not in masks)
    for step in range(9):
        sent = outer.stats["bytes_sent"]
        inner_step(model, optimizer, step)
        if outer.step_in_period:
            assert outer.stats["bytes_sent"] == sent, "an inner step communicated"
            assert len(set(digests(model.parameters()))) == size, f"step {step}: no local steps"
            continue
        assert len(set(digests(model.parameters()))) == 1, f"step {step}: ranks differ"
        assert torch.equal(flat(outer.params), flat(outer.globals))
        for name, keep in masks.items():
            i = outer.names.index(name)
            momentum = outer.outer_optimizer.state[outer.globals[i]]["momentum_buffer"]
            for what, t in (("weight", params[name]), ("global", outer.globals[i]),
                            ("inner momentum", optimizer.state[params[name]]["momentum_buffer"]),
                            ("outer momentum", momentum)):
                assert bool((t[~keep] == 0).all()), f"step {step}: pruned {name} {what} moved"
        assert outer.last_outer["bytes_sent"] == 4 * survivors, (outer.last_outer, survivors)
        assert outer.last_outer["packed_reductions"] > 0 and outer.last_outer["buffer_bytes"] == 0
    assert outer.outer_steps == 3
    # The reducer's own packed all-reduce of gradients on the same masks (its second step: the
    # first is dense by its default stable_steps) sends the same bytes.
    reducer = PacTrainReducer([as_array(masks[n]) if n in masks else None for n in outer.names],
                              bucket_bytes=4096)
    grads = [as_array(torch.ones_like(p)) for p in outer.params]
    reducer.reduce(grads)
    first = reducer.stats["bytes_sent"]
    reducer.reduce(grads)
    assert reducer.stats["bytes_sent"] - first == outer.last_outer["bytes_sent"]


def test_ternary_sends_less():
    model, masks, optimizer, outer = pruned_cnn(period=2, quantize="ternary",
                                                error_feedback=True)
    for step in range(4):
        inner_step(model, optimizer, step)
    survivors = sum(int(m.sum()) for m in masks.values())
    assert 0 < outer.last_outer["bytes_sent"] < survivors, outer.last_outer
    assert len(set(digests(model.parameters()))) == 1


# ---------------------------------------------------------------------------- 3. residuals
def ternary_run(clear):
    model, masks, optimizer, outer = pruned_cnn(period=2, quantize="ternary",
                                                error_feedback=True, lr=0.2)
    for step in range(6):
        if clear and outer.step_in_period == outer.period - 1:
            state = outer.reducer.state_dict()
            state["residuals"] = {}
            outer.reducer.load_state_dict(state)
        inner_step(model, optimizer, step)
        if step == 1:
            kept = outer.reducer.state_dict()["residuals"]
            assert kept and any(np.abs(r).max() > 0 for r in kept.values()), kept
    return flat(model.parameters())


def test_ternary_residuals_carried_across_outer_steps():
    carried, cleared = ternary_run(clear=False), ternary_run(clear=True)
    assert not torch.equal(carried, cleared), "residuals made no difference"


# ---------------------------------------------------------------------------- 4. masks
def test_masks_change_at_outer_steps():
    model, masks, optimizer, outer = pruned_cnn(ratio=0.3, period=2, bucket_bytes=4096)
    enforcer_masks = None
    for step in range(8):
        if step == 3:  # mid-period
            enforcer_masks = prune(model, 0.6, current_masks=masks, comm=comm)
            outer.set_masks(enforcer_masks)
            assert all(torch.equal(outer.masks[n], masks[n]) for n in masks), "took effect early"
        inner_step(model, optimizer, step)
        if step == 3:
            assert all(torch.equal(outer.masks[n], enforcer_masks[n]) for n in masks)
            survivors = sum(int(m.sum()) for m in enforcer_masks.values()) + sum(
                p.numel() for n, p in model.named_parameters() if n not in masks)
            assert outer.last_outer["bytes_sent"] == 4 * survivors, (outer.last_outer, survivors)
            for name, keep in enforcer_masks.items():
                i = outer.names.index(name)
                momentum = outer.outer_optimizer.state[outer.globals[i]]["momentum_buffer"]
                assert bool((outer.globals[i][~keep] == 0).all()), name
                assert bool((momentum[~keep] == 0).all()), name
    assert len(set(digests(model.parameters()))) == 1


# ---------------------------------------------------------------------------- 5. buffers
def test_buffers_average_or_local():
    for policy in ("average", "local"):
        model, _, optimizer, outer = pruned_cnn(period=2, buffers=policy)
        inner_step(model, optimizer, 0)
        model.train()
        x, y = images(1)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = [b.detach().clone() for b in model.buffers() if b.is_floating_point()]
        mean = [torch.from_numpy(sum(comm.allgather(b.numpy().astype(np.float64))) / size)
                for b in before]
        optimizer.step()  # the outer step
        after = [b for b in model.buffers() if b.is_floating_point()]
        if policy == "average":
            assert len(set(digests(after))) == 1
            assert all(torch.allclose(a.double(), m, rtol=1e-6) for a, m in zip(after, mean))
            assert outer.last_outer["buffer_bytes"] == sum(b.numel() * 4 for b in before)
        else:
            assert len(set(digests(after))) == size and all(map(torch.equal, after, before))


# ---------------------------------------------------------------------------- 6. bad input
def raises_on_every_rank(build, match):
    with pytest.raises(RankInputError, match=match):
        build()


def test_bad_input_raises_on_every_rank():
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    raises_on_every_rank(lambda: OuterSync(model, optimizer, period=0 if rank == size - 1
                                           else 2), rf"rank {size - 1}: .*period .* got 0")
    raises_on_every_rank(lambda: OuterSync(model, optimizer, period=2, outer_lr=-0.5),
                         r"outer_lr must be a positive float, got -0.5")
    raises_on_every_rank(lambda: OuterSync(model, optimizer, period=2, outer_momentum=-1),
                         r"outer_momentum must be >= 0, got -1")
    raises_on_every_rank(lambda: OuterSync(model, optimizer, period=2, buffers="sum"),
                         r"buffers must be one of .* got 'sum'")
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(3, 2))] if rank == 0
                              else model.parameters(), lr=0.1)
    raises_on_every_rank(lambda: OuterSync(model, foreign, period=2),
                         r"rank 0: .*param_groups\[0\]\['params'\]\[0\] \(shape \(3, 2\)\) is "
                         r"not a trainable parameter")


def test_mask_differing_on_one_rank_at_an_outer_step():
    model, masks, optimizer, outer = pruned_cnn(period=2)
    inner_step(model, optimizer, 0)
    other = {name: m.clone() for name, m in masks.items()}
    if rank == size - 1:
        name = next(iter(other))
        other[name].view(-1)[0] = ~other[name].view(-1)[0]
    outer.set_masks(other)
    with pytest.raises(MaskMismatchError):
        inner_step(model, optimizer, 1)


# ---------------------------------------------------------------------------- 7. checkpoints
@contextlib.contextmanager
def shared_directory():
    """A temporary directory rank 0 makes and, once every rank is done with it, removes."""
    directory = Path(comm.bcast(tempfile.mkdtemp(prefix="pacmpi-outer-") if rank == 0
                                else None))
    yield directory
    comm.Barrier()  # kept where a scenario failed, to look at
    if rank == 0:
        shutil.rmtree(directory)


def adam_run(steps, checkpoint_at=None, directory=None, world=comm):
    model = cnn()
    masks = prune(model, 0.5, comm=world)
    enforcer = MaskEnforcer(model, masks)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    enforcer.attach(optimizer)
    outer = OuterSync(model, optimizer, period=3, masks=masks, quantize="ternary",
                      error_feedback=True, comm=world)
    start = 0
    if checkpoint_at is not None and directory is not None:
        torch.manual_seed(99 + rank)  # a fresh process would start elsewhere: the load decides
        start = load_checkpoint(directory / "ckpt", model=model, optimizer=optimizer,
                                sync=outer)["step"]
    for step in range(start, steps):
        if step == checkpoint_at and directory is None:
            return outer
        inner_step(model, optimizer, step)
    return outer


def test_checkpoint_mid_period_resumes_bit_for_bit():
    with shared_directory() as directory:
        whole = adam_run(7)
        half = adam_run(7, checkpoint_at=4)
        assert half.step_in_period == 1
        save_checkpoint(directory / "ckpt", model=half.model, optimizer=half.optimizer,
                        sync=half, step=4, epoch=0)
        resumed = adam_run(7, checkpoint_at=4, directory=directory)
        for what in ("model", "globals"):
            a = flat(whole.model.parameters() if what == "model" else whole.globals)
            b = flat(resumed.model.parameters() if what == "model" else resumed.globals)
            assert torch.equal(a, b), f"{what}: {(a - b).abs().max()}"
        assert len(set(digests(resumed.model.parameters()))) == size  # mid-period: local
        assert resumed.outer_steps == whole.outer_steps == 2


def test_a_checkpoint_resumes_at_another_world_size():
    """Taken mid-period on the first half of the ranks, resumed on all of them: every rank
    continues from rank 0's local state and the global weights, and the period's outer step
    makes them all equal again."""
    with shared_directory() as directory:
        first, saved = comm.Split(0 if rank < size // 2 else MPI.UNDEFINED, rank), None
        if first != MPI.COMM_NULL:
            half = adam_run(7, checkpoint_at=4, world=first)
            save_checkpoint(directory / "ckpt", model=half.model, optimizer=half.optimizer,
                            sync=half, step=4, epoch=0)
            saved = flat(half.globals), flat(half.model.parameters())
            first.Free()
        saved_globals, saved_local = comm.bcast(saved)  # rank 0's
        resized = (f"resuming at world size {size} from a checkpoint taken at {size // 2}: "
                   "each rank starts from the mean")
        with pytest.warns(RuntimeWarning, match=resized):
            resumed = adam_run(4, checkpoint_at=4, directory=directory)  # loads, takes no step
        assert torch.equal(flat(resumed.globals), saved_globals)
        assert torch.equal(flat(resumed.model.parameters()), saved_local)
        assert resumed.step_in_period == 1
        for step in (4, 5):  # the period's last two steps: its outer step follows step 5
            inner_step(resumed.model, resumed.optimizer, step)
        assert resumed.outer_steps == 2 and resumed.step_in_period == 0
        assert len(set(digests(resumed.model.parameters()))) == 1
        assert not torch.equal(flat(resumed.globals), saved_globals)


def test_pickles_without_its_communicator():
    outer = adam_run(4)
    copy = pickle.loads(pickle.dumps(outer))  # an MPI communicator would not pickle
    state, again = outer.state_dict(), copy.state_dict()
    assert torch.equal(flat(state["global"]), flat(again["global"]))
    assert again["step_in_period"] == 1 and again["world_size"] == size
