"""Per-tensor ternary scales: the segment table and its encoding, on one process (the
multi-rank checks are in mpi_scripts/core_scenarios.py)."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacmpi import kernels
from pacmpi.arrays import supported_float_dtypes
from pacmpi.bitmaps import Bitmap
from pacmpi.engine import check_options
from pacmpi.hashing import uniform, uniform_from
from pacmpi.segments import SegmentTable
from pacmpi.ternary import TernaryCodec

ROUTES = ["numpy", "numba"]  # the reference, and the compiled kernels the segments call
KEY = 0x9E3779B97F4A7C15


@pytest.fixture(params=ROUTES)
def route(request):
    kernels.set_backend(request.param if request.param == "numpy" else "numba")
    yield request.param
    kernels.set_backend(None)


def _case(seed=0, sizes=(300, 7, 0, 1000, 5), density=0.6):
    rng = np.random.default_rng(seed)
    size = sum(sizes)
    # Magnitudes that differ by orders between tensors, as a model's do.
    flat = np.concatenate([rng.standard_normal(n) * 10.0 ** (3 - 2 * i)
                           for i, n in enumerate(sizes)]).astype(np.float32)
    indices = np.flatnonzero(rng.random(size) < density).astype(np.int32)
    return flat, indices


def _encode(table, flat, residual, scales, codec, indices_given):
    words = np.empty(table.words, codec.word_dtype)
    out = None if residual is None else np.empty_like(residual)
    table.encode(np, flat, residual, out, scales, KEY, codec, words)
    return words, out


def test_uniform_from_moves_the_stream():
    for key in (0, KEY, 0xFFFFFFF0, 2 ** 64 - 1):  # the low word wraps, the high one stays
        for start in (0, 1, 17, 1000):
            np.testing.assert_array_equal(uniform(np, start + 64, key)[start:],
                                          uniform(np, 64, uniform_from(key, start)))
    assert not np.array_equal(uniform(np, 64, KEY), uniform(np, 64, uniform_from(KEY, 1)))


def test_table_places_each_tensor_after_the_survivors_before_it():
    sizes = (300, 7, 0, 1000, 5)
    flat, indices = _case(sizes=sizes)
    table = SegmentTable(sizes, indices, digits=27)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    assert list(table.starts) == [int((indices < o).sum()) for o in offsets]
    assert list(table.filled) == [s for s in range(5) if table.starts[s + 1] > table.starts[s]]
    assert table.words == sum(-(-int(n) // 27) for n in np.diff(table.starts))
    for s in table.filled:  # each segment's survivors lie in its own tensor
        mine = indices[table.starts[s]:table.starts[s + 1]]
        assert offsets[s] <= mine.min() and mine.max() < offsets[s + 1]
    assert table.indices is indices  # read through, never copied
    dense = SegmentTable(sizes, None, digits=27)
    assert list(dense.starts) == list(offsets)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_one_segment_is_the_bucket_encoding_bit_for_bit(route, packed, with_residual):
    flat, indices = _case(seed=1)
    indices = indices if packed else None
    count = flat.size if indices is None else indices.size
    codec = TernaryCodec(4, "uint64")
    residual = (np.random.default_rng(2).standard_normal(count).astype(np.float32) * 0.1
                if with_residual else None)
    scale = kernels.absmax(np, flat, indices, residual)
    table = SegmentTable((flat.size,), indices, codec.digits_per_word)
    assert table.absmax(np, flat, residual)[0] == scale
    words, out = _encode(table, flat, residual, [scale], codec, packed)
    expected = np.empty(codec.words_for(count), codec.word_dtype)
    expected_out = None if residual is None else np.empty_like(residual)
    kernels.ternary_encode(np, flat, indices, residual, expected_out, scale, KEY, codec,
                           expected)
    np.testing.assert_array_equal(words, expected)
    if residual is not None:
        np.testing.assert_array_equal(out, expected_out)
    summed = words * np.uint64(3)  # as if 3 ranks sent these words
    got = table.decode(np, summed, codec, 3, [scale], 4, np.full_like(flat, np.nan))
    want = kernels.ternary_decode(np, summed, count, codec, 3, scale, 4, indices,
                                  np.full_like(flat, np.nan))
    np.testing.assert_array_equal(got, want)


def test_equal_scales_give_the_one_scale_values_and_own_scales_keep_small_tensors(route):
    """Segments draw the bucket's random numbers: with every scale equal to the bucket's the
    decoded values are the bucket encoding's (the words differ: segments start on word
    boundaries). With their own scales the small tensors are no longer all zero."""
    sizes = (300, 7, 0, 1000, 5)
    flat, indices = _case(seed=3, sizes=sizes)
    codec = TernaryCodec(2, "int64")
    one = SegmentTable((flat.size,), indices, codec.digits_per_word)
    many = SegmentTable(sizes, indices, codec.digits_per_word)
    bucket_scale = one.absmax(np, flat, None)[0]
    own = many.absmax(np, flat, None)
    assert own.max() == bucket_scale and own[2] == 0.0 and (own[many.filled] > 0).all()

    def decoded(table, scales):
        words, _ = _encode(table, flat, None, scales, codec, True)
        return table.decode(np, words, codec, 1, scales, None, np.empty_like(flat)), words

    values_one, words_one = decoded(one, [bucket_scale])
    values_many, words_many = decoded(many, np.where(own > 0, bucket_scale, 0.0))
    np.testing.assert_array_equal(values_many, values_one)
    assert words_many.size > words_one.size  # padded: not the same words
    values_own, _ = decoded(many, own)
    small = slice(300, 307)  # the 7-element tensor, 1e4 times smaller than the first
    kept = np.isin(np.arange(300, 307), indices)
    assert not values_one[small][kept].any()  # negative control: one scale zeroes it
    assert values_own[small][kept].any()
    assert not values_own[300 + 7 + 1000:][~np.isin(np.arange(1307, 1312), indices)].any()


def test_compiled_route_matches_the_reference_on_several_segments():
    sizes = (300, 7, 0, 1000, 5)
    flat, indices = _case(seed=4, sizes=sizes)
    codec = TernaryCodec(4, "uint64")
    residual = np.random.default_rng(5).standard_normal(indices.size).astype(np.float32)
    results = []
    for route in ROUTES:
        kernels.set_backend(route if route == "numpy" else "numba")
        try:
            table = SegmentTable(sizes, indices, codec.digits_per_word)
            scales = table.absmax(np, flat, residual)
            words, out = _encode(table, flat, residual, scales, codec, True)
            results.append((scales, words, out,
                             table.decode(np, words * np.uint64(4), codec, 4, scales, 4,
                                          np.empty_like(flat))))
        finally:
            kernels.set_backend(None)
    for reference, compiled in zip(*results):
        np.testing.assert_array_equal(compiled, reference)


@pytest.mark.parametrize("good", ["tensor", "bucket", 1, 4096, np.int64(64)])
def test_scale_granularities(good):
    check_options(ternary_scale=good)


@pytest.mark.parametrize("bad", ["layer", "4096", 0, -3, True, 2.5, None])
def test_bad_scale_granularity_is_named(bad):
    with pytest.raises(ValueError, match=r"ternary_scale must be one of \('tensor', 'bucket'\) "
                                         r"or a positive int \(elements per scale\), got "
                                         + re.escape(repr(bad))):
        check_options(ternary_scale=bad)


def _all_routes(sizes, flat, indices, residual, codec, ranks, divisor, key=KEY):
    """(scales, words, residual out, decoded) of a table on the reference and on Numba; for
    packed values also of a table made from their bitmap on each route: scales read through
    the bits, the payload quantized from the compacted front of a copy of flat, decoded there
    and expanded (as the engine's in-place route does)."""
    results = []
    for route in ROUTES:
        kernels.set_backend(route)
        try:
            tables = [(SegmentTable(sizes, indices, codec.digits_per_word), False)]
            if indices is not None:
                mask = np.zeros(flat.size, bool)
                mask[indices] = True
                tables.append((SegmentTable(sizes, Bitmap(mask), codec.digits_per_word,
                                            positions=_never), True))
            for table, compact in tables:
                scales = table.absmax(np, flat, residual)
                # Non-finite values are never quantized (the engine sends them as they are).
                finite = np.where(np.isfinite(scales), scales, 1.0)
                values = np.where(np.isfinite(flat), flat, 0).astype(flat.dtype)
                words = np.empty(table.words, codec.word_dtype)
                out = None if residual is None else np.full_like(residual, np.nan)
                target = np.full_like(flat, np.nan)
                if compact:
                    values = kernels.compact(np, values.copy(), table.bits, indices.size)
                    target[:] = flat  # the decode writes the front, the expansion the rest
                table.encode(np, values, residual, out, finite, key, codec, words, compact)
                decoded = table.decode(np, words * codec.word_dtype.type(ranks), codec, ranks,
                                       finite, divisor, target, compact)
                if compact:
                    decoded = kernels.expand(np, decoded, table.bits, indices.size)
                results.append((scales, words, out, decoded))
        finally:
            kernels.set_backend(None)
    return results


def _never():
    raise AssertionError("a bitmap's table asked for positions")


def _same_bits(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    if a.dtype.kind in "fV":
        a, b = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")
    np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
       dtype=st.sampled_from([d.name for d in supported_float_dtypes()]),
       density=st.sampled_from([None, 0.0, 0.4, 1.0]), with_residual=st.booleans(),
       nonfinite=st.booleans(), word=st.sampled_from(["int32", "int64", "uint64"]),
       seed=st.integers(0, 2**31))
def test_small_segments_in_one_call_match_the_reference(sizes, dtype, density, with_residual,
                                                       nonfinite, word, seed):
    """Numba's one serial call over many small segments (0 and 1 survivors, dense or packed,
    NaN and Inf, float16 to float64, every word type) gives the reference's scales, words,
    residuals and decoded values bit for bit; so does a packed table made from the bitmap
    (scales read through the bits, a compacted payload), on both routes."""
    rng = np.random.default_rng(seed)
    flat = (rng.standard_normal(sum(sizes)) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
    if nonfinite and flat.size:
        flat[rng.integers(0, flat.size, size=2)] = [np.nan, np.inf]
    indices = None if density is None else \
        np.flatnonzero(rng.random(flat.size) < density).astype(np.int32)
    count = flat.size if indices is None else indices.size
    residual = (rng.standard_normal(count).astype(kernels.compute_dtype(flat.dtype))
                if with_residual else None)
    reference, *others = _all_routes(sizes, flat, indices, residual, TernaryCodec(3, word),
                                     3, 3 if seed % 2 else None, key=seed * 0x9E3779B1)
    assert len(others) == (1 if indices is None else 3)
    for other in others:
        for a, b in zip(reference, other):
            _same_bits(a, b)


def test_small_and_large_segments_together_match_the_reference():
    """Segments over Numba's serial limit are done one by one beside the small ones' call."""
    from pacmpi.kernels import cpu

    sizes = (7, cpu.SERIAL_BELOW + 5, 0, 300, 1)
    flat, indices = _case(seed=6, sizes=sizes, density=0.9)
    residual = np.random.default_rng(7).standard_normal(indices.size).astype(np.float32)
    reference, *others = _all_routes(sizes, flat, indices, residual,
                                     TernaryCodec(4, "uint64"), 4, 4)
    for other in others:
        for a, b in zip(reference, other):
            _same_bits(a, b)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 200), min_size=1, max_size=10),
       density=st.sampled_from([None, 0.0, 0.05, 0.5, 1.0]), digits=st.sampled_from([1, 3, 20]),
       parts=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_windows_of_words_decode_blocks_of_the_payload(sizes, density, digits, parts, seed):
    """Words cut anywhere (a reduce-scatter's blocks, empty ones included): ``payload_at``
    cuts the payload where each block's digits start, and each block's :meth:`window`
    decodes its block of the payload exactly as the whole table decodes it there."""
    rng = np.random.default_rng(seed)
    flat = rng.standard_normal(sum(sizes)).astype(np.float32)
    indices = None if density is None else np.flatnonzero(rng.random(flat.size) < density)
    codec = TernaryCodec(3, "int64")
    codec.digits_per_word = digits  # the cuts' arithmetic at any digits per word
    table = SegmentTable(sizes, indices, digits)
    scales = np.abs(rng.standard_normal(len(sizes))) + 0.5
    words = rng.integers(0, 2 * 3 + 1, size=table.words * digits).reshape(-1, digits)
    words = (words * 7 ** np.arange(digits)).sum(axis=1).astype(np.int64)
    count = int(table.starts[-1])
    whole = table.decode(np, words, codec, 3, scales, 3, np.empty(count, np.float32),
                         compact=True)
    cuts = np.sort(np.concatenate([[0, table.words],
                                   rng.integers(0, table.words + 1, parts - 1)]))
    bounds = table.payload_at(cuts)
    assert bounds[0] == 0 and bounds[-1] == count and np.all(np.diff(bounds) >= 0)
    for backend in ROUTES:
        kernels.set_backend(backend)
        try:
            for first, stop, lo, hi in zip(cuts[:-1], cuts[1:], bounds[:-1], bounds[1:]):
                part = table.window(first, stop)
                assert part.words == stop - first and int(part.starts[-1]) == hi - lo
                block = part.decode(np, words[first:stop], codec, 3, scales, 3,
                                    np.full(hi - lo, np.nan, np.float32), compact=True)
                _same_bits(block, whole[lo:hi])
        finally:
            kernels.set_backend(None)
