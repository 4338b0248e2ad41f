"""Sharded PacTrain (pacmpi.sharded, pacmpi.adapters.sharded): every rank runs these tests in
this order under mpirun (tests/test_sharded.py), each reported on its own.

1. reduce_scatter / allgather of MPICollectives and of the interface's fallback (all-reduce /
   broadcasts) equal a NumPy reference bit for bit, uneven counts, ranks with none, nothing;
2. ShardedReducer + a momentum update equals PacTrainReducer + the same update on full arrays
   bit for bit (integer gradients), for masks whose survivors leave ranks empty, and none;
3. ShardedOptimizer (SGD with momentum, Adam) equals PacTrainSync + the same optimizer bit for
   bit; pruned weights stay 0; ranks end bit-identical; the optimizer state per rank is its
   shard of the survivors (counted in elements);
4. bad input (a mask of the wrong shape on one rank, a rank with another mask, gradients or
   parameters that do not fit, masks changed after construction) raises on every rank;
5. ternary: each rank's decoded block of the reduce-scattered words, and ShardedOptimizer's
   training, equal replicated ternary PacTrain bit for bit.
"""
import hashlib
import io
import socket

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from pacmpi import (
    Collectives,
    MaskMismatchError,
    MPICollectives,
    PacTrainReducer,
    RankInputError,
)
from pacmpi.adapters.convert import as_array
from pacmpi.adapters.sharded import ShardedOptimizer
from pacmpi.adapters.torch_collectives import TorchDistCollectives
from pacmpi.adapters.torch_sync import PacTrainSync
from pacmpi.arrays import supported_float_dtypes
from pacmpi.sharded import ShardedReducer, balanced_counts

from mismatch_checks import expect_raise

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS = 4


class BroadcastOnly(Collectives):
    """A transport with no reduce-scatter or all-gather of its own: the interface's fallbacks
    run over its all-reduce and broadcasts (MPI's, which are exact)."""

    def __init__(self):
        self._mpi = MPICollectives()
        self.rank, self.size = self._mpi.rank, self._mpi.size

    def allreduce(self, buf, op="sum", name=None):
        self._mpi.allreduce(buf, op)

    def bcast(self, buf, root=0, name=None):
        self._mpi.bcast(buf, root=root)

    def allgather_object(self, obj, name=None):
        return self._mpi.allgather_object(obj)


def gloo_group():
    """torch.distributed (gloo) over the same ranks, on a port rank 0 found free."""
    if not dist.is_initialized():
        port = None
        if rank == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{comm.bcast(port)}",
                                rank=rank, world_size=size)
    return TorchDistCollectives()


def count_cases():
    """Per-rank counts: even, uneven, a rank with none, fewer elements than ranks, nothing."""
    return [[3] * size, [r % 3 for r in range(size)], [0] + [2] * (size - 1),
            balanced_counts(size - 1, size), [0] * size, [7] + [0] * (size - 1)]


def same_on_every_rank(arrays):
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    digests = comm.allgather(digest.hexdigest())
    assert len(set(digests)) == 1, digests


def test_collectives_match_reference():
    for transport in (MPICollectives(), BroadcastOnly(), gloo_group()):
        check_transport(transport)


def check_transport(transport):
    """reduce_scatter and allgather of ``transport`` against NumPy, bit for bit."""
    for dtype in supported_float_dtypes():
        for counts in count_cases():
            total, start = sum(counts), sum(counts[:rank])
            stop = start + counts[rank]
            values = [np.random.default_rng(100 * r + total).integers(-9, 10, total)
                      for r in range(size)]
            buf = values[rank].astype(dtype)
            out = np.full(counts[rank], np.nan, dtype=dtype)
            transport.reduce_scatter(buf, out, counts)
            expected = np.sum(values, axis=0)[start:stop].astype(dtype)
            assert np.array_equal(out, expected), (type(transport), dtype, counts)
            assert np.array_equal(buf, values[rank].astype(dtype))  # only read
            gathered = np.full(total, np.nan, dtype=dtype)
            gathered[start:stop] = buf[start:stop]
            gathered[start:stop][:1] = -0.0  # bits, not arithmetic: -0.0 survives
            transport.allgather(gathered, counts)
            expected = np.concatenate([values[r][sum(counts[:r]):sum(counts[:r + 1])]
                                       for r in range(size)]).astype(dtype)
            starts = [sum(counts[:r]) for r in range(size) if counts[r]]
            expected[starts] = -0.0
            assert gathered.tobytes() == expected.tobytes(), (type(transport), counts)
    # Negative control: counts that do not split the buffer name it.
    expect_raise(ValueError, lambda: transport.reduce_scatter(
        np.zeros(5), np.zeros(1), [1] * size), "do not split")


def test_balanced_counts():
    for total in (0, 1, size - 1, size, 10 * size + 3):
        counts = balanced_counts(total, size)
        assert sum(counts) == total and max(counts) - min(counts) <= 1, counts
        assert counts == sorted(counts, reverse=True)


SHAPES = [(6, 5), (5,), (3, 4), (7,)]


def mask_cases():
    """Masks shared by every rank: a mix (one unmasked array), fewer survivors than ranks (at
    least one rank owns none), and nothing left at all."""
    rng = np.random.default_rng(7)
    mixed = [rng.random(s) < 0.4 for s in SHAPES]
    mixed[1] = None
    few = [np.zeros(s, dtype=bool) for s in SHAPES]
    few[2][1, 2] = True
    if size > 2:
        few[0][5, 4] = few[3][0] = True
    none = [np.zeros(s, dtype=bool) for s in SHAPES]
    return {"mixed": mixed, "few": few, "none": none}


def test_reducer_matches_replicated():
    """A momentum update on the shard equals the same update on full, all-reduced arrays."""
    cases = [(None, name, average, np.dtype(np.float32)) for name in mask_cases()
             for average in (True, False)]
    cases += [(None, "mixed", True, dtype) for dtype in supported_float_dtypes()
              if dtype != np.float32]
    cases.append((BroadcastOnly(), "mixed", True, np.dtype(np.float32)))
    for transport, name, average, dtype in cases:
        masks = mask_cases()[name]
        rng = np.random.default_rng(3)  # same weights on every rank
        start = [rng.integers(-4, 5, s).astype(dtype) for s in SHAPES]
        for w, m in zip(start, masks):
            if m is not None:
                w[~m] = 0
        start[3][0] = 5.0  # a pruned weight that is not zero is left as it is
        replicated = [w.copy() for w in start]
        sharded = [w.copy() for w in start]
        full = PacTrainReducer(masks, average=average, shapes=SHAPES,
                               dtypes=[dtype] * len(SHAPES))
        red = ShardedReducer(masks, collectives=transport, average=average,
                             shapes=SHAPES, dtypes=[dtype] * len(SHAPES))
        velocity_full = [np.zeros(s, dtype) for s in SHAPES]
        velocity = np.zeros(red.layout.shard_size, dtype)

        def update(grad, weight):
            velocity[...] = dtype.type(0.5) * velocity + grad
            weight -= dtype.type(0.25) * velocity

        for step in range(STEPS):
            rng = np.random.default_rng(100 * step + rank)
            grads = [rng.integers(-8, 9, s).astype(dtype) for s in SHAPES]
            local = [g.copy() for g in grads]
            full.reduce(grads)
            for w, v, g in zip(replicated, velocity_full, grads):
                v[...] = dtype.type(0.5) * v + g
                w -= dtype.type(0.25) * v
            red.step(local, sharded, update)
            for i, (a, b) in enumerate(zip(sharded, replicated)):
                assert a.tobytes() == b.tobytes(), (name, average, dtype, step, i, a, b)
            same_on_every_rank(sharded)
        assert red.layout.counts == balanced_counts(red.layout.total, size)
        assert sum(comm.allgather(red.layout.shard_size)) == red.layout.total
        assert red.stats["steps"] == STEPS
        if name == "few":
            assert min(red.layout.counts) == 0  # a rank owned nothing
        assert sharded[3][0] == 5.0 or masks[3][0]


def test_ternary_matches_replicated():
    """Ternary: each rank decodes its block of the reduce-scattered words into exactly what
    replicated ternary PacTrain (one bucket, the same seed) decodes there, bit for bit, with
    and without error feedback, through every transport; the words are balanced. A NaN on one
    rank sends that step as it is, on both. Negative control: another seed quantizes
    otherwise. Blocks of 7 elements a scale: their scales and words cut as the replicated
    bucket's."""
    f32 = np.dtype(np.float32)
    cases = [(None, name, ef, True, f32, "tensor") for name in mask_cases()
             for ef in (False, True)]
    cases += [(None, "mixed", False, False, f32, "tensor"), (None, "mixed", True, True, f32, 7),
              (None, "few", False, True, f32, 7)]
    cases += [(None, "mixed", True, True, dtype, "tensor") for dtype in supported_float_dtypes()
              if dtype != np.float32]
    cases += [(BroadcastOnly(), "mixed", True, True, f32, "tensor"),
              (gloo_group(), "mixed", False, True, f32, "tensor")]
    for transport, name, ef, average, dtype, scale in cases:
        masks = mask_cases()[name]
        options = dict(quantize="ternary", error_feedback=ef, seed=5, average=average,
                       shapes=SHAPES, dtypes=[dtype] * len(SHAPES), ternary_scale=scale)
        full = PacTrainReducer(masks, stable_steps=0, bucket_bytes=1 << 62, collectives=transport,
                               **options)
        red = ShardedReducer(masks, collectives=transport, **options)
        other = ShardedReducer(masks, collectives=transport, **dict(options, seed=6))
        layout = red.layout
        assert red.word_counts == balanced_counts(sum(red.word_counts), size)
        assert sum(layout.counts) == layout.total and len(layout.counts) == size
        differs = False
        for step in range(STEPS):
            rng = np.random.default_rng(100 * step + rank)
            grads = [(rng.standard_normal(s) * (1 + i)).astype(dtype)
                     for i, s in enumerate(SHAPES)]
            nan = step == 2 and dtype == np.float32
            if nan:  # sent as it is: integers, whose sums any summation order gets exactly
                grads = [rng.integers(-8, 9, s).astype(dtype) for s in SHAPES]
                if rank == size - 1:
                    grads[1][2] = np.nan  # array 1 is unmasked in "mixed": a survivor
            local, local_other = [g.copy() for g in grads], [g.copy() for g in grads]
            full.reduce(grads)
            want = layout.gather(grads, np.empty(layout.total, dtype), 0, layout.total)
            want = want[layout.start:layout.stop]
            got = red.reduce_scatter(local).copy()
            same = np.array_equal(got, want, equal_nan=True) if nan else \
                got.tobytes() == want.tobytes()
            assert same, (name, ef, average, dtype, step, got, want)
            mine = other.reduce_scatter(local_other)
            differs |= bool(comm.allreduce(int(not np.array_equal(mine, got, equal_nan=True))))
        assert red.stats["bytes_sent"] == full.stats["bytes_sent"], (name, red.stats, full.stats)
        assert red.engine.stats["nonfinite_fallbacks"] == full.engine.stats["nonfinite_fallbacks"]
        if name == "mixed" and dtype == np.float32:
            assert red.engine.stats["nonfinite_fallbacks"] == 1
        assert differs or name != "mixed", name  # the control: the seed matters


class Heads(nn.Module):
    """Two linear heads of one input: their gradients under a linear loss do not depend on the
    weights, so integer data keeps every gradient sum exact at any step."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 5), nn.Linear(8, 3)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=1)


def heads_masks(kind):
    g = torch.Generator().manual_seed(11)
    masks = {"a.weight": torch.rand(5, 8, generator=g) < 0.3,
             "b.weight": torch.rand(3, 8, generator=g) < 0.5,
             "b.bias": torch.tensor([True, False, True])}
    if kind == "few":
        masks = {n: torch.zeros_like(m) for n, m in masks.items()}
        masks["a.bias"] = torch.zeros(5, dtype=torch.bool)
        masks["b.weight"][2, 6] = True
    return masks


class MixedHeads(Heads):
    """Heads whose second head is bfloat16: a model of two dtypes."""

    def __init__(self):
        super().__init__()
        self.b.to(torch.bfloat16)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x.bfloat16()).float()], dim=1)


def heads(masks, kind=Heads):
    torch.manual_seed(0)
    model = kind()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape).float() / 8)
        params = dict(model.named_parameters())
        for name, mask in masks.items():
            params[name].mul_(mask)
    return model


def train(model, opt, step_fn, steps=range(STEPS)):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(-4, 5, (6, 8), generator=g).float()
        t = torch.randint(-2, 3, (6, 8), generator=g).float()
        opt.zero_grad()
        (model(x) * t).sum().backward()
        step_fn()


OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.125, momentum=0.5)),
              "adam": (torch.optim.Adam, dict(lr=0.01))}


def test_sharded_optimizer_equals_pactrain_sync():
    for kind in ("mixed", "few"):
        masks = heads_masks(kind)
        for name, (cls, kwargs) in OPTIMIZERS.items():
            replicated = heads(masks)
            sync = PacTrainSync(replicated, masks=masks)
            opt = cls(replicated.parameters(), **kwargs)
            sync.attach(opt)
            train(replicated, opt, opt.step)
            sync.remove()

            model = heads(masks)
            transport = gloo_group() if name == "adam" else None
            sharded = ShardedOptimizer(model, cls, masks=masks, collectives=transport, **kwargs)
            train(model, sharded, sharded.step)
            for (pname, a), b in zip(model.named_parameters(), replicated.parameters()):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (kind, name, pname)
            for pname, mask in masks.items():
                assert not dict(model.named_parameters())[pname][~mask].any()  # pruned stay 0
            same_on_every_rank([as_array(p.detach()) for p in model.parameters()])
            layout = sharded.reducer.layout
            unmasked = sum(p.numel() for n, p in model.named_parameters() if n not in masks)
            assert layout.total == sum(int(m.sum()) for m in masks.values()) + unmasked
            if kind == "few":
                assert layout.total == 1 and max(layout.counts) == 1 and min(layout.counts) == 0
            # Optimizer memory: state only for this rank's shard of the survivors.
            state = sharded.optimizer.state[sharded.shard]
            moments = [v for v in state.values() if torch.is_tensor(v) and v.dim() == 1]
            assert len(moments) == (2 if name == "adam" else 1), list(state)
            assert all(v.numel() == layout.shard_size == layout.counts[rank] for v in moments)
            full_state = sum(v.numel() for s in opt.state.values() for v in s.values()
                             if torch.is_tensor(v) and v.dim() > 0)
            assert full_state == len(moments) * sum(p.numel() for p in replicated.parameters())
            assert sum(comm.allgather(sum(v.numel() for v in moments))) == \
                len(moments) * layout.total


def test_ternary_optimizer_equals_replicated_ternary():
    """ShardedOptimizer(quantize="ternary") trains as replicated ternary PacTrain (one
    bucket, the same seed) + the same optimizer on the full weights, bit for bit; pruned
    weights stay 0, ranks end bit-identical."""
    masks = heads_masks("mixed")
    kwargs = dict(lr=0.125, momentum=0.5)
    replicated = heads(masks)
    # In the optimizer's order (reverse registration, as DDP's): the same survivors' order.
    names = [n for n, _ in replicated.named_parameters()][::-1]
    params = list(replicated.parameters())[::-1]
    reducer = PacTrainReducer([as_array(masks[n]) if n in masks else None for n in names],
                              quantize="ternary", stable_steps=0, bucket_bytes=1 << 62,
                              shapes=[tuple(p.shape) for p in params],
                              dtypes=[np.float32] * len(params))
    opt = torch.optim.SGD(params, **kwargs)

    def replicated_step():
        reducer.reduce([as_array(p.grad) for p in params])
        opt.step()

    train(replicated, opt, replicated_step)
    model = heads(masks)
    sharded = ShardedOptimizer(model, torch.optim.SGD, masks=masks, quantize="ternary", **kwargs)
    train(model, sharded, sharded.step)
    for (name, a), b in zip(model.named_parameters(), replicated.parameters()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    for name, mask in masks.items():
        assert not dict(model.named_parameters())[name][~mask].any()
    same_on_every_rank([as_array(p.detach()) for p in model.parameters()])
    assert sharded.reducer.stats["bytes_sent"] == reducer.stats["bytes_sent"]


def test_ternary_checkpoint_resumes():
    """Ternary: a checkpoint resumes bit for bit at the same world size (the step, hence the
    random draws, restored); loaded at another world size (other shards of words), the packed
    optimizer state comes back unchanged."""
    masks = heads_masks("mixed")
    kwargs = dict(masks=masks, quantize="ternary", lr=0.01)
    straight = heads(masks)
    opt = ShardedOptimizer(straight, torch.optim.Adam, **kwargs)
    train(straight, opt, opt.step)
    model = heads(masks)
    opt = ShardedOptimizer(model, torch.optim.Adam, **kwargs)
    train(model, opt, opt.step, range(STEPS // 2))
    saved, weights = roundtrip(opt.state_dict()), roundtrip(model.state_dict())
    resumed = heads({})
    resumed.load_state_dict(weights)
    again = ShardedOptimizer(resumed, torch.optim.Adam, **kwargs)
    again.load_state_dict(saved)
    train(resumed, again, again.step, range(STEPS // 2, STEPS))
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    sub = comm.Split(0 if rank < max(1, size // 2) else MPI.UNDEFINED, rank)
    if sub != MPI.COMM_NULL:
        small = ShardedOptimizer(heads(masks), torch.optim.Adam, comm=sub, **kwargs)
        small.load_state_dict(saved)
        resaved = small.state_dict()
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resaved["groups"][0]["state"][key],
                               saved["groups"][0]["state"][key])
        sub.Free()


def test_clipping_matches_clip_grad_norm():
    """max_grad_norm clips the averaged gradient to its global norm as clip_grad_norm_ does on
    replicated PacTrain's reduced gradients: the same norms (every rank alike) and weights
    (close: the norm is summed in another order and precision); a bound above every norm
    changes nothing (bit for bit), and the clipped run differs from it. A bad bound on one
    rank raises on every rank."""
    masks = heads_masks("mixed")
    weights = {}
    for bound in (1e6, 2.0):
        replicated = heads(masks)
        sync = PacTrainSync(replicated, masks=masks)
        opt = torch.optim.SGD(replicated.parameters(), lr=0.125, momentum=0.5)
        norms, mine = [], []

        def clipped_step():
            sync.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(replicated.parameters(), bound)))
            opt.step()

        train(replicated, opt, clipped_step)
        model = heads(masks)
        sharded = ShardedOptimizer(model, torch.optim.SGD, masks=masks, max_grad_norm=bound,
                                   lr=0.125, momentum=0.5)

        def sharded_step():
            sharded.step()
            mine.append(sharded.grad_norm)

        train(model, sharded, sharded_step)
        assert np.allclose(mine, norms, rtol=1e-6), (mine, norms)
        assert comm.allgather(mine) == [mine] * size
        exact = bound > max(norms)
        assert exact or min(norms) > bound, norms  # 2.0 clips every step
        for a, b in zip(model.parameters(), replicated.parameters()):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        weights[bound] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.allclose(weights[2.0], weights[1e6], rtol=1e-3), "clipping changed nothing"
    expect_raise(RankInputError, lambda: ShardedOptimizer(
        heads(masks), torch.optim.SGD, masks=masks, lr=0.1,
        max_grad_norm=0 if rank == size - 1 else 1.0), f"rank {size - 1}:", "max_grad_norm")


def test_two_dtypes_shard_on_their_own():
    """float32 and bfloat16 parameters: a reducer and a shard per dtype, one inner optimizer
    over both; equals PacTrainSync + the same optimizer bit for bit (small integers: every
    bfloat16 sum is exact), ranks identical, each dtype's state its shard; a checkpoint
    resumes bit for bit; clipping takes both dtypes' norms."""
    masks = heads_masks("mixed")
    for name, (cls, kwargs) in OPTIMIZERS.items():
        replicated = heads(masks, MixedHeads)
        sync = PacTrainSync(replicated, masks=masks)
        opt = cls(replicated.parameters(), **kwargs)
        sync.attach(opt)
        train(replicated, opt, opt.step)
        train(replicated, opt, opt.step)
        sync.remove()
        model = heads(masks, MixedHeads)
        sharded = ShardedOptimizer(model, cls, masks=masks, **kwargs)
        train(model, sharded, sharded.step)
        resumed = ShardedOptimizer(model, cls, masks=masks, **kwargs)
        resumed.load_state_dict(roundtrip(sharded.state_dict()))
        train(model, resumed, resumed.step)
        for (pname, a), b in zip(model.named_parameters(), replicated.parameters()):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, pname)
        same_on_every_rank([as_array(p.detach().float()) for p in model.parameters()])
        assert [s.dtype for s in resumed.shards] == [torch.bfloat16, torch.float32]
        for group, shard in zip(resumed.groups, resumed.shards):
            state = resumed.optimizer.state[shard]
            assert all(v.numel() == group.reducer.layout.shard_size
                       for v in state.values() if v.dim() == 1)
        expect_raise(AttributeError, lambda: resumed.shard, "2 dtypes", ".groups")
    clipped = ShardedOptimizer(heads(masks, MixedHeads), torch.optim.SGD, masks=masks, lr=0.1,
                               max_grad_norm=1.0)
    train(clipped.model, clipped, clipped.step)
    replicated = heads(masks, MixedHeads)
    sync = PacTrainSync(replicated, masks=masks)
    opt = torch.optim.SGD(replicated.parameters(), lr=0.1)
    norms = []

    def clipped_step():
        sync.synchronize()
        norms.append(float(torch.nn.utils.clip_grad_norm_(replicated.parameters(), 1.0)))
        opt.step()

    train(replicated, opt, clipped_step)
    assert np.isclose(clipped.grad_norm, norms[-1], rtol=1e-2), (clipped.grad_norm, norms)


def test_set_masks_reshards_the_survivors():
    """set_masks between steps: the new survivors are sharded anew (balanced, every survivor
    once), kept coordinates keep their Adam/momentum state and newly kept ones start at 0, so
    the run equals replicated PacTrain (PacTrainSync.set_masks, newly pruned weights zeroed)
    bit for bit; ranks identical; the counters run on."""
    before = heads_masks("mixed")
    g = torch.Generator().manual_seed(5)
    after = {n: m ^ (torch.rand(m.shape, generator=g) < 0.3) for n, m in before.items()}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        replicated, model = heads(before), heads(before)
        sync = PacTrainSync(replicated, masks=before)
        opt = cls(replicated.parameters(), **kwargs)
        sync.attach(opt)
        sharded = ShardedOptimizer(model, cls, masks=before, **kwargs)
        train(replicated, opt, opt.step)
        train(model, sharded, sharded.step)
        old_total = sharded.reducer.layout.total
        sync.set_masks(after)
        sharded.set_masks(after)
        with torch.no_grad():
            for m in (replicated, model):
                for pname, keep in after.items():
                    m.get_parameter(pname).mul_(keep)  # pruning zeroes what it prunes

        def masked_step():
            opt.step()
            with torch.no_grad():  # replicated Adam moves newly pruned weights: keep them 0
                for pname, keep in after.items():
                    replicated.get_parameter(pname).mul_(keep)

        train(replicated, opt, masked_step)
        train(model, sharded, sharded.step)
        for (pname, a), b in zip(model.named_parameters(), replicated.parameters()):
            assert torch.equal(a, b), (name, pname)
        same_on_every_rank([as_array(p.detach()) for p in model.parameters()])
        layout = sharded.reducer.layout
        unmasked = sum(p.numel() for n, p in model.named_parameters() if n not in after)
        assert layout.total == sum(int(m.sum()) for m in after.values()) + unmasked != old_total
        assert layout.counts == balanced_counts(layout.total, size)
        state = sharded.optimizer.state[sharded.shard]
        assert all(v.numel() == layout.shard_size for v in state.values() if v.dim() == 1)
        assert sharded.reducer.stats["steps"] == 2 * STEPS, sharded.reducer.stats
        assert all(torch.equal(sharded.masks[n], after[n]) for n in after)


def test_bad_input_raises_on_every_rank():
    masks = heads_masks("mixed")
    bad = dict(masks)
    if rank == size - 1:
        bad["b.weight"] = torch.ones(4, 8, dtype=torch.bool)
    expect_raise(RankInputError, lambda: ShardedOptimizer(heads(masks), torch.optim.SGD,
                                                          masks=bad, lr=0.1),
                 f"rank {size - 1}: ValueError", "shape (4, 8)")

    other = dict(masks)
    if rank == size - 1:
        other["b.bias"] = torch.tensor([True, True, False])  # same count, other coordinates
    model = heads(masks)
    opt = ShardedOptimizer(model, torch.optim.SGD, masks=other, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    expect_raise(MaskMismatchError, lambda: train(model, opt, opt.step), f"[{size - 1}]")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # nothing moved

    np_masks = mask_cases()["mixed"]
    red = ShardedReducer(np_masks, shapes=SHAPES, dtypes=[np.float32] * len(SHAPES))
    weights = [np.zeros(s, np.float32) for s in SHAPES]

    def grads():
        return [np.ones(s, np.float32) for s in SHAPES]

    def noop(grad, weight):
        pass

    wrong = grads()
    if rank == 0:
        wrong[2] = np.ones((4, 3), np.float32)
    expect_raise(RankInputError, lambda: red.step(wrong, weights, noop), "rank 0:",
                 "gradient 2 has shape (4, 3)")
    odd = [w.astype(np.float64) if rank == size - 1 else w for w in weights]
    expect_raise(RankInputError, lambda: red.step(grads(), odd, noop), f"rank {size - 1}:",
                 "float64")
    red.step(grads(), weights, noop)  # the control: the same call with good input runs
    assert red.stats["steps"] == 1
    np_masks[0][...] = ~np_masks[0]  # in place, on every rank: agreed, but not what is sharded
    expect_raise(ValueError, lambda: red.step(grads(), weights, noop), "masks are fixed")


def train_split(model, opt, steps, world, index):
    """Steps of a fixed global batch split over ``world`` ranks (this one is ``index``) and
    summed (``average=False``): with integer gradients the trajectory is the same at any world
    size, so a run re-sharded midway can be compared with one that was not."""
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(-4, 5, (8, 8), generator=g).float()
        t = torch.randint(-2, 3, (8, 8), generator=g).float()
        rows = slice(index * 8 // world, (index + 1) * 8 // world)
        opt.zero_grad()
        (model(x[rows]) * t[rows]).sum().backward()
        opt.step()


def roundtrip(state):
    """Through torch.save and a default (weights_only) torch.load, as a checkpoint file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_checkpoint_resumes_and_reshards():
    masks = heads_masks("mixed")
    kwargs = dict(masks=masks, average=False, lr=0.01)
    straight = heads(masks)
    opt = ShardedOptimizer(straight, torch.optim.Adam, **kwargs)
    train_split(straight, opt, range(4), size, rank)
    same_on_every_rank([as_array(p.detach()) for p in straight.parameters()])

    # Same world size: resume bit for bit.
    model = heads(masks)
    opt = ShardedOptimizer(model, torch.optim.Adam, **kwargs)
    train_split(model, opt, range(2), size, rank)
    saved, weights = roundtrip(opt.state_dict()), roundtrip(model.state_dict())
    (packed,) = saved["groups"]  # one dtype
    assert packed["sharded"] == ["exp_avg", "exp_avg_sq"]
    assert packed["state"]["exp_avg"].numel() == opt.reducer.layout.total
    resumed = heads({})
    resumed.load_state_dict(weights)
    again = ShardedOptimizer(resumed, torch.optim.Adam, **kwargs)
    again.load_state_dict(saved)
    assert again.reducer.engine.step == 2
    train_split(resumed, again, range(2, 4), size, rank)
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))

    # Another world size, both ways: the first half of the ranks takes over (and hands back).
    half = max(1, size // 2)
    sub = comm.Split(0 if rank < half else MPI.UNDEFINED, rank)
    if sub != MPI.COMM_NULL:
        small = heads({})
        small.load_state_dict(weights)
        small_opt = ShardedOptimizer(small, torch.optim.Adam, comm=sub, **kwargs)
        small_opt.load_state_dict(saved)
        resaved = small_opt.state_dict()  # re-sharding is lossless
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resaved["groups"][0]["state"][key], packed["state"][key])
        train_split(small, small_opt, range(2, 4), half, rank)
        for a, b in zip(small.parameters(), straight.parameters()):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        sub.Free()

    handed = heads(masks)
    if rank < half:
        sub = comm.Split(0, rank)
        first = ShardedOptimizer(handed, torch.optim.Adam, comm=sub, **kwargs)
        train_split(handed, first, range(2), half, rank)
        state = first.state_dict()
        sub.Free()
    else:
        comm.Split(MPI.UNDEFINED, rank)
        state = None
    state = comm.bcast(state if rank == 0 else None, root=0)
    handed.load_state_dict(comm.bcast(handed.state_dict() if rank == 0 else None, root=0))
    wide = ShardedOptimizer(handed, torch.optim.Adam, **kwargs)
    wide.load_state_dict(state)
    train_split(handed, wide, range(2, 4), size, rank)
    for a, b in zip(handed.parameters(), straight.parameters()):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))

    # Negative control: a checkpoint of other masks fails on every rank.
    other = ShardedOptimizer(heads(heads_masks("few")), torch.optim.Adam,
                             masks=heads_masks("few"), average=False, lr=0.01)
    expect_raise(RankInputError, lambda: other.load_state_dict(saved), "surviving weights")
