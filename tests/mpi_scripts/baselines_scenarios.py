"""TernGradSync / DGCSync invariants: every rank runs these tests in this order under mpirun
(tests/test_baselines.py), and each is reported on its own.

- ``test_terngrad_exact``: values in {-s, 0, s} (s each rank's own per-layer scale) decode exactly:
  the average equals the exact average bit for bit; each rank sends ceil(n/4) code bytes plus
  one float32 scale per layer.
- ``test_terngrad_unbiased``: over many steps (fresh random draws each) the mean decoded average
  approaches the exact average within 5 standard errors per coordinate (the standard error
  from TernGrad's own variance ``s |g| - g^2``), and the standardized errors have about unit
  variance (the noise is real and of the predicted size).
- ``test_dgc_dense``: DGC keeping everything (ratio 1) without momentum masking is dense momentum
  SGD bit for bit (integer-valued gradients, momentum 0.5); with momentum masking it is plain
  SGD bit for bit.
- ``test_dgc_conservation``: each step, per rank, sent + residual == accumulated (v + u) exactly,
  the sent values are each layer's largest, the velocity is cleared where sent, and the sum of
  what the ranks sent is what lands (times n) in ``p.grad``.
- ``test_identical``: a small CNN trained on per-rank data through each baseline: every rank holds
  bit-identical weights after every step.
"""
import hashlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi.adapters.torch_sync import broadcast_parameters
from pacmpi.experiments.baselines import DGCSync, TernGradSync, make_sync
from pacmpi.experiments.models import DigitsCNN

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
SHAPES = [(3, 5), (7,), (2, 2, 3)]


class Params(nn.Module):
    """Bare parameters; ``backward(grads)`` makes each ``p.grad`` exactly ``grads[i]``."""

    def __init__(self, init=None):
        super().__init__()
        self.ps = nn.ParameterList(
            nn.Parameter(torch.zeros(s) if init is None else init[i].clone())
            for i, s in enumerate(SHAPES))

    def backward(self, grads):
        self(None)  # the forward pre-hook marks the step started
        sum((p * g).sum() for p, g in zip(self.ps, grads)).backward()

    def forward(self, x):
        return x


def exact_average(local):
    out = []
    for g in local:
        total = g.to(torch.float64).numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        out.append(torch.from_numpy(total / size))
    return out


def grads_of(model):
    # The sync's parameter order is reversed (as DDP's); compare by parameter.
    return [p.grad.detach().clone() for p in model.ps]


def test_terngrad_exact():
    g = torch.Generator().manual_seed(100 + rank)
    local = []
    for j, shape in enumerate(SHAPES):
        s = float(2 * (rank + 1) + j)  # every rank and layer its own scale
        values = torch.randint(-1, 2, shape, generator=g).float() * s
        values.view(-1)[0] = s  # the scale is attained
        local.append(values)
    model = Params()
    sync = TernGradSync(model, clip=None, seed=3)
    for _ in range(3):
        model.backward(local)
        sync.synchronize()
        for got, want in zip(grads_of(model), exact_average(local)):
            assert torch.equal(got, want.float()), (got, want)
        for p in model.ps:
            p.grad = None
    numel = sum(math.prod(s) for s in SHAPES)
    assert sync.stats["bytes_sent"] == 3 * (math.ceil(numel / 4) + 4 * len(SHAPES)), sync.stats


def test_terngrad_unbiased(steps=400):
    g = torch.Generator().manual_seed(200 + rank)
    local = [torch.randn(shape, generator=g) for shape in SHAPES]
    model = Params()
    sync = TernGradSync(model, clip=None, seed=11)
    total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for _ in range(steps):
        model.backward(local)
        sync.synchronize()
        for t, got in zip(total, grads_of(model)):
            t += got
        for p in model.ps:
            p.grad = None
    # Var(s q) = s |g| - g^2 per rank, independent across ranks.
    variance = [(g.abs().max() * g.abs() - g * g).double().numpy() for g in local]
    for v in variance:
        comm.Allreduce(MPI.IN_PLACE, v, op=MPI.SUM)
    z = []
    for t, want, v in zip(total, exact_average(local), variance):
        se = np.sqrt(v / size ** 2 / steps)
        diff = (t / steps - want).numpy()
        assert np.all(np.abs(diff) <= 5 * se + 1e-6), (diff, se)
        z.append(diff[se > 0] / se[se > 0])
    z = np.concatenate(z)
    assert 0.3 < float(np.mean(z ** 2)) < 3.0, np.mean(z ** 2)


def integer_grads(step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randint(-8, 9, s, generator=g).float() for s in SHAPES]


def train_params(sync_factory, momentum, steps=6):
    init = [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for s in SHAPES]
    model = Params(init)
    sync = sync_factory(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=momentum)
    sync.attach(opt)
    for step in range(steps):
        opt.zero_grad()
        model.backward(integer_grads(step))
        opt.step()
    return [p.detach().clone() for p in model.ps]


def test_dgc_dense():
    dense = {m: train_params(lambda model: make_sync(model, "dense"), momentum=m)
             for m in (0.5, 0.0)}
    dgc = {masking: train_params(lambda model: DGCSync(model, ratio=1.0, momentum=0.5,
                                                       momentum_masking=masking), momentum=0.0)
           for masking in (False, True)}
    for masking, momentum in ((False, 0.5), (True, 0.0)):
        for a, b in zip(dgc[masking], dense[momentum]):
            assert torch.equal(a, b), (masking, a, b)
    # Negative control: masking changes the result, so the comparisons above have teeth.
    assert any(not torch.equal(a, b) for a, b in zip(dgc[True], dense[0.5]))


def test_dgc_conservation(steps=6):
    model = Params()
    sync = DGCSync(model, ratio=0.2, momentum=0.5)
    numel = sum(sync.sizes)
    for step in range(steps):
        velocity = torch.zeros(numel) if sync.velocity is None else sync.velocity.clone()
        residual = torch.zeros(numel) if sync.residual is None else sync.residual.clone()
        grads = integer_grads(step)
        # The sync's flat order is its parameter order (reverse registration).
        flat = torch.cat([g.reshape(-1) for g in grads[::-1]])
        accumulated = residual + (0.5 * velocity + flat)
        model.backward(grads)
        sync.synchronize()
        sent = accumulated - sync.residual
        assert torch.equal(sent + sync.residual, accumulated)
        assert bool(((sent == 0) | (sync.residual == 0)).all()), "a value split between both"
        offset = 0
        for size_, k in zip(sync.sizes, sync.ks):
            seg = slice(offset, offset + size_)
            was_sent, kept = sent[seg] != 0, sync.residual[seg] != 0
            assert int(was_sent.sum()) <= k
            if was_sent.any() and kept.any():  # the sent values are the layer's largest
                assert accumulated[seg][was_sent].abs().min() >= \
                    accumulated[seg][kept].abs().max()
            offset += size_
        assert bool((sync.velocity[sent != 0] == 0).all()), "momentum not masked"
        total = sent.double().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        landed = torch.cat([p.grad.reshape(-1) for p in list(model.ps)[::-1]]).double() * size
        assert np.array_equal(landed.numpy(), total), "what was sent is not what landed"
        for p in model.ps:
            p.grad = None


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def test_identical():
    for factory in (lambda m: TernGradSync(m, seed=5), lambda m: DGCSync(m, ratio=0.01)):
        torch.manual_seed(rank)  # different init per rank: the broadcast must fix it
        model = DigitsCNN(width=8, hidden=32)
        broadcast_parameters(model)
        sync = factory(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync.attach(opt)
        for step in range(4):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            digests = comm.allgather(digest(model))
            assert len(set(digests)) == 1, f"{type(sync).__name__} step {step}: {digests}"
        assert sync.stats["bytes_sent"] < 0.2 * 4 * sync.dense_bytes, sync.stats
