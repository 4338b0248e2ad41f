"""Mixed precision (torch.autocast, GradScaler) with PacTrain's DDP hook under ``torchrun``
(gloo), on 2 and 4 ranks: every rank runs these tests in this order (tests/test_bf16.py), and
each is reported on its own.

A float32 model under autocast has float32 gradients, so the hook reduces them as it reduces any
float32 model. What AMP needs from it: an Inf on one rank reaches every rank's reduced gradient
(lossless and ternary), so GradScaler skips that optimizer step and lowers its scale on every
rank together, and the ranks' weights stay identical.
"""
import hashlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook

import torch_world

RANK, SIZE = torch_world.join()
TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(9))
POISONED = (SIZE - 1, 2)  # (rank, step) whose gradient gets an Inf


def data(step):
    gen = torch.Generator().manual_seed(100 * step + RANK)
    x = torch.randn(32, 16, generator=gen)
    return x, x @ TEACHER


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def assert_identical(model):
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1, "ranks hold different weights"


class Run:
    """A float32 Linear-ReLU-Linear under the hook, trained under ``torch.autocast("cpu",
    dtype)``, through a GradScaler when ``scaler``; ``poison`` puts an Inf into the last
    rank's gradient of a kept coordinate at step 2. ``record`` holds, per step, whether the
    reduced gradient was finite, the scale before and after, and whether the weights moved."""

    def __init__(self, quantize, dtype, scaler=False, poison=False):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        gen = torch.Generator().manual_seed(1)
        masks = {n: torch.rand(p.shape, generator=gen) < 0.6
                 for n, p in self.model.named_parameters() if p.dim() == 2}
        masks["2.weight"][0, 0] = True
        self.ddp = DDP(self.model)
        self.ddp.register_comm_hook(PacTrainHookState(self.ddp, masks, quantize=quantize),
                                    pactrain_hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
        self.dtype, self.poison, self.step_index = dtype, poison, 0
        self.model[2].weight.register_hook(self._poisoned)
        self.losses, self.record = [], []

    def _poisoned(self, grad):
        if not self.poison or (RANK, self.step_index) != POISONED:
            return grad
        grad = grad.clone()
        grad[0, 0] = math.inf
        return grad

    def step(self):
        x, target = data(self.step_index)
        with torch.autocast("cpu", dtype=self.dtype):
            loss = (self.ddp(x).float() - target).pow(2).mean()
        self.optimizer.zero_grad()
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in self.model.parameters())
        before = [p.detach().clone() for p in self.model.parameters()]
        scale = self.scaler.get_scale() if self.scaler else None
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, self.model.parameters()))
        self.record.append((finite, scale, self.scaler.get_scale() if self.scaler else None,
                            moved))
        self.losses.append(loss.item())
        self.step_index += 1


def trained(steps, *args, **kw):
    run = Run(*args, **kw)
    for _ in range(steps):
        run.step()
    assert_identical(run.model)
    return run


def learned(losses):
    """The last steps' loss is below a third of the first steps'."""
    return sum(losses[-3:]) < sum(losses[:3]) / 3


# ---------------------------------------------------------------------------------- scenarios
def test_bf16_autocast():
    """A float32 model under bf16 autocast trains with the hook, lossless and ternary."""
    for quantize in (None, "ternary"):
        run = trained(30, quantize, torch.bfloat16)
        assert learned(run.losses), (quantize, run.losses)


def test_fp16_grad_scaler():
    """fp16 autocast with GradScaler("cpu") trains with the hook, lossless and ternary, and
    no step overflows."""
    for quantize in (None, "ternary"):
        run = trained(30, quantize, torch.float16, scaler=True)
        assert learned(run.losses), (quantize, run.losses)
        assert all(finite and moved for finite, _, _, moved in run.record), run.record


def test_overflow_skipped_together():
    """An Inf in one rank's gradient at step 2: every rank's reduced gradient is non-finite
    there, every rank's GradScaler skips that step (weights unchanged) and halves its scale;
    the other steps move the weights at an unchanged scale (the negative control of both
    checks); weights identical on every rank. Lossless and ternary."""
    for quantize in (None, "ternary"):
        run = trained(5, quantize, torch.float16, scaler=True, poison=True)
        for step, (finite, before, after, moved) in enumerate(run.record):
            skipped = step == POISONED[1]
            assert finite != skipped and moved != skipped, (quantize, step, run.record)
            assert after == (before / 2 if skipped else before), (quantize, step, run.record)
