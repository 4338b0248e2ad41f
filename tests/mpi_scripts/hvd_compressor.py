"""PacTrainCompressor / HorovodCollectives on 2+ Horovod ranks (horovodrun --gloo or mpirun).

Usage: hvd_compressor.py SCENARIO..., each one of: match, gradual, ternary, reducer, mismatch
(several scenarios share one launch, which costs more than most scenarios).
Every rank prints "OK <scenario> rank <r>" after each scenario that passed. In the mismatch scenario every rank
prints "rank <r> raised <ErrorType>: ..." and exits with status 3.

Gradients are integer-valued (small integer weights and inputs, lr a power of two), so sums
are exact and packed results must equal Horovod's dense results bit for bit.
"""
import sys

import numpy as np
import torch
from torch import nn

import horovod.torch as hvd
from pacmpi import MaskMismatchError, PacTrainReducer, RankInputError
from pacmpi.adapters.horovod import HorovodCollectives, PacTrainCompressor

LR = 2.0 ** -6


def integer_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 6))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, dtype=torch.float32))
    return model


def make_masks(model, density=0.5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(p.shape, generator=gen) < density
            for name, p in model.named_parameters() if name.endswith("weight")}


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(-2, 3, (8, 12), generator=gen).float(),
            torch.randint(-2, 3, (8, 6), generator=gen).float())


def backward(model, step):
    x, t = batch(step, hvd.rank())
    (model(x) * t).sum().backward()


def train(masks_at, steps, compression, op=hvd.Average, **compressor_kw):
    """Weights after each step, and the per-step reduced grads, of one run.

    ``masks_at(step)`` returns the masks of a step (the dict is updated in place, as a
    gradual pruning schedule would); the dense reference masks its grads after synchronize.
    """
    model = integer_model()
    masks = {name: mask.clone() for name, mask in masks_at(0).items()}
    compressor = None
    if compression == "pactrain":
        compressor = PacTrainCompressor(model, masks, **compressor_kw)
        compression = compressor
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters(),
                                         compression=compression, op=op)
    grads = []
    for step in range(steps):
        for name, mask in masks_at(step).items():
            masks[name].copy_(mask)
        optimizer.zero_grad()
        backward(model, step)
        optimizer.synchronize()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if compressor is None and name in masks:
                    p.grad.mul_(masks[name])
        grads.append([p.grad.clone() for p in model.parameters()])
        with optimizer.skip_synchronize():
            optimizer.step()
    return model, grads, compressor


def assert_same_run(run, reference):
    (model, grads, _), (ref_model, ref_grads, _) = run, reference
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"step {step}: reduced grads differ from Horovod's dense"
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q), "weights differ from Horovod's dense run"


def scenario_match():
    masks = make_masks(integer_model())
    for op in (hvd.Average, hvd.Sum):
        run = train(lambda step: masks, 4, "pactrain", op=op)
        assert_same_run(run, train(lambda step: masks, 4, hvd.Compression.none, op=op))
        stats = run[2].stats
        # stable_steps=1: the first step reduces the fresh masks dense, later steps pack.
        assert stats["steps"] == 4 and stats["verifications"] == 4, stats
        assert stats["dense_fallbacks"] == 2 and stats["packed_tensors"] == 6, stats
        assert stats["bytes_sent"] < stats["dense_bytes_equivalent"], stats

    # Verifying every other step re-reads masks less often and changes nothing else.
    run = train(lambda step: masks, 4, "pactrain", verify_every=2)
    assert_same_run(run, train(lambda step: masks, 4, hvd.Compression.none))
    assert run[2].stats["verifications"] == 2, run[2].stats

    # Bad arguments fail on every rank together.
    for bad in ({"average": True}, {"quantize": "fp8"}):
        try:
            PacTrainCompressor(integer_model(), masks, **bad)
        except RankInputError as exc:
            assert f"rank {hvd.rank()}: ValueError" in str(exc), exc
        else:
            raise AssertionError(f"{bad} was accepted")

    # A bare hvd.allreduce with the compressor: the masked sum, one verification per call.
    model = integer_model()
    compressor = PacTrainCompressor(model, masks, stable_steps=0)
    backward(model, 0)
    weight = model[0].weight
    expected = hvd.allreduce(weight.grad * masks["0.weight"], op=hvd.Sum, name="expected")
    got = hvd.allreduce(weight.grad, op=hvd.Sum, compression=compressor, name="got")
    assert torch.equal(got, expected) and compressor.stats["packed_tensors"] == 1

    # Negative control: a tensor that is no bound .grad fails on every rank, no hang.
    try:
        hvd.allreduce(torch.zeros(3), compression=compressor, name="stray")
    except RankInputError as exc:
        assert "not the .grad" in str(exc), exc
    else:
        raise AssertionError("an unmatched tensor was reduced")


def scenario_gradual():
    base = make_masks(integer_model(), density=0.7)
    sparser = {n: m & make_masks(integer_model(), density=0.6, seed=2)[n]
               for n, m in base.items()}

    def masks_at(step):
        return base if step < 3 else sparser

    run = train(masks_at, 7, "pactrain", stable_steps=2)
    assert_same_run(run, train(masks_at, 7, hvd.Compression.none))
    stats = run[2].stats
    # Two masked weights: dense at steps 0-1 (new), packed 2, dense 3-4 (changed), packed 5-6.
    assert stats["dense_fallbacks"] == 8 and stats["packed_tensors"] == 6, stats
    assert run[2].tracker.version == 2, run[2].tracker.version


class Codes(nn.Module):
    """loss = sum(w * c) + sum(b * d): the gradients are exactly the constants c and d."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(40, 50))
        self.b = nn.Parameter(torch.zeros(9))

    def forward(self, c, d):
        return (self.w * c).sum() + (self.b * d).sum()


def ternary_grads(rank):
    # Values in {-3, 0, 3} with |3| present on every rank: the agreed scale is 3 and the
    # stochastic rounding is deterministic (probability 0 or 1), so codes are c / 3.
    gen = torch.Generator().manual_seed(rank)
    c = 3 * torch.randint(-1, 2, (40, 50), generator=gen).float()
    d = 3 * torch.randint(-1, 2, (9,), generator=gen).float()
    c[0, 0] = d[0] = 3
    return c, d


def scenario_ternary():
    mask = torch.rand(40, 50, generator=torch.Generator().manual_seed(5)) < 0.5
    c, d = ternary_grads(hvd.rank())
    code_sum_w = hvd.allreduce((c / 3).long() * mask, op=hvd.Sum, name="codes.w")
    code_sum_b = hvd.allreduce((d / 3).long(), op=hvd.Sum, name="codes.b")
    for average in (False, True):
        model = Codes()
        compressor = PacTrainCompressor(model, {"w": mask}, quantize="ternary", average=average)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                             named_parameters=model.named_parameters(),
                                             compression=compressor, op=hvd.Sum)
        divisor = hvd.size() if average else 1
        for step in range(3):  # dense (new mask), then packed
            optimizer.zero_grad()
            model(c, d).backward()
            optimizer.synchronize()
            assert torch.equal(model.w.grad, (3 * code_sum_w).float() / divisor), step
            assert torch.equal(model.b.grad, (3 * code_sum_b).float() / divisor), step
            with optimizer.skip_synchronize():
                optimizer.step()
        assert compressor.stats["packed_tensors"] == 2, compressor.stats
        assert compressor.stats["bytes_sent"] < compressor.stats["dense_bytes_equivalent"] / 4

    # Stochastic rounding (scale 3, values +-1, +-2): every result is scale * (sum of codes).
    model = Codes()
    compressor = PacTrainCompressor(model, {"w": mask}, quantize="ternary")
    values = torch.randint(-2, 3, (40, 50), generator=torch.Generator().manual_seed(hvd.rank()))
    values.view(-1)[mask.view(-1).nonzero()[0]] = 3  # a survivor: the agreed scale is 3
    model(values.float(), d).backward()
    got = hvd.allreduce(model.w.grad, op=hvd.Sum, compression=compressor, name="stochastic")
    sums = got / 3
    assert torch.equal(sums, sums.round()) and sums.abs().max() <= hvd.size(), got
    assert torch.all(got[~mask] == 0), "pruned coordinates must come back as zeros"

    # op=hvd.Average floors integer words: refused on every rank with a clear message.
    for call in ("allreduce", "optimizer"):
        model = Codes()
        compressor = PacTrainCompressor(model, {"w": mask}, quantize="ternary")
        try:
            model(c, d).backward()
            if call == "allreduce":
                hvd.allreduce(model.w.grad, op=hvd.Average, compression=compressor, name="avg")
            else:
                optimizer = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=LR), compression=compressor,
                    named_parameters=model.named_parameters())
                optimizer.zero_grad()
                model(c, d).backward()
                optimizer.step()
        except ValueError as exc:
            assert "op=hvd.Sum" in str(exc), exc
        else:
            raise AssertionError(f"ternary words were averaged without an error ({call})")


def scenario_reducer():
    shapes = [(6, 5), (7,), (33,)]
    masks = [np.random.default_rng(3).random(s) < 0.4 for s in shapes]
    masks[1] = None
    grads_of = [[np.random.default_rng(100 * r + i).integers(-4, 5, s).astype(np.float32)
                 for i, s in enumerate(shapes)] for r in range(hvd.size())]
    expected = [sum(g[i] for g in grads_of) * (1 if m is None else m)
                for i, m in enumerate(masks)]
    reducer = PacTrainReducer(masks, collectives=HorovodCollectives(), average=False,
                              bucket_bytes=64)
    for _ in range(3):  # dense (new masks), then packed
        grads = [g.copy() for g in grads_of[hvd.rank()]]
        reducer.reduce(grads)
        for got, want in zip(grads, expected):
            assert np.array_equal(got, want), (got, want)
    assert reducer.stats["packed_reductions"] > 0, reducer.stats
    half = PacTrainReducer(masks, collectives=HorovodCollectives(), average=False,
                           quantize="fp16")
    grads = [g.copy() for g in grads_of[hvd.rank()]]
    half.reduce(grads)  # small integers survive float16 exactly
    assert all(np.array_equal(got, want) for got, want in zip(grads, expected))
    ternary = PacTrainReducer(masks, collectives=HorovodCollectives(), quantize="ternary")
    grads = [g.copy() for g in grads_of[hvd.rank()]]
    ternary.reduce(grads)
    assert all(np.all(np.isfinite(g)) for g in grads)


def scenario_mismatch():
    """Masks diverge on the last rank at step 2 (same survivor count, other positions)."""
    model = integer_model()
    masks = make_masks(model)
    compressor = PacTrainCompressor(model, masks)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters(),
                                         compression=compressor)
    for step in range(4):
        if step == 2 and hvd.rank() == hvd.size() - 1:
            flat = masks["2.weight"].view(-1)
            flat.copy_(flat.roll(1))
        optimizer.zero_grad()
        backward(model, step)
        optimizer.step()
        print(f"rank {hvd.rank()} finished step {step}", flush=True)


def main():
    hvd.init()
    for scenario in sys.argv[1:]:
        try:
            globals()[f"scenario_{scenario}"]()
        except (MaskMismatchError, RankInputError) as exc:
            print(f"rank {hvd.rank()} raised {type(exc).__name__}: {exc}", flush=True)
            sys.exit(3)
        print(f"OK {scenario} rank {hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
