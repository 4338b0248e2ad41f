"""MPI worker: checkpoint / resume of a raw PacTrainSync loop.

``sync_checkpoint.py same DIR METHOD``: train STEPS steps uninterrupted; train K steps, save,
rebuild model / optimizer / sync from scratch (different init), load, train the rest: the final
weights must be bit-identical to the uninterrupted run's on every rank. The model has dropout,
so the restored torch RNG matters (negative control: resuming without RNG restore differs).

``sync_checkpoint.py save DIR METHOD`` then ``sync_checkpoint.py resume DIR METHOD`` at another
world size: the resume warns (RuntimeWarning, printed as ``WARNED: ...``) and trains on with
identical weights on every rank.
"""
import hashlib
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi.adapters.checkpoint import load_checkpoint, save_checkpoint
from pacmpi.adapters.pruning import MaskEnforcer, prune
from pacmpi.adapters.torch_sync import broadcast_parameters, make_sync

comm = MPI.COMM_WORLD
rank = comm.rank
mode, directory, method = sys.argv[1], sys.argv[2], sys.argv[3]
path = os.path.join(directory, "ckpt.pt")
STEPS, K = 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(48, 10))

    def forward(self, x):
        return self.net(x)


def setup(seed):
    torch.manual_seed(seed)
    model = Net()
    broadcast_parameters(model)
    masks = prune(model, 0.6, comm=comm)
    enforcer = MaskEnforcer(model, masks)
    sync = make_sync(model, method, masks=masks, comm=comm.Dup(),
                     **({} if method == "topk" else {"bucket_bytes": 2048}))
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


def resume(seed):
    model, enforcer, sync, opt = setup(seed)
    where = load_checkpoint(path, model=model, optimizer=opt, sync=sync)
    enforcer.update(sync.masks)
    return model, sync, opt, where


if mode == "same":
    model, _, sync, opt = setup(0)
    steps(model, sync, opt, 0, STEPS)
    reference = digest(model)

    model, _, sync, opt = setup(0)
    steps(model, sync, opt, 0, K)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0,
                    extra={"note": "k"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same world size: nothing to warn about
        model, sync, opt, where = resume(seed=rank + 5)
    assert where["step"] == K and where["extra"] == {"note": "k"}, where
    rng = torch.get_rng_state()
    steps(model, sync, opt, K, STEPS)
    assert digest(model) == reference, "resumed run differs from the uninterrupted one"
    assert identical(model)

    # Negative control: without the restored dropout RNG the run must differ.
    model, sync, opt, _ = resume(seed=0)
    torch.manual_seed(12345)
    steps(model, sync, opt, K, STEPS)
    assert digest(model) != reference, "negative control: RNG state had no effect"
    files = sorted(os.listdir(directory))
    assert not [f for f in files if f.endswith(".tmp")], files
    if rank == 0:
        print(f"OK same {method}: bit-identical after resume; files {files}", flush=True)
elif mode == "save":
    model, _, sync, opt = setup(0)
    steps(model, sync, opt, 0, K)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0)
    save_checkpoint(path, model=model, optimizer=opt, sync=sync, step=K, epoch=0)  # overwrite
    if rank == 0:
        print(f"OK save {method}: {sorted(os.listdir(directory))}", flush=True)
elif mode == "resume":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, sync, opt, where = resume(seed=rank + 5)
    steps(model, sync, opt, K, STEPS)
    assert identical(model)
    for w in caught:
        if rank == 0:
            print(f"WARNED: {w.message}", flush=True)
    if rank == 0:
        print(f"OK resume {method} from world size {where['world_size']} at {comm.size}", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
