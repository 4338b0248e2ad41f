"""Checkpoint / resume of a raw PacTrainSync loop: every rank runs these tests in this order
under mpirun (tests/test_torch_sync.py), and each is reported on its own. Checkpoints go under
$PACMPI_TEST_WORKDIR.

Same world size: train STEPS steps uninterrupted; train K steps, save, rebuild model /
optimizer / sync from scratch (different init), load, train the rest: the final weights must be
bit-identical to the uninterrupted run's on every rank. The model has dropout, so the restored
torch RNG matters (negative control: resuming without RNG restore differs).

Another world size: ``test_save_at_4_ranks`` on 4 ranks, then ``test_resume_at_2_ranks`` on 2:
the resume warns and trains on with identical weights on every rank.
"""
import hashlib
import os
import warnings

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi.adapters.checkpoint import load_checkpoint, save_checkpoint
from pacmpi.adapters.pruning import MaskEnforcer, prune
from pacmpi.adapters.torch_sync import broadcast_parameters
from pacmpi.experiments.baselines import make_sync

comm = MPI.COMM_WORLD
rank = comm.rank
WORKDIR = os.environ["PACMPI_TEST_WORKDIR"]
RESIZED = os.path.join(WORKDIR, "resized")  # saved on 4 ranks, resumed on 2
STEPS, K = 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(48, 10))

    def forward(self, x):
        return self.net(x)


def setup(method, seed):
    torch.manual_seed(seed)
    model = Net()
    broadcast_parameters(model)
    masks = prune(model, 0.6, comm=comm)
    enforcer = MaskEnforcer(model, masks)
    sync = make_sync(model, method, masks=masks, comm=comm.Dup(),
                     **({} if method == "topk" else {"bucket_bytes": 2048}),
                     **({"error_feedback": True} if method == "pactrain-ternary" else {}))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sync.attach(opt)
    enforcer.attach(opt)
    torch.manual_seed(100 + rank)  # per-rank dropout stream
    return model, enforcer, sync, opt


def steps(model, sync, opt, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())
                          ).hexdigest()


def identical(model):
    return len(set(comm.allgather(digest(model)))) == 1


def resume(method, path, seed):
    model, enforcer, sync, opt = setup(method, seed)
    where = load_checkpoint(path, model=model, optimizer=opt, sync=sync)
    enforcer.update(sync.masks)
    return model, sync, opt, where


def resume_is_bit_exact(method):
    directory = os.path.join(WORKDIR, method)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "ckpt.pt")
    model, _, sync, opt = setup(method, 0)
    steps(model, sync, opt, 0, STEPS)
    reference = digest(model)

    model, _, sync, opt = setup(method, 0)
    steps(model, sync, opt, 0, K)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0,
                    extra={"note": "k"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same world size: nothing to warn about
        model, sync, opt, where = resume(method, path, seed=rank + 5)
    assert where["step"] == K and where["extra"] == {"note": "k"}, where
    steps(model, sync, opt, K, STEPS)
    assert digest(model) == reference, "resumed run differs from the uninterrupted one"
    assert identical(model)

    # Negative control: without the restored dropout RNG the run must differ.
    model, sync, opt, _ = resume(method, path, seed=0)
    torch.manual_seed(12345)
    steps(model, sync, opt, K, STEPS)
    assert digest(model) != reference, "negative control: RNG state had no effect"
    files = sorted(os.listdir(directory))
    assert not [f for f in files if f.endswith(".tmp")], files


def test_resume_is_bit_exact_pactrain_ternary():
    resume_is_bit_exact("pactrain-ternary")


def test_resume_is_bit_exact_topk():
    resume_is_bit_exact("topk")


def test_save_at_4_ranks():
    assert comm.size == 4, comm.size
    os.makedirs(RESIZED, exist_ok=True)
    path = os.path.join(RESIZED, "ckpt.pt")
    model, _, sync, opt = setup("pactrain-ternary", 0)
    steps(model, sync, opt, 0, K)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0)  # overwrite


def test_resume_at_2_ranks():
    """Resuming the 4-rank checkpoint warns about the world size, the residuals (re-laid: each
    rank starts from their mean) and the RNG states, and trains on with identical weights on
    every rank."""
    assert comm.size == 2, comm.size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, sync, opt, where = resume("pactrain-ternary", os.path.join(RESIZED, "ckpt.pt"),
                                         seed=rank + 5)
    assert where["world_size"] == 4, where
    steps(model, sync, opt, K, STEPS)
    assert identical(model)
    warned = "\n".join(str(w.message) for w in caught)
    for needle in ("resuming at world size 2 from a checkpoint taken at 4: each rank starts "
                   "from the mean of the 4 ranks' error-feedback residuals",
                   "per-rank RNG states are reseeded"):
        assert needle in warned, (needle, warned)
    # Stale per-rank files of older checkpoints were removed; the current ones remain.
    files = sorted(os.listdir(RESIZED))
    assert files[0] == "ckpt.pt" and len(files) == 5, files
    assert not any(f.endswith(".tmp") for f in files), files
