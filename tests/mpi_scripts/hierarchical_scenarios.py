"""Multi-rank checks of PacTrainReducer(hierarchical=True): every rank runs these tests in this
order under mpirun (tests/test_hierarchical.py), and each is reported on its own.

The environment variable PACMPI_TEST_RANKS_PER_NODE is a number (node communicator: COMM_WORLD
split as rank // RANKS_PER_NODE) or ``default`` (the reducer finds the nodes itself); unset (the
shared launches of tests/mpi_util.py), two nodes of half the ranks each.
"""
import math
import os
import pickle
import socket

import numpy as np
from mpi4py import MPI

from pacmpi import MaskMismatchError, PacTrainReducer, RankInputError
from pacmpi.arrays import supported_float_dtypes

from core_scenarios import (
    SHAPES,
    assert_exact,
    dense_reference,
    expect_raise,
    integer_grads,
    shared_masks,
)

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
PER_NODE = os.environ.get("PACMPI_TEST_RANKS_PER_NODE", str(max(1, world // 2)))
NODE = None if PER_NODE == "default" else comm.Split(rank // int(PER_NODE), key=rank)


def hierarchical(masks, **kwargs):
    return PacTrainReducer(masks, hierarchical=True, node_comm=NODE, **kwargs)


def bits(arrays):
    return [a.tobytes() for a in arrays]


def test_exact():
    """Lossless and float16 payloads: the hierarchical sums are the flat reducer's, bit for
    bit, in blocking and nonblocking modes, with equal counters."""
    masks = shared_masks()
    cases = [(dtype, None, False, "reduce") for dtype in supported_float_dtypes()] + [
        (np.float32, None, True, "async"), (np.float32, "fp16", True, "reduce"),
        (np.float16, "fp16", False, "async")]
    for dtype, quantize, average, mode in cases:
        options = dict(quantize=quantize, average=average, bucket_bytes=64, shapes=SHAPES,
                       dtypes=[dtype] * len(SHAPES))
        flat, hier = PacTrainReducer(masks, **options), hierarchical(masks, **options)
        for step in range(3):
            grads = integer_grads(step, dtype)
            mine = [g.copy() for g in grads]
            flat.reduce(grads)
            if mode == "reduce":
                hier.reduce(mine)
            else:  # launches stay in index order whatever order buckets become ready in
                for b in reversed(range(len(hier.layout))):
                    hier.mark_ready(b, mine)
                hier.wait(mine)
            what = f"{dtype} {quantize} avg={average} {mode} step {step}"
            assert bits(mine) == bits(grads), what
            if not average:
                assert_exact(mine, dense_reference(integer_grads(step, dtype), masks, False),
                             what)
        for key in ("packed_reductions", "dense_reductions", "dense_fallbacks",
                    "verifications", "bytes_sent"):
            assert flat.stats[key] == hier.stats[key], (key, flat.stats, hier.stats)
        assert hier.stats["packed_reductions"] > 0


def test_ternary():
    """Unbiased: the mean of many quantized node sums is the exact average within a
    statistical bound (biased rounding fails the same check); every result lies on the lattice
    of K node codes in base-(2K+1) words."""
    steps, count = 120, 2000
    mask = np.random.default_rng(5).random(count) < 0.6

    def values(r):  # multiples of 1/64 in [-1, 1]: node sums are exact in float32
        return np.random.default_rng(r).integers(-64, 65, count).astype(np.float32) / 64

    red = hierarchical([mask], quantize="ternary", error_feedback=False, stable_steps=0)
    nodes, layout = red.collectives.nodes, red.collectives.node_layout
    assert red.engine.codec.world_size == nodes and red.engine.codec.base == 2 * nodes + 1
    flat = PacTrainReducer([mask], quantize="ternary")
    assert flat.engine.codec.base == 2 * world + 1
    assert red.engine.codec.digits_per_word >= flat.engine.codec.digits_per_word
    node_sums = [sum(values(r).astype(np.float64) for r in members) * mask
                 for members in layout]
    scale = max(np.abs(s).max() for s in node_sums)
    exact = sum(node_sums) / world
    total = np.zeros(count)
    for step in range(steps):
        grads = [values(rank)]
        red.reduce(grads)
        codes = grads[0].astype(np.float64) * world / scale
        assert np.allclose(codes, np.rint(codes), rtol=0, atol=1e-4), step
        assert np.abs(np.rint(codes)).max() <= nodes and not grads[0][~mask].any(), step
        total += grads[0]
    tolerance = scale * math.sqrt(nodes) / (2 * world * math.sqrt(steps))  # sigma of the mean

    def unbiased(estimate):
        error = np.abs(estimate - exact)[mask]
        return error.mean() < tolerance and error.max() < 6 * tolerance

    assert unbiased(total / steps), (np.abs(total / steps - exact).max(), tolerance)
    # Negative control: node sums rounded to the nearest code (biased) fail the same check.
    assert not unbiased(sum(np.rint(s / scale) * scale for s in node_sums) / world)
    # Inf on one rank (a non-leader where there is one) and NaN at a pruned coordinate: the
    # bucket travels unquantized, as on the flat path.
    kept, pruned = np.flatnonzero(mask)[0], np.flatnonzero(~mask)[0]
    grads = [values(rank)]
    grads[0][pruned] = np.nan
    if rank == world - 1:
        grads[0][kept] = np.inf
    red.reduce(grads)
    assert np.isposinf(grads[0][kept]) and grads[0][pruned] == 0, grads[0][[kept, pruned]]
    assert np.isfinite(np.delete(grads[0], kept)).all() and red.stats["nonfinite_fallbacks"] == 1


def test_ternary_scales_per_tensor():
    """Per-tensor scales come from the node sums: a small tensor in one bucket with a huge one
    decodes to multiples of the MAX over nodes of its own |node sum| (divided by the ranks);
    one bucket scale zeroes it (negative control)."""
    def grads_of(r):
        rng = np.random.default_rng(r)
        return [(rng.standard_normal(300) * 1e3).astype(np.float32),
                ((1 + rng.random(40)) * 1e-3).astype(np.float32)]

    node_sums = [sum(grads_of(r)[1].astype(np.float64) for r in members)
                 for members in hierarchical([None]).collectives.node_layout]
    small_scale = max(np.abs(s).max() for s in node_sums)
    for mode in ("tensor", "bucket"):
        red = hierarchical([None, None], quantize="ternary", error_feedback=False,
                           ternary_scale=mode)
        grads = grads_of(rank)
        red.reduce(grads)
        if mode == "bucket":
            assert not grads[1].any(), grads[1]
            continue
        codes = grads[1].astype(np.float64) * world / small_scale
        assert grads[1].any() and np.allclose(codes, np.rint(codes), rtol=0, atol=1e-3), codes
        assert np.rint(codes).max() <= red.collectives.nodes


def test_state():
    """Error feedback keeps the node sums' residuals on the leaders only (sum over leaders of
    node sum + r_old - r_new is the decoded sum); state_dict round trips and, with the default
    nodes, pickling, continue bit for bit."""
    masks = shared_masks()
    dtypes = [np.float32] * len(SHAPES)

    def make():
        return hierarchical(masks, quantize="ternary", error_feedback=True, average=False,
                            seed=3, shapes=SHAPES, dtypes=dtypes)

    def grads_at(step):
        rng = np.random.default_rng(100 + step + rank)
        return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]

    original = make()
    for step in range(3):
        before = original.state_dict()["residuals"]
        grads = grads_at(step)
        flats = [np.concatenate([grads[m.index].reshape(-1) for m in bucket.members]).astype(
            np.float64) for bucket in original.layout.buckets]
        original.reduce(grads)
        after = original.state_dict()["residuals"]
        assert bool(after) == original.collectives.is_leader, (rank, sorted(after))
        for b, bucket in enumerate(original.layout.buckets):
            state = original.tracker.buckets[b]
            moved = flats[b] * (1 if state.mask is None else state.mask.unpack())
            if b in after:
                moved += before.get(b, 0) - after[b]
            comm.Allreduce(MPI.IN_PLACE, moved)
            got = np.concatenate([grads[m.index].reshape(-1) for m in bucket.members])
            np.testing.assert_allclose(got, moved, rtol=0, atol=1e-5 * max(1, abs(got).max()))
    saved = original.state_dict()
    restored = make()
    restored.load_state_dict(saved)
    copies = [restored] + ([pickle.loads(pickle.dumps(original))] if NODE is None else [])
    for step in range(3, 5):
        expected = grads_at(step)
        original.reduce(expected)
        for red in copies:
            grads = grads_at(step)
            red.reduce(grads)
            assert bits(grads) == bits(expected), step


def moved_on(victim, masks):
    """``masks`` with mask 0's survivors shifted by one on rank ``victim`` only: the same
    survivor count, other coordinates."""
    if rank != victim:
        return masks
    return [np.roll(masks[0], 1)] + list(masks[1:])


def victims():
    """The last node's leader and the last non-leader, leaving out rank 0 (the reference,
    which wins a tie of two ranks)."""
    layout = hierarchical([None]).collectives.node_layout
    non_leaders = [r for members in layout for r in members[1:]]
    return sorted({layout[-1][0], *non_leaders[-1:]} - {0})


def test_mismatch():
    for victim in victims():
        red = hierarchical(moved_on(victim, shared_masks()), average=False)
        grads = integer_grads(0, np.float32)
        before = [g.copy() for g in grads]
        exc = expect_raise(MaskMismatchError, lambda: red.reduce(grads),
                           f"offending ranks: [{victim}]")
        assert exc.offending_ranks == (victim,)
        assert bits(grads) == bits(before), "nothing may be summed"


def test_resync():
    reference_masks = shared_masks()
    victim = victims()[-1]
    masks = moved_on(victim, [None if m is None else m.copy() for m in reference_masks])
    red = hierarchical(masks, average=False, on_mismatch="resync", stable_steps=0)
    for step in range(3):
        grads = integer_grads(step, np.float32)
        reference = dense_reference(grads, reference_masks, False)
        red.reduce(grads)
        assert_exact(grads, reference, f"resync step {step}")
    assert all(m is None or np.array_equal(m, r) for m, r in zip(masks, reference_masks))
    assert red.stats["resyncs"] == 1 and red.stats["packed_reductions"] > 0, red.stats


def test_bad_node_comm():
    masks = shared_masks()
    halves = comm.Split(rank % 2, key=rank)  # COMM_WORLD has ranks outside each half
    expect_raise(RankInputError, lambda: PacTrainReducer(masks, comm=halves, hierarchical=True,
                                                         node_comm=comm),
                 "node_comm is not a sub-communicator of comm: its ranks")
    pairs = comm.Split(rank // 2, key=rank)
    claimed = MPI.COMM_SELF if rank == 1 else pairs  # rank 0 says {0, 1}, rank 1 says {1}
    expect_raise(RankInputError, lambda: hierarchical_on(claimed),
                 "rank 0: ValueError: node_comm is inconsistent: comm rank 0's node is ranks "
                 "[0, 1], but rank 1 says its node is ranks [1]")
    expect_raise(RankInputError, lambda: hierarchical_on(42 if rank == world - 1 else pairs),
                 f"rank {world - 1}: TypeError: node_comm must be an mpi4py intracommunicator, "
                 "got 42")
    expect_raise(ValueError, lambda: PacTrainReducer(masks, node_comm=pairs),
                 "node_comm= needs hierarchical=True")
    assert hierarchical_on(pairs).collectives.nodes == (world + 1) // 2  # negative control


def test_nodes():
    """Found nodes are the hosts (the node test bed gives each its own host name and network
    namespace); each node's ranks are consecutive, its leader the lowest."""
    layout = hierarchical([None]).collectives.node_layout
    hosts = comm.allgather(socket.gethostname())
    assert len(layout) == len(set(hosts)), (layout, hosts)
    assert all(len({hosts[r] for r in members}) == 1 for members in layout), (layout, hosts)
    assert all(list(m) == sorted(m) for m in layout), layout


def hierarchical_on(node_comm):
    return PacTrainReducer(shared_masks(), hierarchical=True, node_comm=node_comm)
