"""An elastic Horovod job with PacTrainCompressor, for tests/test_horovod_elastic.py.

``hvd_elastic_train.py WORKDIR MODE KILL_AT`` under ``horovodrun --gloo`` elastic on two
one-slot hosts: a pruned linear model (MODE ``lossless``: op=hvd.Sum, or ``ternary``:
op=hvd.Sum with average=True) in ``hvd.elastic.run`` with ``TorchState(model, optimizer,
compression=compressor)``, committing every EVERY steps. The first time rank 1 completes step
KILL_AT it writes WORKDIR/killed and SIGKILLs itself: the other rank rolls back to the last
commit and goes on alone; when Horovod's blacklist cooldown readmits the host, a fresh worker
joins (a new process running this script from the top) and both go on for TAIL steps. MODE
``unmanaged``: ternary without ``compression=`` in the state (the negative control: nothing
rolls the compressor back, so its step runs ahead of the state's and the worker fails).

Checked in the workers, at every step: lossless, the reduced gradient equals
``hvd.allreduce(mask * local gradient, op=hvd.Sum)`` exactly (integer-valued gradients, so any
summation order is exact); the compressor's step follows the state's. After every change of the
world, the error-feedback residuals follow the stated rule: at the shrink each survivor starts
from its residuals at the commit divided by 2; at the growth every rank holds the survivor's
(divided by 1), equal on both ranks. At the end: pruned weights exactly 0, ranks identical.

A worker that finishes writes WORKDIR/result.<pid>.json: its rank, the world sizes the state
saw, the final step and the checks that ran, and the warnings the resets raised.
"""
import json
import os
import signal
import sys
import time
import warnings

import horovod.torch as hvd
import numpy as np
import torch

from pacmpi.adapters.horovod import PacTrainCompressor

workdir, mode, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
EVERY, TAIL, DEADLINE = 3, 4, 90  # commit period; steps after the regrowth; seconds to wait
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, *args, **kwargs: caught.append(str(message))

hvd.init()
torch.manual_seed(0)  # the same weights and masks on every worker, joined late or not
model = torch.nn.Linear(12, 6)
masks = {"weight": torch.rand(6, 12) < 0.5}
with torch.no_grad():
    model.weight.copy_(torch.randint(-2, 3, (6, 12)) * masks["weight"])
    model.bias.copy_(torch.randint(-2, 3, (6,)))
ternary = {"quantize": "ternary", "average": True, "error_feedback": True}
compressor = PacTrainCompressor(model, masks, **({} if mode == "lossless" else ternary))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=1 / 64), named_parameters=model.named_parameters(),
    compression=compressor, op=hvd.Sum)
managed = {} if mode == "unmanaged" else {"compression": compressor}
state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[], regrown_at=None, **managed)
checks = {"reference": 0, "shrink": 0, "growth": 0}
committed = {}  # this worker's residuals at its last commit


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-2, 3, (8, 12), generator=gen).float(), torch.randint(
        -2, 3, (8, 6), generator=gen).float()


def residuals():
    return {name: np.asarray(r) for name, r in compressor.state_dict()["residuals"].items()}


def check_world_change(sizes):
    """The residual rule, right after the join to a new world."""
    now = residuals()
    if sizes[-2:] == [2, 1]:  # a survivor: what it kept, over the old world size
        assert committed and now.keys() == committed.keys(), (now.keys(), committed.keys())
        for name, values in committed.items():
            assert np.array_equal(now[name], (values.astype(np.float64) / 2).astype(
                values.dtype)), name
        assert any(not np.array_equal(now[n], committed[n]) for n in committed)  # it matters
        checks["shrink"] += 1
    elif sizes[-2:] == [1, 2]:  # both ranks hold the survivor's, unchanged (divided by 1)
        everyone = hvd.allgather_object(now, name="check.growth")
        for name in everyone[0]:
            assert all(np.array_equal(r[name], everyone[0][name]) for r in everyone), name
        if committed:
            assert all(np.array_equal(now[n], committed[n]) for n in committed)
        checks["growth"] += 1


@hvd.elastic.run
def train(state):
    started = time.monotonic()
    while state.regrown_at is None or state.step < state.regrown_at + TAIL:
        assert compressor.step == state.step, f"compressor at {compressor.step}, state {state.step}"
        if not state.sizes or state.sizes[-1] != hvd.size():
            state.sizes = [*state.sizes, hvd.size()]
            if mode != "lossless" and len(state.sizes) > 1:
                check_world_change(state.sizes)
            if state.sizes[-2:] == [1, 2]:
                state.regrown_at = state.step
        assert time.monotonic() - started < DEADLINE, f"no regrowth in {DEADLINE}s: {state.sizes}"
        x, t = batch(state.step, hvd.rank())
        local = torch.autograd.grad((model(x) * t).sum(), model.weight)[0]
        optimizer.zero_grad()
        (model(x) * t).sum().backward()
        optimizer.synchronize()
        if mode == "lossless":
            expected = hvd.allreduce(local * masks["weight"], op=hvd.Sum,
                                     name=f"check.reference.{state.step}")
            assert torch.equal(model.weight.grad, expected), f"step {state.step}"
            checks["reference"] += 1
        with optimizer.skip_synchronize():
            optimizer.step()
        state.step += 1
        if state.step % EVERY == 0:
            committed.clear()  # what commit() saves (it may raise: hosts changed)
            committed.update(residuals())
            state.commit()
        marker = os.path.join(workdir, "killed")
        if state.step == kill_at and hvd.rank() == 1 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"rank 1 at step {state.step}")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)  # leaves the driver time to readmit the host while one rank trains


train(state)
assert torch.count_nonzero(model.weight.detach()[~masks["weight"]]) == 0, "a pruned weight moved"
weights = hvd.allgather_object(model.state_dict(), name="check.weights")
assert all(torch.equal(w[k], weights[0][k]) for w in weights for k in w), "ranks differ"
with open(os.path.join(workdir, f"result.{os.getpid()}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "sizes": state.sizes,
               "step": state.step, "regrown_at": state.regrown_at, "checks": checks,
               "stats": compressor.stats, "warnings": caught}, f)
