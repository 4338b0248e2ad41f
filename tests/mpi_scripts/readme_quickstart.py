"""Runs the README's "In your own training script" snippet verbatim on every rank."""
import re
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from pacmpi.adapters.data import iterate_minibatches, load_digits_split, shard
from pacmpi.adapters.models import build_model

readme = (Path(__file__).parents[2] / "README.md").read_text()
snippet = re.search(r"In your own training script:\n\n```python\n(.*?)```", readme, re.S).group(1)

comm = MPI.COMM_WORLD
torch.manual_seed(comm.rank)  # different initial weights: broadcast_parameters must fix that
model = build_model("digits_cnn", width=8, hidden=32)
data = load_digits_split()
x, y = shard((data.x_train, data.y_train), comm.rank, comm.size)
batches = list(iterate_minibatches(x, y, 32, seed=0, epoch=0))[:5]
loss_fn = torch.nn.functional.cross_entropy
names = dict(comm=comm, model=model, batches=batches, loss_fn=loss_fn)
exec(snippet, names)
enforcer, sync = names["enforcer"], names["sync"]

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
everyone = comm.allgather(flat)
assert all((w == everyone[0]).all() for w in everyone), "ranks diverged"
assert all(bool((p[~m] == 0).all()) for p, m in zip(enforcer.parameters.values(),
                                                      enforcer.masks.values()))
assert sync.stats["packed_reductions"] > 0, sync.stats
print(f"OK readme rank {comm.rank}", flush=True)
sys.exit(0)
