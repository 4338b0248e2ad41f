"""PacTrain's DDP communication hook on 2+ ranks under ``torchrun`` (gloo): every rank runs these
tests in this order (tests/test_ddp.py), and each is reported on its own.

Weights, inputs and targets are small integers and the learning rate a power of two. On 2
ranks a sum of two floats does not depend on order, so hooked runs must equal DDP's default
all-reduce of masked gradients bit for bit; on more ranks gloo's summation order follows the
payload layout, so they must agree to float tolerance. A resumed run must equal the
uninterrupted one bit for bit: ternary sums integers; lossless runs float64 there (its sums stay
exact over these few steps), since a resumed DDP starts from other buckets than the run it
resumes, and so from another summation order, as DDP's own all-reduce does.
"""
import contextlib
import hashlib
import io
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import prune as torch_prune

from pacmpi import LayoutMismatchError, MaskMismatchError, RankInputError
from pacmpi.adapters.ddp import PacTrainHookState, TorchDistCollectives, pactrain_hook
from pacmpi.adapters.pruning import MaskEnforcer, masks_from_torch_prune

import torch_world
from mismatch_checks import assert_stopped_at_step_2, expect_raise

LR = 2.0 ** -6
SMALL = {"bucket_cap_mb": 0.0002}  # ~200 bytes: several buckets once DDP rebuilds them

RANK, SIZE = torch_world.join()


class Net(nn.Module):
    """Linear-ReLU-Linear in ``dtype``; ``unused`` adds a layer forward never touches,
    ``float64`` makes the second layer float64 (DDP then has a bucket per dtype)."""

    def __init__(self, unused=False, float64=False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 10, dtype=dtype)
        self.b = nn.Linear(10, 6, dtype=torch.float64 if float64 else dtype)
        self.unused = nn.Linear(3, 3) if unused else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-3, 4, p.shape))

    def forward(self, x):
        hidden = torch.relu(self.a(x.to(self.a.weight.dtype)))
        return self.b(hidden.to(self.b.weight.dtype)).float()


def make_masks(model, density=0.5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(p.shape, generator=gen) < density
            for name, p in model.named_parameters() if name.endswith("weight")}


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(-2, 3, (8, 12), generator=gen).float(),
            torch.randint(-2, 3, (8, 6), generator=gen).float())


class Run:
    """A DDP training run, with the PacTrain hook (``hook=True``) or DDP's default all-reduce
    whose result is masked afterwards (the reference). ``grads``: each step's reduced grads."""

    def __init__(self, hook=True, model=None, masks=None, ddp_kw=SMALL, state=None,
                 early=False, **kw):
        self.model = Net() if model is None else model
        self.masks = make_masks(self.model) if masks is None else masks
        if hook and state is None and early:  # of the plain module, before DDP wraps it
            state = PacTrainHookState(self.model, self.masks, **kw)
        self.ddp = DDP(self.model, **ddp_kw)
        self.state = state
        if hook and state is None:
            self.state = PacTrainHookState(self.ddp, self.masks, **kw)
        if hook:
            self.ddp.register_comm_hook(self.state, pactrain_hook)
        self.enforcer = MaskEnforcer(self.model, self.masks)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.enforcer.attach(self.optimizer)
        self.grads = []

    def step(self, step, micro=1):
        self.optimizer.zero_grad()
        for m in range(micro):
            with self.ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                x, t = batch(micro * step + m, RANK)
                (self.ddp(x) * t).sum().backward()
        if self.state is None:
            self.enforcer.apply_to_grads()
        grads = [p.grad.clone() for p in self.model.parameters() if p.grad is not None]
        for param, keep in zip(self.enforcer.parameters.values(), self.enforcer.masks.values()):
            assert param.grad is None or torch.all(param.grad[~keep] == 0), "pruned coordinate"
        self.grads.append(grads)
        self.optimizer.step()


def train(steps, micro=1, **kw):
    run = Run(**kw)
    for step in range(steps):
        run.step(step, micro)
    return run


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def same(a, b, exact):
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-5)


def assert_same(run, reference, exact=None):
    """Equal grads and weights (bit for bit if ``exact``, default on 2 ranks), pruned weights
    0, every rank's weights identical."""
    exact = SIZE == 2 if exact is None else exact
    for step, (got, want) in enumerate(zip(run.grads, reference.grads, strict=True)):
        for g, w in zip(got, want, strict=True):
            assert same(g, w, exact), f"step {step}: reduced grads differ from the reference"
    for p, q in zip(run.model.parameters(), reference.model.parameters(), strict=True):
        assert same(p, q, exact), "weights differ from the reference run"
    for param, keep in zip(run.enforcer.parameters.values(), run.enforcer.masks.values()):
        assert torch.all(param[~keep] == 0), "a pruned weight is not 0"
    digests = [None] * SIZE
    dist.all_gather_object(digests, digest(run.model))
    assert len(set(digests)) == 1, "ranks ended with different weights"


# ---------------------------------------------------------------------------------- scenarios
def test_match():
    """Equal to DDP's all-reduce of masked grads: rebuilt buckets, static_graph,
    gradient_as_bucket_view, find_unused_parameters (with a parameter forward never uses)."""
    for ddp_kw in (SMALL, dict(SMALL, static_graph=True),
                   dict(SMALL, gradient_as_bucket_view=True), {}):
        run = train(5, ddp_kw=ddp_kw)
        assert_same(run, train(5, hook=False, ddp_kw=ddp_kw))
        stats = run.state.stats
        assert stats["steps"] == 5 and stats["verifications"] == 5, stats
        assert stats["packed_reductions"] > 0 and stats["bytes_sent"] < stats[
            "dense_bytes_equivalent"], stats
        if ddp_kw:  # DDP rebuilt its single first bucket into several: handled
            assert len(run.state._layout) > 1, run.state._layout
    unused = dict(SMALL, find_unused_parameters=True)
    run = train(4, model=Net(unused=True), ddp_kw=unused)
    assert_same(run, train(4, hook=False, model=Net(unused=True), ddp_kw=unused))
    run = train(4, verify_every=2)
    assert_same(run, train(4, hook=False))
    assert run.state.stats["verifications"] == 2, run.state.stats


def test_early_state():
    """A state built of the plain module before DDP wraps it is unbound until the first hook
    call binds it, and trains as one built of the DDP model; so does one in a process group of
    its own. state_dict() binds too; a state pickled unbound binds to the new model."""
    state = PacTrainHookState(Net(), {}, quantize="ternary")
    assert state.engine is None and state.step == 0
    for kw in ({}, {"process_group": dist.new_group()}, {"quantize": "ternary"}):
        run = train(4, early=True, **kw)
        assert run.state.step == 4 and run.state.process_group is kw.get("process_group")
        assert_same(run, train(4, **kw), exact=True)
    run = Run(early=True, quantize="ternary")
    saved = run.state.state_dict()  # binds: collective
    assert saved["step"] == 0 and not saved["residuals"], saved
    # Pickled before binding (options and masks travel), bound to the new process's model.
    state = pickle.loads(pickle.dumps(PacTrainHookState(Net(), make_masks(Net()),
                                                        quantize="ternary")))
    expect_raise(RuntimeError, lambda: Run(model=Net(), masks=state.masks, state=state).step(0),
                 "call state.bind(model) first")
    run = Run(model=Net(), masks=state.masks, state=state)
    state.bind(run.ddp)
    for step in range(4):
        run.step(step)
    assert_same(run, train(4, quantize="ternary"), exact=True)


def test_accumulate():
    """Gradient accumulation with no_sync: the hook runs on the synchronized step only."""
    run = train(3, micro=3)
    assert_same(run, train(3, micro=3, hook=False))
    assert run.state.step == 3, run.state.step


def test_prune():
    """A torch.nn.utils.prune model: the logical name "a.weight" names a.weight_orig."""
    def pruned():
        model = Net()
        torch_prune.l1_unstructured(model.a, "weight", amount=0.5)
        return model

    model = pruned()
    masks = dict(masks_from_torch_prune(model), **{"b.weight": make_masks(model)["b.weight"]})
    assert "a.weight" in masks and "a.weight" not in dict(model.named_parameters())
    run = train(4, model=model, masks=masks)
    assert_same(run, train(4, hook=False, model=pruned(), masks=masks))
    slot = [n for n, _ in model.named_parameters()].index("a.weight_orig")
    assert run.state.engine.tracker.buckets[slot].survivors == int(masks["a.weight"].sum())


def test_dtypes():
    """float32 and float64 parameters: DDP buckets per dtype, each reduced in its dtype."""
    run = train(4, model=Net(float64=True))
    assert_same(run, train(4, hook=False, model=Net(float64=True)))
    assert {str(b.dtype) for b in run.state.engine.buckets} == {"float32", "float64"}


class Codes(nn.Module):
    """loss = sum(w * c): the gradient is exactly the constant c."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(40, 25))

    def forward(self, c):
        return (self.w * c).sum()


def test_ternary():
    """Ternary lowers the loss of a least-squares fit and matches lossless's progress."""
    def fit(**kw):
        torch.manual_seed(0)
        model = nn.Linear(30, 1, bias=False)
        teacher = torch.randn(30, 1)
        masks = {"weight": torch.ones(1, 30, dtype=torch.bool)}
        masks["weight"][0, ::3] = False
        ddp = DDP(model)
        state = PacTrainHookState(ddp, masks, **kw)
        ddp.register_comm_hook(state, pactrain_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(40):
            x = torch.randn(16, 30, generator=torch.Generator().manual_seed(step * SIZE + RANK))
            loss = ((ddp(x) - x @ (teacher * masks["weight"].T.float())) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            assert torch.all(model.weight.grad[~masks["weight"]] == 0)
            optimizer.step()
            losses.append(loss.item())
        return losses, state

    losses, state = fit(quantize="ternary")
    lossless, _ = fit()
    assert losses[-1] < 0.1 * losses[0], losses
    assert losses[-1] < 10 * lossless[-1] + 1e-3, (losses[-1], lossless[-1])
    assert state.stats["packed_reductions"] > 0
    assert state.stats["bytes_sent"] < state.stats["dense_bytes_equivalent"] / 2, state.stats


def test_unbiased():
    """Mean of many decoded ternary averages ~ the exact average (without error feedback,
    every step is an independent draw); a biased rounding fails the same check."""
    steps = 300
    mask = torch.rand(40, 25, generator=torch.Generator().manual_seed(5)) < 0.6

    def values(rank):  # in [-1, 1], with 1 at a kept coordinate: the agreed scale is 1
        c = torch.rand(40, 25, generator=torch.Generator().manual_seed(rank)) * 2 - 1
        c.view(-1)[mask.view(-1).nonzero()[0]] = 1.0
        return c

    c = values(RANK)
    exact = sum(values(rank) for rank in range(SIZE)) / SIZE * mask
    model = Codes()
    ddp = DDP(model)
    state = PacTrainHookState(ddp, {"w": mask}, quantize="ternary", error_feedback=False)
    ddp.register_comm_hook(state, pactrain_hook)
    total = torch.zeros_like(c, dtype=torch.float64)
    for _ in range(steps):
        model.zero_grad()
        ddp(c).backward()
        grad = model.w.grad
        assert torch.all(grad[~mask] == 0)
        codes = grad * SIZE  # scale 1: the decoded average is (integer code sum) / SIZE
        assert torch.equal(codes, codes.round()) and codes.abs().max() <= SIZE
        total += grad
    tolerance = 1 / (2 * (SIZE * steps) ** 0.5)  # sigma of the mean is at most this

    def unbiased(estimate):
        error = (estimate - exact)[mask].abs()
        return error.mean() < tolerance and error.max() < 6 * tolerance

    assert unbiased(total / steps), ((total / steps - exact).abs().max(), tolerance)
    # Negative control: round-to-nearest codes (biased) fail the same check.
    assert not unbiased(sum(values(r).round() for r in range(SIZE)) / SIZE * mask)


def resumed(how, steps, at, dtype, **kw):
    """A run checkpointed after ``at`` steps and continued by a new model, DDP and state:
    restored by load_state_dict ("state_dict"), unpickled and bound ("pickle"), or without
    the state's state ("fresh")."""
    first = train(at, model=Net(dtype=dtype), **kw)
    blob = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "state": first.state.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)  # the default, weights_only=True: tensors and plain types only
    model = Net(dtype=dtype)
    model.load_state_dict(saved["model"])
    state = pickle.loads(pickle.dumps(first.state)) if how == "pickle" else None
    run = Run(model=model, state=state, **({} if state is not None else kw))
    if how == "pickle":
        state.bind(run.ddp)
    if how == "state_dict":
        run.state.load_state_dict(saved["state"])
    run.grads = list(first.grads)
    for step in range(at, steps):
        run.step(step)
    return run


def test_rebuild_slices_residuals():
    """DDP rebuilds its first bucket (every parameter, in the model's order) into buckets that
    hold the parameters in the reverse order; the hook tells its engine, which reverses the
    error-feedback residual in place, so the rebuilt buckets' residuals are slices of that one
    array, not copies beside it. The control, whose hook does not tell, copies."""
    def residual_bases(regroup):
        run = Run(quantize="ternary", error_feedback=True)
        if not regroup:
            run.state._regroup = lambda slots: None
        for step in range(3):
            run.step(step)
        assert len(run.state._layout) > 1, run.state._layout
        entries = run.state.engine.residuals.entries()
        return {u: None if e.values.base is None else id(e.values.base)
                for u, e in entries.items()}

    told = residual_bases(True)
    shared = [base for u, base in told.items() if isinstance(u, tuple)]
    assert len(shared) > 1 and None not in shared and len(set(shared)) == 1, told
    assert all(base is None for base in residual_bases(False).values())


def test_checkpoint():
    """Resuming continues bit for bit (lossless and ternary), although the resumed DDP starts
    from its first-iteration buckets; a checkpoint that does not fit fails on every rank."""
    for dtype, kw in ((torch.float64, {}),
                      (torch.float32, {"quantize": "ternary", "error_feedback": True})):
        reference = train(6, model=Net(dtype=dtype), **kw)
        for how in ("state_dict", "pickle"):
            run = resumed(how, 6, 3, dtype, **kw)
            assert_same(run, reference, exact=True)
            assert run.state.stats["steps"] == 6, run.state.stats
    fresh = resumed("fresh", 6, 3, torch.float32, quantize="ternary", error_feedback=True)
    assert not all(torch.equal(g, w) for g, w in zip(fresh.grads[3], reference.grads[3]))

    saved = reference.state.state_dict()
    assert saved["residuals"] and saved["step"] == 6, saved.keys()
    expect_raise(RankInputError, lambda: Run().state.load_state_dict(saved), "quantize='ternary'")
    masks = make_masks(Net())
    if RANK == SIZE - 1:
        masks["a.weight"].view(-1)[:2] ^= True
    run = Run(masks=masks, quantize="ternary")
    expect_raise(RankInputError, lambda: run.state.load_state_dict(saved),
                 f"rank {SIZE - 1}: ValueError: masks of ['a.weight'] differ")
    assert run.state.step == 0


def test_errors():
    """Bad input and DDP layouts that differ between ranks fail on every rank, no hang."""
    last = SIZE - 1
    model = Net()
    masks = make_masks(model)
    if RANK == last:
        masks["a.weight"] = masks["a.weight"][:, :5]
    expect_raise(RankInputError, lambda: PacTrainHookState(model, masks).bind(),
                 f"rank {last}: ValueError: mask of 'a.weight' has shape (10, 5)")
    expect_raise(RankInputError, lambda: PacTrainHookState(model, {"nope": None}).bind(),
                 "['nope']")
    # Binding at the first hook call: from backward() on every rank; the state stays unbound.
    state = PacTrainHookState(model, masks)
    ddp = DDP(model)
    ddp.register_comm_hook(state, pactrain_hook)
    x, t = batch(0, RANK)
    expect_raise(RankInputError, lambda: (ddp(x) * t).sum().backward(),
                 f"rank {last}: ValueError: mask of 'a.weight' has shape (10, 5)")
    assert state._params is None and state.engine is None
    expect_raise(ValueError, lambda: PacTrainHookState(model, {}, quantize="fp8"), "quantize")

    # find_unused_parameters keeps DDP's first buckets (capped per rank): the last rank's
    # differ. Every rank raises LayoutMismatchError from backward() at step 0.
    cap = 25 if RANK == last else 0.0002
    run = Run(ddp_kw={"bucket_cap_mb": cap, "find_unused_parameters": True})
    error = expect_raise(LayoutMismatchError, lambda: run.step(0), "ranks disagree on DDP bucket 0",
                   f"offending ranks: [{last}]")
    assert error.offending_ranks == (last,), error.offending_ranks
    # The process group is still in step: a later collective completes.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    assert flag.item() == SIZE

    # TorchDistCollectives by itself.
    coll = TorchDistCollectives()
    buf = np.array([RANK, -RANK], dtype=np.int64)
    coll.allreduce(buf, "max")
    assert buf.tolist() == [last, 0]
    words = np.array([RANK + 1], dtype=np.int64)
    coll.iallreduce(words, "sum").wait()
    assert words[0] == SIZE * (SIZE + 1) // 2
    root = np.full(3, RANK, dtype=np.uint8)
    coll.bcast(root, root=last)
    assert root.tolist() == [last] * 3
    assert coll.allgather_object(RANK * 2) == [2 * r for r in range(SIZE)]


def test_resync():
    """on_mismatch="resync": the last rank's moved mask is replaced by rank 0's."""
    masks = make_masks(Net())
    ddp = DDP(Net(), **SMALL)
    state = PacTrainHookState(ddp, masks, on_mismatch="resync")
    ddp.register_comm_hook(state, pactrain_hook)
    original = {n: m.clone() for n, m in masks.items()}
    for step in range(4):
        if step == 2 and RANK == SIZE - 1:
            flat = masks["b.weight"].view(-1)
            flat.copy_(flat.roll(1))
        ddp.zero_grad()
        x, t = batch(step, RANK)
        (ddp(x) * t).sum().backward()
    assert state.stats["resyncs"] == 1, state.stats
    assert all(torch.equal(masks[n], original[n]) for n in masks)


def test_mismatch():
    """Masks diverge on the last rank at step 2 (same survivor count, other positions): every
    rank raises MaskMismatchError naming it, before anything is summed."""
    run = Run()
    finished = []
    with pytest.raises(MaskMismatchError) as caught:
        for step in range(4):
            if step == 2 and RANK == SIZE - 1:
                flat = run.masks["b.weight"].view(-1)
                flat.copy_(flat.roll(1))
            run.optimizer.zero_grad()
            x, t = batch(step, RANK)
            (run.ddp(x) * t).sum().backward()
            finished.append(step)
    assert_stopped_at_step_2(caught.value, finished, SIZE - 1, "b.weight")
