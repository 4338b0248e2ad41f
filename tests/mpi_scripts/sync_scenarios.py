"""PacTrainSync / TopKSync invariants on a small pruned CNN with per-rank data: every rank runs
these tests in this order under mpirun (tests/test_torch_sync.py), each reported on its own.

1. every method: after each step all ranks hold bit-identical weights and pruned weights are
   exactly 0; PacTrain sends fewer bytes than dense, TopK fewer still;
2. PacTrain (lossless) ends within float tolerance of dense training of the same masked model;
3. a parameter used only on some ranks in a step (p.grad None elsewhere): no hang, identical
   weights;
4. gradual pruning through set_masks(): the step after a change falls back to dense
   (dense_fallbacks > 0) and later steps are packed again;
5. broadcast_optimizer_state() makes rank-dependent Adam state rank 0's everywhere;
6. bfloat16: a mixed-dtype model's packed gradients equal dense ones (and PacTrainReducer's on
   NumPy bfloat16 arrays an explicit reference): bit for bit at 2 ranks, at more both are the
   ranks' values added in some order (bf16_reference.py); ternary keeps float32 residuals.
"""
import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from pacmpi import PacTrainReducer
from pacmpi.adapters.convert import as_array, as_tensor
from pacmpi.adapters.pruning import MaskEnforcer, prune
from pacmpi.adapters.torch_sync import broadcast_optimizer_state, broadcast_parameters
from pacmpi.experiments.baselines import make_sync
from pacmpi.experiments.models import DigitsCNN

from bf16_reference import MixedBF16, in_some_order

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
STEPS = 6


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(as_array(p).tobytes())
    return h.hexdigest()


def assert_identical(model, what):
    digests = comm.allgather(digest(model))
    assert len(set(digests)) == 1, f"{what}: weights differ across ranks: {digests}"


def batch(step):
    g = torch.Generator().manual_seed(1000 * rank + step)  # different data on every rank
    return torch.rand(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def train(method, ratio=0.5, steps=STEPS, **kwargs):
    torch.manual_seed(rank)  # different init per rank: the broadcast must fix it
    model = DigitsCNN(width=8, hidden=32)
    broadcast_parameters(model)
    masks = prune(model, ratio, comm=comm)
    enforcer = MaskEnforcer(model, masks)
    sync = make_sync(model, method, masks=masks, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync.attach(opt)
    enforcer.attach(opt)
    sent = 0
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sent += sync.last_step["bytes_sent"]
        assert_identical(model, f"{method} step {step}")
        for name, param in enforcer.parameters.items():
            assert (param[~masks[name]] == 0).all(), f"{method}: pruned {name} moved"
    sync.remove()
    return model, sent


def test_methods():
    results = {m: train(m, **({"bucket_bytes": 8192} if m != "topk" else {}))
               for m in ("dense", "fp16", "pactrain", "pactrain-ternary", "topk")}
    dense, pac = results["dense"][0], results["pactrain"][0]
    diff = max(float((a - b).detach().abs().max())
               for a, b in zip(dense.parameters(), pac.parameters()))
    assert diff < 1e-5, f"pactrain differs from dense by {diff}"
    bytes_ = {m: r[1] for m, r in results.items()}
    assert bytes_["pactrain"] < 0.65 * bytes_["dense"], bytes_
    assert bytes_["fp16"] == bytes_["dense"] // 2, bytes_
    assert bytes_["topk"] < 0.05 * bytes_["dense"], bytes_
    assert bytes_["pactrain-ternary"] < bytes_["pactrain"] / 4, bytes_


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def test_unused():
    torch.manual_seed(rank)
    model = TwoHeads()
    broadcast_parameters(model)
    masks = prune(model, 0.5, comm=comm)
    sync = make_sync(model, "pactrain", masks=masks, bucket_bytes=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach(opt)
    for step in range(4):
        g = torch.Generator().manual_seed(rank * 7 + step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        # head_b is unused on odd ranks at even steps, and on every rank at step 3.
        use_b = step != 3 and (rank % 2 == 0 or step % 2 == 1)
        F.cross_entropy(model(x, use_b), y).backward()
        opt.step()
        assert_identical(model, f"unused step {step}")


def test_gradual():
    torch.manual_seed(0)
    model = DigitsCNN(width=8, hidden=32)
    broadcast_parameters(model)
    masks = prune(model, 0.0, comm=comm)  # all kept: the schedule prunes later
    enforcer = MaskEnforcer(model, masks)
    sync = make_sync(model, "pactrain", masks=masks, stable_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync.attach(opt)
    enforcer.attach(opt)
    log = []
    for step in range(10):
        if step in (2, 6):
            new = prune(model, 0.4 if step == 2 else 0.8, current_masks=enforcer.masks, comm=comm)
            enforcer.update(new)
            sync.set_masks(new)
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        log.append((sync.last_step["dense_fallbacks"], sync.last_step["packed_reductions"]))
        assert_identical(model, f"gradual step {step}")
    fallbacks = [f for f, _ in log]
    packed = [p for _, p in log]
    assert fallbacks[:2] == [0, 0] and packed[:2] == [0, 0], log  # all-True masks: dense
    assert all(f > 0 for f in fallbacks[2:4] + fallbacks[6:8]), log  # changed: dense fallback
    assert packed[5] > 0 and packed[9] > 0 and fallbacks[9] == 0, log  # recovered: packed
    assert sync.stats["dense_fallbacks"] > 0


def test_optimizer_broadcast():
    torch.manual_seed(0)
    model = DigitsCNN(width=4, hidden=8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(rank + 1):  # rank-dependent moments and step counts, no sync
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    broadcast_optimizer_state(opt)
    state = opt.state_dict()["state"]
    flat = torch.cat([v.reshape(-1).float() for s in state.values() for v in s.values()])
    digests = comm.allgather(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1 and float(state[0]["step"]) == 1.0, digests


def gathered(tensor):
    """``tensor`` of every rank, in rank order."""
    return [as_tensor(a) for a in comm.allgather(as_array(tensor))]


def assert_summed(grads, local, what):
    """Each reduced gradient is the mean of every rank's local one added in some order."""
    for index, (grad, mine) in enumerate(zip(grads, local, strict=True)):
        hit = in_some_order(grad, gathered(mine), size)
        assert hit.all(), f"{what}: parameter {index}: {int((~hit).sum())} coordinates"


def test_bf16():
    """PacTrainSync on a mixed bf16/fp32 model: "pactrain" (packed) and "dense" from the same
    weights and data, step by step, both sums of the ranks' (masked) local gradients, equal bit
    for bit at 2 ranks; ternary trains with identical weights on every rank."""
    runs = []
    for method in ("pactrain", "dense", "pactrain-ternary"):
        model = MixedBF16()
        masks = {n: torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) < 0.5
                 for n, p in model.named_parameters() if p.dim() == 2}
        sync = make_sync(model, method, masks=masks, bucket_bytes=1024)
        local = {}  # parameter -> its local gradient, kept before the sync's hooks see it
        for p in model.parameters():
            p.register_hook(lambda g, p=p, local=local: local.__setitem__(p, g.clone()))
        opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -4)
        sync.attach(opt)
        runs.append((model, opt, local))
    packed, dense = runs[0][0], runs[1][0]

    def masked_local(model, local):  # every method masks (GSE) before it reduces
        return [local[p].masked_fill(~masks[n], 0) if n in masks else local[p]
                for n, p in model.named_parameters()]

    for step in range(3):
        dense.load_state_dict(packed.state_dict())
        grads = []
        for model, opt, local in runs:
            g = torch.Generator().manual_seed(100 * step + rank)
            x = (torch.randn(16, 24, generator=g) * 4).to(torch.bfloat16)
            t = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            (model(x).float() - t).pow(2).mean().backward()
            opt.step()  # the attached sync reduces first
            grads.append([p.grad.clone() for p in model.parameters()])
            assert_identical(model, f"bf16 step {step}")
            if model is not runs[2][0]:
                assert_summed(grads[-1], masked_local(model, local), f"step {step}")
        if size == 2:
            assert all(map(torch.equal, grads[0], grads[1])), f"step {step}: pactrain != dense"
    assert all(torch.isfinite(p).all() for p in runs[2][0].parameters())


def test_bf16_reducer():
    """PacTrainReducer on NumPy bfloat16 arrays (with a float32 one: a bucket per dtype):
    masked sums as the reference's; ternary codes keep float32 residuals."""
    gen = torch.Generator().manual_seed(rank)
    grads = [(torch.randn(300, generator=gen) * 8).to(torch.bfloat16),
             torch.randn(50, generator=gen), (torch.randn(7, 9, generator=gen)).to(torch.bfloat16)]
    keep = torch.rand(300, generator=torch.Generator().manual_seed(2)) < 0.4
    masks = [as_array(keep), None, None]
    arrays = [as_array(g.clone()) for g in grads]
    reducer = PacTrainReducer(masks, bucket_bytes=256)
    for _ in range(2):  # the second step is packed
        arrays = [as_array(g.clone()) for g in grads]
        reducer.reduce(arrays)
    assert reducer.stats["packed_reductions"] > 0, reducer.stats
    assert {str(b.dtype) for b in reducer.layout.buckets} == {"bfloat16", "float32"}
    local = [grads[0].masked_fill(~keep, 0), *grads[1:]]
    assert_summed([as_tensor(a) for a in arrays], local, "reducer")
    ternary = PacTrainReducer(masks, quantize="ternary", error_feedback=True)
    ternary.reduce([as_array(g.clone()) for g in grads])
    residuals = ternary.state_dict()["residuals"]
    assert residuals and all(r.dtype == np.float32 for r in residuals.values()), residuals
