"""bfloat16 through PacTrain's DDP hook under ``torchrun`` (gloo), on 2 and 4 ranks: every rank
runs these tests in this order (tests/test_bf16.py), and each is reported on its own.

The model mixes dtypes as bf16 models do (bfloat16 linear layers around a float32 LayerNorm), so
DDP has a bucket per dtype. The data is random, not integers: sums round, and at 4 ranks their
order shows (see bf16_reference.py). Every step starts the hooked and the reference model (DDP's
default all-reduce, masked afterwards) from the same weights and data; their reduced gradients
must equal bit for bit at 2 ranks, and at 4 ranks each must be every rank's masked local
gradient added in some order (gloo's order follows a coordinate's place in the payload).

scripts/gpu_check.sh runs test_match on CUDA tensors: ``PACMPI_TEST_DEVICE=cuda`` and
``PACMPI_TEST_BACKEND=nccl`` (or gloo, which takes CUDA tensors too, where ranks share a GPU).
"""
import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.pruning import MaskEnforcer

import torch_world
from bf16_reference import MixedBF16, in_some_order

DEVICE = torch.device(os.environ.get("PACMPI_TEST_DEVICE", "cpu"))
RANK, SIZE = torch_world.join(os.environ.get("PACMPI_TEST_BACKEND", "gloo"))
if DEVICE.type == "cuda":
    torch.cuda.set_device(RANK % torch.cuda.device_count())
SMALL = {"bucket_cap_mb": 0.0005}  # a few DDP buckets once they are rebuilt


def make_masks(model):
    gen = torch.Generator().manual_seed(1)
    return {n: (torch.rand(p.shape, generator=gen) < 0.5).to(DEVICE)
            for n, p in model.named_parameters() if p.dim() == 2}


def loss_of(model, step):
    gen = torch.Generator().manual_seed(100 * step + RANK)
    x = (torch.randn(16, 24, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    return (model(x).float() - torch.randn(16, 8, generator=gen).to(DEVICE)).pow(2).mean()


class Run:
    """A DDP run of :class:`MixedBF16`: with the PacTrain hook (``kw``: the state's options),
    keeping each step's local gradients as the hook receives them (``local``), or with DDP's
    default all-reduce (``kw`` None), its gradients masked afterwards."""

    def __init__(self, kw=None, ddp_kw=SMALL):
        self.model = MixedBF16().to(DEVICE)
        self.masks = make_masks(self.model)
        self.ddp = DDP(self.model, **ddp_kw)
        self.enforcer = MaskEnforcer(self.model, self.masks)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=2.0 ** -4)
        self.enforcer.attach(self.optimizer)
        self.hooked, self.local = kw is not None, {}
        if self.hooked:
            self.state = PacTrainHookState(self.ddp, self.masks, **kw)
            self.ddp.register_comm_hook(self.state, self._keeping_local)

    def _keeping_local(self, state, bucket):
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            self.local[id(param)] = grad.clone()
        return pactrain_hook(state, bucket)

    def step(self, step):
        self.optimizer.zero_grad()
        loss_of(self.ddp, step).backward()
        if not self.hooked:
            self.enforcer.apply_to_grads()
        grads = [p.grad.clone() for p in self.model.parameters()]
        self.optimizer.step()
        return grads

    def masked_local(self):
        """Each parameter's local gradient of the last step, pruned coordinates 0."""
        keep = dict(zip(self.enforcer.parameters.values(), self.enforcer.masks.values()))
        return [self.local[id(p)].masked_fill(~keep[p], 0) if p in keep else self.local[id(p)]
                for p in self.model.parameters()]


def gathered(tensor):
    """``tensor`` of every rank, in rank order."""
    out = [torch.empty_like(tensor) for _ in range(SIZE)]
    dist.all_gather(out, tensor.contiguous())
    return out


def assert_summed(grads, local):
    """Each reduced gradient is the mean of every rank's masked local one, added in some
    order (at 2 ranks: the one rounding of a + b)."""
    for index, (grad, mine) in enumerate(zip(grads, local, strict=True)):
        hit = in_some_order(grad, gathered(mine), SIZE)
        assert hit.all(), f"parameter {index}: {int((~hit).sum())} coordinates are no sum"


def digest(model):
    return hashlib.sha256(b"".join(p.detach().cpu().view(-1).view(torch.uint8).numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def assert_identical(model):
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1, "ranks hold different weights"


# ---------------------------------------------------------------------------------- scenarios
def test_match():
    """The hooked bf16 model equals DDP's default all-reduce on masked gradients: bit for bit
    at 2 ranks; at 4, both are sums of the same local values in some order. Rebuilt buckets,
    one bucket per dtype, and ternary/fp16 runs whose weights stay identical on every rank."""
    for ddp_kw in (SMALL, {}):
        run, reference = Run({}, ddp_kw), Run(None, ddp_kw)
        differing = 0
        for step in range(4):
            reference.model.load_state_dict(run.model.state_dict())
            grads, want = run.step(step), reference.step(step)
            assert_summed(grads, run.masked_local())
            assert_summed(want, run.masked_local())
            differing += sum(int((g != w).sum()) for g, w in zip(grads, want))
            for param, keep in zip(run.enforcer.parameters.values(),
                                   run.enforcer.masks.values()):
                assert torch.all(param[~keep] == 0), "a pruned weight is not 0"
        assert differing == 0 or SIZE > 2, f"{differing} coordinates differ at 2 ranks"
        assert_identical(run.model)
        assert {str(b.dtype) for b in run.state.engine.buckets} == {"bfloat16", "float32"}
        assert run.state.stats["packed_reductions"] > 0, run.state.stats
    for quantize in ("fp16", "ternary"):
        run = Run({"quantize": quantize})
        for step in range(4):
            grads = run.step(step)
            assert all(torch.isfinite(g).all() for g in grads)
        assert_identical(run.model)


def test_order():
    """At 4 ranks gloo adds a coordinate's values in an order that follows its place in the
    payload: the same values all-reduced at another offset round differently somewhere; at
    2 ranks never. Negative controls: the reference rejects a sum missing one rank, and (at 4
    ranks) a sum added in float32 and rounded once."""
    gen = torch.Generator().manual_seed(RANK)
    values = (torch.randn(4000, generator=gen) * torch.exp2(
        torch.randint(-6, 7, (4000,), generator=gen).float())).to(torch.bfloat16)
    dense, shifted = values.clone(), torch.cat([torch.zeros(1000, dtype=values.dtype), values])
    dist.all_reduce(dense)
    dist.all_reduce(shifted)
    moved = int((dense != shifted[1000:]).sum())
    assert (moved > 0) == (SIZE > 2), f"{moved} of 4000 sums changed with their offset"
    every = gathered(values)
    assert in_some_order(dense, every).all() and in_some_order(shifted[1000:], every).all()
    assert not in_some_order(sum(every[1:]), every).all()
    once = sum(v.float() for v in every).to(torch.bfloat16)
    assert in_some_order(once, every).all() == (SIZE == 2)


class Scaled(nn.Module):
    """loss = sum(w * c): the gradient is exactly c."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(40, 25, dtype=torch.bfloat16))

    def forward(self, c):
        return (self.w * c).sum()


def test_ternary_float32():
    """Ternary codes of bf16 gradients are computed in float32 and keep float32 residuals:
    after one step every rank's residual r is exactly g - scale * code with code in {-1, 0, 1}
    (scale 1), and the decoded gradient is the mean of the codes. Negative control: r rounded
    to bf16 leaves codes that are not integers."""
    gen = torch.Generator().manual_seed(7 + RANK)
    grad = (torch.rand(40, 25, generator=gen) - 0.5).to(torch.bfloat16)
    grad[0, 0] = 1.0  # the agreed scale: max |g| over ranks
    mask = torch.rand(40, 25, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[0, 0] = True
    model = Scaled()
    ddp = DDP(model)
    state = PacTrainHookState(ddp, {"w": mask}, quantize="ternary", error_feedback=True)
    ddp.register_comm_hook(state, pactrain_hook)
    ddp(grad).backward()
    residual = state.state_dict()["residuals"]["w"].view(40, 25)
    assert residual.dtype == torch.float32, residual.dtype
    g = grad.float().masked_fill(~mask, 0)
    codes = g - residual
    assert torch.all((codes == codes.round()) & (codes.abs() <= 1)), "codes are not ternary"
    assert torch.all(codes[~mask] == 0)
    total = sum(gathered(codes))
    assert torch.equal(model.w.grad.float(), total / SIZE), "decoded != mean of codes"
    rounded = g - residual.to(torch.bfloat16).float()
    assert not torch.all(rounded == rounded.round()), "bf16 residuals would pass too"
    assert np.dtype(state.engine.buckets[0].dtype).name == "bfloat16"
