"""What pacmpi keeps per bucket: masks as bitmaps (chunked reads equal the bool mask's), int32
survivor positions, and memory_report() counting the live arrays; ``pacmpi bench memory`` and
``pacmpi bench hook``."""
import itertools
import json
import os
import sys
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from pacmpi import PacTrainReducer, bitmaps, hashing
from pacmpi.bench import memory
from pacmpi.bitmaps import Bitmap, index_dtype

from mpi_util import mpirun_argv, run_bounded

SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 1001]


def _masks(rng, size):
    """Random, empty, full and single-survivor masks of ``size`` coordinates."""
    yield rng.random(size) < 0.4
    yield np.zeros(size, bool)
    yield np.ones(size, bool)
    if size:
        one = np.zeros(size, bool)
        one[rng.integers(size)] = True
        yield one


@pytest.fixture(params=[8, 16, bitmaps.CHUNK], ids=lambda c: f"chunk{c}")
def chunk(request, monkeypatch):
    monkeypatch.setattr(bitmaps, "CHUNK", request.param)
    return request.param


def test_bitmap_reads_equal_the_bool_mask(chunk):
    rng = np.random.default_rng(0)
    for size in SIZES:
        for mask in _masks(rng, size):
            bitmap = Bitmap(mask)
            assert bitmap.nbytes == (size + 7) // 8 and bitmap.count == mask.sum()
            np.testing.assert_array_equal(bitmap.unpack(), mask)
            positions = bitmap.positions()
            assert positions.dtype == np.int32
            np.testing.assert_array_equal(positions, np.flatnonzero(mask))
            values = rng.standard_normal(size).astype(np.float32)
            values[::5] = np.nan
            expected = values.copy()
            np.copyto(expected, 0, where=~mask)
            bitmap.zero_pruned(values)
            np.testing.assert_array_equal(values, expected)  # NaN where kept, 0 where pruned
            assert bitmap.matches(mask.copy())
            if size:  # negative control: one coordinate flipped is another mask
                other = mask.copy()
                other[rng.integers(size)] ^= True
                assert not bitmap.matches(other)
            assert not bitmap.matches(np.append(mask, True))


def test_joined_bitmaps_are_the_masks_end_to_end(chunk):
    """Parts (bitmaps of odd sizes and all-kept stretches, some over a chunk) whose bits do
    not start on a byte of the result; empty parts and no parts."""
    rng = np.random.default_rng(3)
    for sizes in [(), (0,), (3, 0, 5), (1, 7, 9, 8, 2), (2 * chunk + 3, 5, 17)]:
        for kinds in itertools.product(("bits", "kept"), repeat=len(sizes)):
            masks = [rng.random(n) < 0.5 if kind == "bits" else np.ones(n, bool)
                     for n, kind in zip(sizes, kinds)]
            parts = [Bitmap(m) if kind == "bits" else m.size for m, kind in zip(masks, kinds)]
            whole = np.concatenate(masks) if masks else np.zeros(0, bool)
            joined = Bitmap.joined(np, parts)
            assert (joined.size, joined.count) == (whole.size, whole.sum())
            np.testing.assert_array_equal(joined.bits, np.packbits(whole))
            assert joined.matches(whole)


def test_fingerprint_of_the_bits_is_the_masks_whatever_the_chunking(monkeypatch):
    rng = np.random.default_rng(1)
    masks = [rng.random(size) < 0.3 for size in (0, 5, 32, 33, 4099)]
    whole = [hashing.mask_fingerprint(np, m) for m in masks]
    monkeypatch.setattr(hashing, "_FINGERPRINT_CHUNK", 3)
    assert [hashing.bits_fingerprint(np, Bitmap(m).bits, m.size) for m in masks] == whole
    assert hashing.bits_fingerprint(np, Bitmap(masks[-1]).bits, 4098) != whole[-1]


def test_positions_are_int32_below_2_to_the_31():
    assert index_dtype(2 ** 31) == np.int32
    assert index_dtype(2 ** 31 + 1) == np.int64


def _stepped(quantize, density, size=1001, steps=3, **options):
    mask = np.random.default_rng(2).random(size) < density
    reducer = PacTrainReducer([mask], comm=MPI.COMM_SELF, quantize=quantize, **options)
    for step in range(steps):
        reducer.reduce([np.random.default_rng(step).standard_normal(size).astype(np.float32)])
    return reducer, int(mask.sum())


def test_memory_report_counts_the_live_arrays():
    reducer, kept = _stepped(None, 0.5)
    report = reducer.memory_report()
    # Lossless payloads are the bucket's own front, compacted in place as the mask's bits say:
    # no positions, no buffer.
    assert report == {"indices": 0, "snapshots": (1001 + 7) // 8, "payloads": 0,
                      "words": 0, "residuals": 0, "fusion": 0}
    assert reducer.engine.packed_indices(0).dtype == np.int32  # made when asked for
    assert reducer.memory_report() == dict(report, indices=4 * kept)
    dense, _ = _stepped(None, 1.0)  # nothing pruned: nothing packed
    assert dense.memory_report() == report
    fp16, _ = _stepped("fp16", 0.5)  # a float16 copy of the survivors, gathered by position
    assert fp16.memory_report() == dict(report, indices=4 * kept, payloads=2 * kept)
    # Ternary quantizes the compacted front too: scales read through the bits, no positions.
    ternary, _ = _stepped("ternary", 0.5)
    report = ternary.memory_report()
    assert report["indices"] == 0
    assert report["residuals"] == 0 and report["payloads"] == 0  # error feedback is off
    codec = ternary.engine.codec
    assert report["words"] == codec.words_for(kept) * codec.word_dtype.itemsize > 0
    # With error feedback: the survivors' residual, updated by the encode (no spare).
    with_feedback, _ = _stepped("ternary", 0.5, error_feedback=True)
    assert with_feedback.memory_report() == dict(report, residuals=4 * kept)


def test_a_residual_is_cut_to_its_survivors_in_place():
    """The step a mask starts being packed compacts the dense steps' full-length residual and
    cuts it in place: the survivors' residual never sits beside the full one (that was 0.5x
    of the gradient bytes more, at density 0.5). The values are those of a copy's."""
    size = 1 << 20
    mask = np.random.default_rng(0).random(size) < 0.5
    grads = [np.random.default_rng(1 + s).standard_normal(size).astype(np.float32)
             for s in range(4)]
    reducers = [PacTrainReducer([mask], comm=MPI.COMM_SELF, quantize="ternary",
                                error_feedback=True, stable_steps=2) for _ in range(2)]
    tracemalloc.start()
    try:
        extra = []
        for step, grad in enumerate(grads):
            one, other = grad.copy(), grad.copy()
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            reducers[0].reduce([one])
            extra.append((tracemalloc.get_traced_memory()[1] - before) / grad.nbytes)
            if step == 1:  # the other one's residual is held by another name: copied instead
                held = reducers[1].engine.residuals[0].values  # noqa: F841
            reducers[1].reduce([other])
            np.testing.assert_array_equal(one, other)
    finally:
        tracemalloc.stop()
    stats = reducers[0].stats
    assert stats["dense_reductions"] >= 1 and stats["packed_reductions"] >= 1  # a transition
    # After the first step (which builds the layout and loads the kernels): words, bits and
    # scales only, no second residual.
    assert max(extra[1:]) < 0.25, extra
    kept = int(mask.sum())
    for reducer in reducers:
        assert reducer.memory_report()["residuals"] == 4 * kept


def test_buckets_reduced_one_after_another_share_one_payload_buffer():
    rng = np.random.default_rng(3)
    sizes = [300, 500, 200]
    masks = [rng.random(n) < 0.5 for n in sizes]
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    blocking = PacTrainReducer(masks, comm=MPI.COMM_SELF, bucket_bytes=64, quantize="fp16",
                               stable_steps=0)
    overlapped = PacTrainReducer(masks, comm=MPI.COMM_SELF, bucket_bytes=64, quantize="fp16",
                                 stable_steps=0)
    for _ in range(3):
        one, other = [g.copy() for g in grads], [g.copy() for g in grads]
        blocking.reduce(one)
        overlapped.start(other)
        overlapped.wait(other)
        for a, b, g, m in zip(one, other, grads, masks):
            expected = (g * m).astype(np.float16).astype(np.float32)
            np.testing.assert_array_equal(a, expected)
            np.testing.assert_array_equal(b, expected)
    assert len(blocking.layout) == 3 and blocking.stats["packed_reductions"] == 9
    kept = [int(m.sum()) for m in masks]
    assert blocking.memory_report()["payloads"] == 2 * max(kept)  # one, the largest
    assert overlapped.memory_report()["payloads"] == 2 * sum(kept)  # in flight together


def test_bench_memory_rows_add_up():
    rows = memory.run(elements=4096, densities=(1.0, 0.5), modes=("lossless", "ternary"),
                      steps=2, comm=MPI.COMM_SELF)
    assert [(r["mode"], r["density"]) for r in rows] == [
        ("lossless", 1.0), ("lossless", 0.5), ("ternary", 1.0), ("ternary", 0.5)]
    for row in rows:
        assert row["kept"] == pytest.approx(sum(row[c] for c in memory.COMPONENTS))
        assert row["peak"] >= 0
    # Both compacted in place as the mask's bits say: no positions, no payload buffer; with
    # error feedback one residual of the survivors (0.5x of the gradient), no spare.
    for row in rows[1], rows[3]:
        assert row["indices"] == 0 and row["payloads"] == 0
    assert rows[3]["residuals"] == 0.5
    assert "indices" in memory.format_table(rows).splitlines()[0]


@pytest.mark.mpi
def test_bench_hook_rows_on_two_ranks(tmp_path):
    """``pacmpi bench hook`` on 2 ranks, both parts, small: every rank exits 0 (gloo's exit
    abort once failed it); memory rows add up, the lossless hook keeps no payload (its DDP
    buckets are compacted in place, driven by a bitmap); time rows carry pacmpi's wall and
    CPU time, the control rows (pacmpi reducing a tensor of its own in DDP's hook) too."""
    out = tmp_path / "hook.json"
    argv = mpirun_argv(2) + [sys.executable, "-m", "pacmpi.cli", "bench", "hook", "--layers",
                             "2", "--width", "64", "--densities", "0.5", "--tensors", "4,8",
                             "--time-width", "16", "--steps", "2", "--control",
                             "--json", str(out)]
    done = run_bounded(argv, timeout=240, what="pacmpi bench hook",
                       env=dict(os.environ, MASTER_PORT="29541", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["memory"]}
    assert set(rows) == {"lossless", "ternary"}
    for row in rows.values():
        assert row["kept"] == pytest.approx(sum(row[c] for c in memory.COMPONENTS))
    # The group's survivors as one bitmap (1 bit per float32 coordinate), no positions.
    assert rows["lossless"]["payloads"] == 0 and 0 < rows["lossless"]["indices"] <= 1 / 32
    timed = [row for row in report["time"] if row["mode"] != "plain"]
    assert [(row["tensors"], row["mode"]) for row in timed] == [
        (count, mode) for count in (4, 8) for mode in ("lossless", "ternary", "control")]
    assert all(0 < row["pacmpi_cpu_ms"] and 0 < row["pacmpi_ms"] < row["step_ms"]
               for row in timed)
    assert "cpu(ms)" in done.stdout
