"""Multi-rank checks of PacTrainReducer: every rank runs these tests in this order under
mpirun (tests/test_core_mpi.py), and each is reported on its own."""
import pickle
import time

import numpy as np
from mpi4py import MPI

from pacmpi import (
    LayoutMismatchError,
    MaskMismatchError,
    MPICollectives,
    PacTrainReducer,
    RankInputError,
)
from pacmpi.arrays import supported_float_dtypes
from pacmpi.hashing import uniform_from
from pacmpi.ternary import stochastic_ternary, ternary_key

from mismatch_checks import expect_raise

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
SHAPES = [(17, 5), (), (0,), (33,), (4, 4, 3), (1,), (9,)]


def shared_masks(seed=42, density=0.4):
    rng = np.random.default_rng(seed)  # same seed on every rank: identical masks
    return [None if i in (1, 6) else rng.random(s) < density for i, s in enumerate(SHAPES)]


def integer_grads(step, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + 10 * step + rank)
    return [rng.integers(-8, 9, size=s).astype(dtype) for s in SHAPES]


def dense_reference(grads, masks, average):
    out = []
    for g, m in zip(grads, masks):
        x = np.array(g, dtype=np.float64, order="C")
        if m is not None:
            x *= m
        comm.Allreduce(MPI.IN_PLACE, x)
        out.append(x / world if average else x)
    return out


def assert_exact(grads, reference, what):
    for i, (g, r) in enumerate(zip(grads, reference)):
        expected = r.astype(g.dtype)
        if not np.array_equal(g, expected):
            raise AssertionError(f"{what}: gradient {i} differs: {g} vs {expected}")


def test_exact():
    masks = shared_masks()
    shapes = SHAPES
    for dtype in supported_float_dtypes():
        for bucket_bytes in (8, 64, 1 << 20):
            for quantize in (None, "fp16"):
                for mode in ("reduce", "async"):
                    for average in (False, True):
                        red = PacTrainReducer(masks, quantize=quantize, average=average,
                                              bucket_bytes=bucket_bytes, shapes=shapes,
                                              dtypes=[dtype] * len(shapes))
                        for step in range(3):
                            grads = integer_grads(step, dtype)
                            reference = dense_reference(grads, masks, average)
                            if mode == "reduce":
                                red.reduce(grads)
                            else:  # per-rank order differs; launches must stay in index order
                                order = np.random.default_rng(rank + step).permutation(
                                    len(red.layout))
                                for b in order:
                                    red.mark_ready(int(b), grads)
                                    for _ in range(rank + 1):  # local: counts may differ
                                        red.progress()
                                red.wait(grads)
                            assert_exact(grads, reference, f"{dtype} {bucket_bytes} {quantize} "
                                         f"{mode} avg={average} step {step}")
                        masked_buckets = sum(
                            1 for s in red.tracker.buckets if s.mask is not None
                            and s.survivors < s.mask.size)
                        assert red.stats["packed_reductions"] == 2 * masked_buckets, red.stats
                        assert red.stats["dense_fallbacks"] == masked_buckets, red.stats


def test_progress_moves_a_posted_all_reduce_to_its_end():
    """``MPICollectives.progress`` (MPI_Test) moves a posted all-reduce on without a wait: one
    of 64 MiB, far beyond eager sizes, ends from those calls alone, summed exactly; its wait
    then returns at once."""
    collectives = MPICollectives()
    buf = np.full(1 << 24, rank + 1, np.float32)
    request = collectives.iallreduce(buf)
    deadline = time.monotonic() + 120
    while not request.test():
        collectives.progress([request])
        assert time.monotonic() < deadline, "progress() never completed the all-reduce"
    assert (buf == world * (world + 1) // 2).all()  # there once test() says so, no wait()
    request.wait()  # a completed request: returns at once


def test_nonfinite_in_place():
    """Packed lossless buckets are moved to the front of the gradients' own storage (views) or
    of the reducer's buffer and back: NaN and Inf of kept coordinates reach every rank as a
    dense all-reduce gives them, pruned ones come back 0, every dtype, with averaging."""
    masks = shared_masks(seed=7, density=0.5)
    for dtype in supported_float_dtypes():
        for bucket_bytes in (8, 1 << 20):
            red = PacTrainReducer(masks, average=True, bucket_bytes=bucket_bytes,
                                  stable_steps=0)
            for step in range(2):
                grads = integer_grads(step, dtype, seed=3)
                rng = np.random.default_rng(step)  # the same places on every rank
                for g in grads:
                    if g.size and rng.random() < 0.6:
                        g.reshape(-1)[rng.integers(g.size)] = [np.nan, np.inf, -np.inf][
                            (rank + step) % 3]
                exact = [np.where(m, g.astype(np.float64), 0) if m is not None else g
                         for g, m in zip(grads, masks)]
                reference = dense_reference(exact, [None] * len(grads), True)
                red.reduce(grads)
                for i, (g, r) in enumerate(zip(grads, reference)):
                    expected = r.astype(g.dtype)
                    assert np.array_equal(g, expected, equal_nan=True), (dtype, bucket_bytes, i,
                                                                         g, expected)
            assert red.stats["packed_reductions"] > 0 and red.stats["dense_fallbacks"] == 0


def test_ternary():
    """Against an oracle built from the public pieces: per segment (each gradient of a bucket
    with ternary_scale="tensor", the whole bucket with "bucket", each run of 5 elements of a
    gradient with 5) the scale is the MAX over
    ranks of its largest |value + residual| over what is sent, and its codes are
    stochastic_ternary's with the bucket's key moved to the segment's first payload value.
    With ``stable_steps=2`` the second step is still dense with a residual (kept for the
    survivors only: the oracle's is every coordinate's, 0 where pruned)."""
    masks = shared_masks()
    for scale_mode, stable_steps in (("tensor", 1), ("bucket", 1), (5, 1), ("tensor", 2)):
        for error_feedback in (False, True):
            red = PacTrainReducer(masks, quantize="ternary", average=False, bucket_bytes=64,
                                  error_feedback=error_feedback, seed=5,
                                  ternary_scale=scale_mode, stable_steps=stable_steps)
            for step in range(4):
                rng = np.random.default_rng(step * 7 + rank)
                grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
                originals = [g.copy() for g in grads]
                residuals = red.state_dict()["residuals"]
                red.reduce(grads)
                for b, bucket in enumerate(red.layout.buckets):
                    check_ternary_bucket(red, b, bucket, originals, grads, residuals, step,
                                         scale_mode, error_feedback)


def check_ternary_bucket(red, b, bucket, originals, grads, residuals, step, scale_mode,
                         error_feedback):
    state = red.tracker.buckets[b]
    flat = np.concatenate([originals[m.index].reshape(-1) for m in bucket.members])
    mask = np.ones(bucket.size, bool) if state.mask is None else state.mask.unpack()
    flat = flat * mask
    if error_feedback and b in residuals:
        flat = flat + residuals[b] * mask
    tensors = [0, bucket.size] if scale_mode == "bucket" else \
        np.concatenate([[0], np.cumsum([m.size for m in bucket.members])])
    offsets = tensors if isinstance(scale_mode, str) else np.unique(np.concatenate(
        [np.arange(lo, hi, scale_mode) for lo, hi in zip(tensors, tensors[1:])] + [tensors]))
    # The payload: the survivors when packed, the whole (masked) bucket when dense.
    kept = mask if state.packed else np.ones(bucket.size, bool)
    starts = [int(kept[:o].sum()) for o in offsets]
    values = flat[kept]
    scales = np.array([np.abs(values[s0:s1]).max() if s1 > s0 else 0.0
                       for s0, s1 in zip(starts, starts[1:])])
    comm.Allreduce(MPI.IN_PLACE, scales, op=MPI.MAX)
    key = ternary_key(5, step, b, rank)
    codes = np.concatenate([
        stochastic_ternary(np, values[s0:s1].astype(np.float32), scale, uniform_from(key, s0))
        for s0, s1, scale in zip(starts, starts[1:], scales)]).astype(np.int64)
    code_sum = codes.copy()
    comm.Allreduce(MPI.IN_PLACE, code_sum)
    per_value = np.repeat(scales, np.diff(starts)).astype(np.float32)
    expected = np.zeros(bucket.size, np.float32)
    expected[kept] = code_sum.astype(np.float32) * per_value
    got = np.concatenate([grads[m.index].reshape(-1) for m in bucket.members])
    wrong = np.flatnonzero(got != expected)
    assert np.array_equal(got, expected), (scale_mode, step, b, state.packed, wrong,
                                           got[wrong], expected[wrong], scales)
    if error_feedback:  # g + r_old == q + r_new
        new = red.state_dict()["residuals"][b][kept]
        np.testing.assert_allclose(codes * per_value + new, values, rtol=0,
                                   atol=1e-6 * max(scales.max(), 1))


def test_ternary_small_tensor_next_to_a_huge_one():
    """Two tensors in one bucket, gradients 1e6 apart: with per-tensor scales the small one
    is quantized with the MAX over ranks of its own |values| (decoded sums are multiples of
    it), with one bucket scale it comes back all zero (negative control); every rank decodes
    the same values."""
    for mode in ("tensor", "bucket"):
        red = PacTrainReducer([None, None], quantize="ternary", average=False,
                              error_feedback=False, seed=3, ternary_scale=mode)
        for step in range(3):
            rng = np.random.default_rng(100 * step + rank)
            grads = [(rng.standard_normal(500) * 1e3).astype(np.float32),
                     ((1 + rng.random(50)) * 1e-3).astype(np.float32)]
            small_scale = comm.allreduce(float(np.abs(grads[1]).max()), op=MPI.MAX)
            red.reduce(grads)
            assert len(red.layout) == 1, red.layout.buckets
            gathered = comm.allgather(np.concatenate([g.reshape(-1) for g in grads]))
            assert all(np.array_equal(g, gathered[0]) for g in gathered), "ranks differ"
            if mode == "bucket":
                assert not grads[1].any(), grads[1]
                continue
            digits = grads[1] / np.float32(small_scale)
            assert grads[1].any() and (grads[1] >= 0).all(), grads[1]
            np.testing.assert_allclose(digits, np.round(digits), rtol=0, atol=1e-4)
            assert np.round(digits).max() <= world
    expect_raise(RankInputError, lambda: PacTrainReducer([None], ternary_scale="layer"),
                 "ternary_scale must be one of ('tensor', 'bucket') or a positive int "
                 "(elements per scale), got 'layer'")


def rank1_positions_moved(masks):
    if rank != 1:
        return masks
    moved = list(masks)
    moved[0] = np.roll(masks[0], 1)  # same survivor count, different coordinates
    return moved


def test_mismatch():
    masks = rank1_positions_moved(shared_masks())
    red = PacTrainReducer(masks, average=False)
    grads = integer_grads(0, np.float32)
    before = [g.copy() for g in grads]
    exc = expect_raise(MaskMismatchError, lambda: red.reduce(grads), "offending ranks: [1]")
    assert exc.offending_ranks == (1,)
    fingerprints = [d["buckets"][0]["fingerprint"] for d in exc.details.values()]
    assert fingerprints[0] != fingerprints[1] and fingerprints[0] in str(exc)
    assert fingerprints[1] in str(exc)
    assert all(np.array_equal(g, b) for g, b in zip(grads, before)), "nothing may be summed"


def test_resync():
    reference_masks = shared_masks()
    masks = rank1_positions_moved([None if m is None else m.copy() for m in reference_masks])
    red = PacTrainReducer(masks, average=False, on_mismatch="resync", stable_steps=0)
    for step in range(3):
        grads = integer_grads(step, np.float32)
        reference = dense_reference(grads, reference_masks, False)
        red.reduce(grads)
        assert_exact(grads, reference, f"resync step {step}")
    assert all(m is None or np.array_equal(m, r) for m, r in zip(masks, reference_masks))
    assert red.stats["resyncs"] == 1, red.stats
    assert red.stats["packed_reductions"] > 0


def test_layout():
    dtypes = [np.float32] * len(SHAPES)
    cases = {
        "length": dict(shapes=[(18, 5) if i == 0 and rank == 1 else s
                               for i, s in enumerate(SHAPES)]),
        "dtype": dict(dtypes=[np.float64 if rank == 1 else np.float32] * len(SHAPES)),
        "buckets": dict(bucket_bytes=8 if rank == 1 else 1 << 20),
        "quantize": dict(quantize="fp16" if rank == 1 else None),
        "scale blocks": dict(quantize="ternary", ternary_scale=8 if rank == 1 else 16),
        "scale tensor/blocks": dict(quantize="ternary",
                                    ternary_scale=1 << 20 if rank == 1 else "tensor"),
    }
    for name, case in cases.items():
        shapes = case.get("shapes", SHAPES)
        case_dtypes = case.get("dtypes", dtypes)
        masks = [None] * len(shapes)
        red = PacTrainReducer(masks, quantize=case.get("quantize"),
                              bucket_bytes=case.get("bucket_bytes", 1 << 20),
                              ternary_scale=case.get("ternary_scale", "tensor"))
        grads = [np.ones(s, dtype=d) for s, d in zip(shapes, case_dtypes)]
        expect_raise(LayoutMismatchError, lambda: red.reduce(grads), "offending ranks")


def test_bad_input():
    masks = shared_masks()
    red = PacTrainReducer(masks)
    grads = integer_grads(0, np.float32)
    if rank == world - 1:
        grads[0] = grads[0].astype(np.int64)
    expect_raise(RankInputError, lambda: red.reduce(grads),
                 f"rank {world - 1}: TypeError: gradient 0 dtype int64 is not supported")
    bad = [None if m is None else m.astype(np.int8) for m in shared_masks()]
    if rank == 1:
        bad[0][0, 0] = 2
    expect_raise(RankInputError, lambda: PacTrainReducer(bad), "found value 2")
    expect_raise(RankInputError, lambda: PacTrainReducer(masks, quantize="binary"),
                 "quantize must be one of", "'binary'")


def test_edges():
    masks = shared_masks()
    wrong_shape = list(masks)
    if rank == 1:
        wrong_shape[0] = np.ones((5, 17), bool)
    expect_raise(RankInputError, lambda: PacTrainReducer(wrong_shape, shapes=SHAPES,
                                                         dtypes=[np.float32] * len(SHAPES)),
                 "rank 1: ValueError: mask 0 has shape (5, 17)")
    red = PacTrainReducer(masks, shapes=SHAPES, dtypes=[np.float32] * len(SHAPES))
    expect_raise(RankInputError, lambda: red.set_masks(wrong_shape),
                 "rank 1: ValueError: mask 0 has shape (5, 17), expected (17, 5)")
    red.set_masks(masks)
    expect_raise(RankInputError, lambda: PacTrainReducer(masks, on_mismatch="ignore"),
                 "on_mismatch must be one of", "'ignore'")

    # All-zero and all-ones masks: nothing / everything survives, no packing needed for ones.
    extremes = [np.zeros((17, 5), bool), np.ones((33,), bool)]
    red = PacTrainReducer(extremes, average=False, bucket_bytes=64, stable_steps=0)
    for step in range(2):
        grads = [np.full((17, 5), rank + 1.0, np.float32), np.full(33, rank + 1.0, np.float32)]
        sent = red.stats["bytes_sent"]
        red.reduce(grads)
        assert not grads[0].any() and (grads[1] == world * (world + 1) / 2).all()
        assert red.stats["bytes_sent"] - sent == 33 * 4, "zero mask sends nothing"
    assert red.stats["packed_reductions"] == 2  # the all-zero bucket, packed to length 0

    # NaN/Inf: packed and dense steps treat survivors and pruned coordinates alike.
    for quantize in (None, "ternary"):
        red = PacTrainReducer(masks, average=False, stable_steps=1, quantize=quantize)
        survivor, pruned = np.flatnonzero(masks[0])[0], np.flatnonzero(~masks[0])[0]
        results = []
        for step in range(2):  # step 0 dense (new mask), step 1 packed
            grads = integer_grads(step, np.float32)
            grads[0].reshape(-1)[pruned] = np.nan
            if rank == 0:
                grads[0].reshape(-1)[survivor] = np.inf
            red.reduce(grads)
            results.append(grads[0].reshape(-1))
        for r in results:
            assert r[pruned] == 0 and np.isposinf(r[survivor]), (quantize, r)
            assert np.isfinite(np.delete(r, survivor)).all()
        if quantize:
            assert red.stats["nonfinite_fallbacks"] >= 2
            assert all(np.isfinite(v).all() for v in red.state_dict()["residuals"].values())

    # Non-contiguous gradients are reduced correctly (and written back in place).
    base = [np.stack([g, g]) for g in integer_grads(0, np.float32)]
    grads = [b[0, ...] if b.ndim < 2 else np.swapaxes(b, 0, -1)[..., 0] for b in base]
    assert not all(g.flags.c_contiguous for g in grads)
    red = PacTrainReducer([None] * len(grads), average=False)
    reference = dense_reference(grads, [None] * len(grads), False)
    red.reduce(grads)
    assert_exact(grads, reference, "non-contiguous")


def test_mask_change():
    masks = shared_masks()
    red = PacTrainReducer(masks, average=False, stable_steps=1)
    fallbacks = []
    for step in range(6):
        if step == 3:  # every rank prunes further, in the same step
            masks[0][...] &= np.arange(masks[0].size).reshape(masks[0].shape) % 2 == 0
        grads = integer_grads(step, np.float32)
        reference = dense_reference(grads, masks, False)
        before = red.stats["dense_fallbacks"]
        red.reduce(grads)
        assert_exact(grads, reference, f"mask change step {step}")
        fallbacks.append(red.stats["dense_fallbacks"] - before)
    everyone = comm.allgather(fallbacks)
    assert all(f == everyone[0] for f in everyone), everyone
    assert fallbacks[3] == 1 and fallbacks[4] == 0 and fallbacks[0] > 0, fallbacks
    assert red.tracker.version == 2


def test_state():
    masks = shared_masks()
    original = PacTrainReducer(masks, quantize="ternary", error_feedback=True, average=True, seed=3,
                               shapes=SHAPES, dtypes=[np.float32] * len(SHAPES))

    def grads_at(step):
        rng = np.random.default_rng(100 + step + rank)
        return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]

    for step in range(3):
        original.reduce(grads_at(step))
    saved = original.state_dict()
    clone = pickle.loads(pickle.dumps(original))
    restored = PacTrainReducer(masks, quantize="ternary", error_feedback=True, average=True, seed=3,
                               shapes=SHAPES, dtypes=[np.float32] * len(SHAPES))
    restored.load_state_dict(saved)
    for step in range(3, 5):
        results = []
        for red in (original, clone, restored):
            grads = grads_at(step)
            red.reduce(grads)
            results.append(grads)
        for other in results[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(results[0], other)), step
    every3 = PacTrainReducer(masks, verify_every=3)
    for step in range(6):
        every3.reduce(integer_grads(step, np.float32))
    assert every3.stats["verifications"] == 2, every3.stats
    wrong = PacTrainReducer(masks, quantize=None, shapes=SHAPES, dtypes=[np.float32] * len(SHAPES))
    expect_raise(RankInputError, lambda: wrong.load_state_dict(saved), "quantize='ternary'")
