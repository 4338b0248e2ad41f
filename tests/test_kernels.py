"""pacmpi.kernels: the fused routes (Numba on NumPy arrays, CUDA on CuPy arrays) against the
NumPy reference, bit for bit, for every gradient dtype, word dtype and rank count.

The reference always runs on host copies, so a CuPy run is checked against NumPy's bits too.
Every route test also runs on "cuda-host": gpu.py's own wrappers, with CuPy replaced by
tests/host_cupy.py, launching gpu.SOURCE compiled for the host by tests/host_cuda.py (the real
grid, warps whose lanes exchange values), so the CUDA kernels' logic runs without a GPU.
"""
import functools
import itertools
import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pacmpi import kernels
from pacmpi.hashing import uniform
from pacmpi.kernels import gpu, reference
from pacmpi.ternary import TernaryCodec, stochastic_ternary, wire_bits_table

import host_cuda
import host_cupy
from xp_util import ARRAY_MODULES, asnumpy

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
WORDS = ["int64", "int32", "uint64"]
RANKS = [1, 2, 3, 4, 7, 16, 64]
KEY = 0x9E3779B97F4A7C15
BIG = 70001  # several parallel chunks, above the serial cut-off, an odd tail
# Scales whose products s * scale are float16 rounding cases: a tie between two normal values
# (to even), and just above a tie between two subnormals (up, though the kept bits look tied).
SCALES = (4.0, 1 + 2 ** -11, 2.5 * 2 ** -24 + 2 ** -40)


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv("PACMPI_KERNELS", raising=False)
    yield
    kernels.set_backend(None)


CUDA_HOST = pytest.param("cuda-host", id="cuda-host", marks=pytest.mark.skipif(
    host_cuda.compiler() is None, reason="needs a C++ compiler for the host CUDA route"))
# numpy: the Numba kernels; cuda-host: gpu.py on host_cupy; cupy: gpu.py on a GPU
ON_EVERY_ROUTE = pytest.mark.parametrize("xp", [ARRAY_MODULES[0], CUDA_HOST, ARRAY_MODULES[1]],
                                         indirect=True)


@pytest.fixture
def xp(request, monkeypatch):
    """The array module of the route; for cuda-host, gpu.py's CuPy is host_cupy, and gpu.py's
    caches are fresh ones, so nothing compiled for one CuPy reaches the other."""
    if request.param != "cuda-host":
        return request.param
    monkeypatch.setattr(gpu, "_cupy", lambda: host_cupy)
    for cached in ("_module", "_device_table"):
        monkeypatch.setattr(gpu, cached, functools.lru_cache()(getattr(gpu, cached).__wrapped__))
    return host_cupy


def _xp_dtypes(xp):
    """Every dtype the array module can hold: bfloat16 needs CuPy >= 14 (ml_dtypes arrays)."""
    try:
        xp.zeros(1, BF16)
    except (TypeError, ValueError):
        return [d for d in DTYPES if d != BF16]
    return DTYPES


def _fused_route(xp):
    if xp is np:
        pytest.importorskip("numba")
    route = kernels.backend(xp)
    assert route == ("numba" if xp is np else "cupy")
    return route


def _bits(array):
    array = np.ascontiguousarray(asnumpy(array))
    return array.view(f"u{array.dtype.itemsize}") if array.dtype.kind == "f" or \
        array.dtype == BF16 else array


def assert_same(got, want):
    """Same dtype, shape and bits (NaN payloads included); floats compare as values.

    On a GPU, single-precision arithmetic with a NaN operand returns the canonical NaN
    0x7fffffff (CUDA C++ Programming Guide, "Floating-Point Standard"), where NumPy on x86
    carries the operand's payload and sign: there NaNs must sit where the reference has them,
    and every other value must match bit for bit."""
    if isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or got == want, (got, want)
        return
    on_gpu = type(got).__module__.startswith("cupy")
    got = asnumpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if on_gpu and (want.dtype.kind == "f" or want.dtype == BF16):
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        got, want = got[~nan], want[~nan]
    np.testing.assert_array_equal(_bits(got), _bits(want))


def run_both(xp, name, *args):
    """Kernel ``name`` on the reference (NumPy, host copies) and on the fused route (``xp``).

    Returns ``[(want, got)]``: the return value, then every array argument after the call.
    Aliased arguments stay aliased in both copies (in-place residuals).
    """
    _fused_route(xp)
    host, device = {}, {}
    host_args = [host.setdefault(id(a), a.copy()) if isinstance(a, np.ndarray) else a
                 for a in args]
    device_args = [device.setdefault(id(a), xp.asarray(a.copy())) if isinstance(a, np.ndarray)
                   else a for a in args]
    want = getattr(reference, name)(np, *host_args)
    got = getattr(kernels, name)(xp, *device_args)
    pairs = [(got, want)]
    pairs += [(d, h) for d, h in zip(device_args, host_args) if isinstance(h, np.ndarray)]
    return pairs


def check_both(xp, name, *args):
    for got, want in run_both(xp, name, *args):
        assert_same(got, want)


def _gradient(rng, size, dtype, spread=3.0):
    return (rng.standard_normal(size) * spread).astype(dtype)


# The engine keeps int32 positions (buckets under 2**31 elements); callers may pass int64.
INDEX_DTYPES = [np.int32, np.int64]


def _survivors(rng, size, density, index=np.int32):
    return np.flatnonzero(rng.random(size) < density).astype(index)


def _case(rng, dtype, size, packed, residual):
    """flat, indices, residual_in and residual_out ('none', 'given' or 'inplace')."""
    flat = _gradient(rng, size, dtype)
    indices = _survivors(rng, size, 0.4) if packed else None
    count = size if indices is None else indices.size
    compute = reference.compute_dtype(dtype)
    if residual == "none":
        return flat, indices, None, None
    residual_in = (rng.standard_normal(count) * 0.5).astype(compute)
    residual_out = residual_in if residual == "inplace" else np.empty(count, compute)
    return flat, indices, residual_in, residual_out


# ---------------------------------------------------------------- gather, scatter, absmax
@ON_EVERY_ROUTE
def test_gather_and_scatter_match_the_reference(xp):
    rng = np.random.default_rng(0)
    for dtype in _xp_dtypes(xp):
        for size in (0, 1, 7, 5003, BIG):
            flat = _gradient(rng, size, dtype)
            for density, index in itertools.product((0.0, 0.3, 1.0), INDEX_DTYPES):
                indices = _survivors(rng, size, density, index)
                check_both(xp, "gather", flat, indices, np.empty(indices.size, dtype))
                payload = _gradient(rng, indices.size, dtype, spread=100.0)
                for divisor in (None, 3, 4):
                    check_both(xp, "scatter", payload, indices, flat, divisor)
            for divisor in (None, 7):  # dense, in place: payload is flat itself
                check_both(xp, "scatter", flat, None, flat, divisor)


def _special(rng, flat):
    """NaN, +Inf and -Inf at random places."""
    if flat.size:
        for value in (np.nan, np.inf, -np.inf):
            flat[rng.integers(flat.size)] = value
    return flat


def _masks(rng, size):
    """Masks that reach every branch of the bitmap-driven kernels: random densities (bytes with
    some bits set), none and all (bytes of 0 and of 0xFF), one survivor, whole bytes kept
    between whole bytes pruned, and the padding byte of an odd length."""
    masks = [rng.random(size) < density for density in (0.0, 0.3, 0.9, 1.0)]
    if size:
        one = np.zeros(size, bool)
        one[rng.integers(size)] = True
        masks += [one, (np.arange(size) // 8) % 3 == 1, np.arange(size) >= size - 1]
    return masks


def test_in_place_compact_and_expand_match_the_reference():
    rng = np.random.default_rng(7)
    for dtype in DTYPES:
        for size in (0, 1, 2, 7, 8, 16, 5003, BIG):
            flat = _special(rng, _gradient(rng, size, dtype))
            for mask in _masks(rng, size):
                bits = np.packbits(mask)
                check_both(np, "compact", flat, bits, int(mask.sum()))
                payload = _special(rng, _gradient(rng, size, dtype, spread=100.0))
                for divisor in (None, 3, 4):
                    check_both(np, "expand", payload, bits, int(mask.sum()), divisor)


def test_absmax_bits_matches_the_reference():
    """The bitmap-driven scales (64 coordinates at a time, edges one by one) on segments that
    start and end at every offset within a block, over the masks of every branch, NaN and Inf
    among survivors and pruned values, with and without a residual: the reference's maxima,
    and the survivors' own (a pruned NaN is never read)."""
    rng = np.random.default_rng(13)
    for dtype in DTYPES:
        compute = kernels.compute_dtype(dtype)
        for size in (1, 7, 64, 200, 5003):
            flat = _special(rng, _gradient(rng, size, dtype))
            cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size + 1, 6)]))
            for mask in _masks(rng, size):
                bits = np.packbits(mask)
                starts = np.array([int(mask[:c].sum()) for c in cuts])
                which = np.flatnonzero(np.diff(starts))
                for residual in (None, rng.standard_normal(starts[-1]).astype(compute)):
                    check_both(np, "absmax_bits", flat, bits, residual, cuts, starts, which,
                               np.full(cuts.size - 1, -1.0))
                    got = kernels.absmax_bits(np, flat, bits, residual, cuts, starts, which,
                                              np.zeros(cuts.size - 1))
                    for s in which:
                        kept = np.flatnonzero(mask[cuts[s]:cuts[s + 1]]) + cuts[s]
                        part = None if residual is None else residual[starts[s]:starts[s + 1]]
                        assert_same(np.float64(got[s]),
                                    np.float64(reference.absmax(np, flat, kept, part)))


@ON_EVERY_ROUTE
def test_ternary_encode_kept_matches_the_reference(xp):
    """A dense payload whose residual is kept for the survivors only (the few steps a mask is
    checked dense): the compiled kernels equal the reference bit for bit (words and residuals,
    in place or not) over every dtype, odd lengths, masks of every branch (0 and 1 survivors),
    NaN and Inf, segments starting anywhere; and the reference equals :func:`ternary_encode`
    with a full-length residual that is 0 where the mask prunes (what it replaces)."""
    rng = np.random.default_rng(17)
    codec = TernaryCodec(3)
    for dtype in _xp_dtypes(xp):
        compute = kernels.compute_dtype(dtype)
        for size in (1, 7, 64, 200, 5003):
            flat = _special(rng, _gradient(rng, size, dtype))
            cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size + 1, 5)]))
            lengths = np.diff(cuts)
            word_starts = np.concatenate([[0], np.cumsum([codec.words_for(n) for n in lengths])])
            which = np.flatnonzero(lengths)
            scales = np.abs(rng.standard_normal(lengths.size)) * 3 + 0.1
            keys = rng.integers(0, 2**63, lengths.size).astype(np.uint64)
            for mask in _masks(rng, size):
                bits = np.packbits(mask)
                starts = np.array([int(mask[:c].sum()) for c in cuts])
                residual = (rng.standard_normal(starts[-1]) * 0.5).astype(compute)
                words = np.zeros(word_starts[-1], codec.word_dtype)
                host = [a.tolist() for a in (cuts, starts, word_starts, which, scales, keys)]
                for residual_out in (residual, np.zeros_like(residual), None):
                    check_both(xp, "ternary_encode_kept", flat, bits, residual, residual_out,
                               *host, codec, words)
                got = reference.ternary_encode_kept(np, flat, bits, residual, None, cuts, starts,
                                                    word_starts, which, scales, keys, codec,
                                                    words.copy())
                for s in which:
                    lo, hi = cuts[s], cuts[s + 1]
                    full = np.zeros(hi - lo, compute)
                    full[mask[lo:hi]] = residual[starts[s]:starts[s + 1]]
                    want = reference.ternary_encode(
                        np, flat[lo:hi], None, full, None, float(scales[s]), int(keys[s]),
                        codec, np.empty(word_starts[s + 1] - word_starts[s], codec.word_dtype))
                    np.testing.assert_array_equal(got[word_starts[s]:word_starts[s + 1]], want)


@ON_EVERY_ROUTE
def test_absmax_bits_on_every_route(xp):
    """The scales through the bits on each route against the reference on the host: segments
    starting anywhere (empty ones too), every dtype, NaN and Inf, with and without a residual;
    every segment at once on the GPU."""
    rng = np.random.default_rng(19)
    for dtype in _xp_dtypes(xp):
        compute = kernels.compute_dtype(dtype)
        for size in (1, 7, 64, 200, 5003, BIG):
            flat = _special(rng, _gradient(rng, size, dtype))
            cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size + 1, 6)]))
            cuts = np.sort(np.concatenate([cuts, cuts[1:2]]))  # an empty segment
            for mask in _masks(rng, size):
                starts = np.array([int(mask[:c].sum()) for c in cuts])
                which = np.flatnonzero(np.diff(starts))
                for residual in (None, rng.standard_normal(starts[-1]).astype(compute)):
                    want = reference.absmax_bits(np, flat, np.packbits(mask), residual, cuts,
                                                 starts, which, np.full(cuts.size - 1, -1.0))
                    got = kernels.absmax_bits(
                        xp, xp.asarray(flat), xp.asarray(np.packbits(mask)),
                        None if residual is None else xp.asarray(residual), cuts, starts,
                        which, np.full(cuts.size - 1, -1.0))
                    assert_same(got, want)


@ON_EVERY_ROUTE
def test_compact_and_expand_are_the_masked_gather_and_scatter(xp):
    """The bitmap-driven pair against what it replaces, positions taken from the mask:
    compaction's prefix is the gather of the survivors, expansion the scatter of the payload,
    both bit for bit (NaN/Inf included), on every route."""
    rng = np.random.default_rng(11)
    for dtype in _xp_dtypes(xp):
        for size in (1, 9, 5003, BIG):
            for mask in _masks(rng, size):
                flat, bits = _special(rng, _gradient(rng, size, dtype)), np.packbits(mask)
                kept = np.flatnonzero(mask)
                gathered = flat[kept]
                got = kernels.compact(xp, xp.asarray(flat.copy()), xp.asarray(bits), kept.size)
                assert_same(got, gathered)
                payload = np.concatenate([gathered * 3, flat[kept.size:]])
                want = reference.scatter(np, gathered * 3, kept, np.empty_like(flat), 3)
                got = kernels.expand(xp, xp.asarray(payload), xp.asarray(bits), kept.size, 3)
                assert_same(got, want)


def test_bad_bits_are_refused_before_a_kernel_runs():
    flat = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="mask of 10 coordinates, got 1 uint8"):
        kernels.compact(np, flat, np.zeros(1, np.uint8), 0)
    for name in ("compact", "expand"):  # a count not the bits': refused before anything moves
        for bits, count in [(np.array([1, 0], np.uint8), 2), (np.array([255, 0], np.uint8), 7),
                            (np.array([255, 0b11000000], np.uint8), 3)]:
            before = flat.copy()
            with pytest.raises(ValueError, match=f"the bits hold .* survivors, not {count}"):
                getattr(kernels, name)(np, flat, bits, count)
            np.testing.assert_array_equal(flat, before)
    for bits, count, match in [(np.zeros(1, np.uint8), 0, "got 1 uint8"),
                               (np.zeros(2, np.int8), 0, "got 2 int8"),
                               (np.array([0, 0b00100000], np.uint8), 0, "got 2 uint8"),
                               (np.zeros(2, np.uint8), 11, "11 survivors")]:
        with pytest.raises(ValueError, match=match):
            kernels.expand(np, flat, bits, count)
    kernels.expand(np, flat, np.array([0, 0b01000000], np.uint8), 1)  # the last coordinate


def test_expanding_in_the_wrong_order_is_caught():
    """Negative control: survivors moved back first first overwrite a payload value before it
    is read; the cases above (adjacent survivors) see it."""
    flat, indices = np.array([1.0, 2.0, 3.0], np.float32), np.array([1, 2], np.int32)
    bits = np.packbits(np.array([False, True, True]))
    wrong = flat.copy()
    for j in range(indices.size):
        wrong[indices[j]] = wrong[j]
    want = reference.expand(np, flat.copy(), bits, 2)
    assert not np.array_equal(wrong, want)
    np.testing.assert_array_equal(kernels.expand(np, flat.copy(), bits, 2), want)
    np.testing.assert_array_equal(want, [0.0, 1.0, 2.0])


@ON_EVERY_ROUTE
def test_fp16_wire_casts_match_the_reference(xp):
    """The fp16 payload path: a dense or packed gather into float16 and the scatter back,
    converted to the gradient's dtype before the division."""
    rng = np.random.default_rng(11)
    for dtype in (np.float32, np.float64):
        for size in (0, 1, 7, BIG):
            flat = _gradient(rng, size, dtype, spread=3e4)  # some overflow float16
            flat[rng.integers(max(size, 1), size=min(size, 3))] = np.nan
            for indices in (None, _survivors(rng, size, 0.3)):
                count = size if indices is None else indices.size
                with np.errstate(all="ignore"):
                    check_both(xp, "gather", flat, indices, np.empty(count, np.float16))
                    payload = _gradient(rng, count, np.float16, spread=100.0)
                    for divisor in (None, 3):
                        check_both(xp, "scatter", payload, indices, np.empty_like(flat),
                                   divisor)


@ON_EVERY_ROUTE
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_every_16_bit_pattern_divides_and_converts_as_numpy(xp, dtype):
    """All 65536 float16/bfloat16 values (NaN payloads, subnormals, Inf) through a divided
    scatter (16 -> 32 -> 16-bit conversion and rounding) and a float32 widening gather."""
    dtype = np.dtype(dtype) if dtype != "bfloat16" else BF16
    if dtype not in _xp_dtypes(xp):
        pytest.skip("this CuPy has no bfloat16 (CuPy >= 14 has)")
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    indices = np.arange(every.size, dtype=np.int64)
    with np.errstate(all="ignore"):
        for divisor in (2, 3, 7, 2049):  # 2: subnormals lose a bit, a tie half of the time
            check_both(xp, "scatter", every, None, np.empty_like(every), divisor)
        check_both(xp, "gather", every, indices, np.empty(every.size, np.float32))


@pytest.mark.parametrize("target", [np.float16, "bfloat16"])
def test_float32_rounds_to_16_bits_as_numpy(target):
    """float32 -> float16/bfloat16 for random bit patterns and every tie and boundary."""
    target = np.dtype(target) if target != "bfloat16" else BF16
    # float16 and bfloat16 drop 13 and 16 significand bits
    values = np.concatenate([_float32_rounding_cases(13), _float32_rounding_cases(16)])
    indices = np.arange(values.size, dtype=np.int64)
    with np.errstate(all="ignore"):
        check_both(np, "gather", values, indices, np.empty(values.size, target))


def _float32_rounding_cases(shift):
    """Random float32 bit patterns plus every tie (and its neighbours) when ``shift`` bits go."""
    rng = np.random.default_rng(1)
    halves = np.arange(1 << 16, dtype=np.uint32)
    ties = (halves << shift) | (1 << (shift - 1))
    patterns = [rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32),
                ties, ties - 1, ties + 1, halves << 16]
    return np.concatenate(patterns).view(np.float32)


def test_both_float16_conversion_routes_are_numpy_exact():
    """The route the kernels take (F16C in hardware where the CPU has it, NaNs fixed up) and
    the bit manipulation that CPUs without it take: both equal NumPy bit for bit, signalling
    NaN payloads included."""
    numba = pytest.importorskip("numba")
    from pacmpi.kernels import cpu

    def elementwise(function, out_dtype):
        @numba.njit
        def apply(x):
            out = np.empty(x.size, out_dtype)
            for i in range(x.size):
                out[i] = function(x[i])
            return out
        return apply

    every = np.arange(1 << 16, dtype=np.uint16)  # random patterns below hold both NaN kinds
    values = _float32_rounding_cases(13)
    with np.errstate(all="ignore"):
        want_wide = every.view(np.float16).astype(np.float32).view(np.uint32)
        want_narrow = values.astype(np.float16).view(np.uint16)
    routes = {"kernels": (cpu._half_to_float, cpu._float_to_half),
              "soft": (cpu._half_to_float_soft, cpu._float_to_half_soft)}
    for name, (widen, narrow) in routes.items():
        got_wide = elementwise(widen, np.float32)(every).view(np.uint32)
        np.testing.assert_array_equal(got_wide, want_wide, err_msg=name)
        np.testing.assert_array_equal(elementwise(narrow, np.uint16)(values), want_narrow,
                                      err_msg=name)


@ON_EVERY_ROUTE
def test_absmax_matches_the_reference_and_flags_non_finite(xp):
    rng = np.random.default_rng(2)
    for dtype in _xp_dtypes(xp):
        for size in (0, 1, 7, BIG):
            for packed in (False, True):
                for residual in ("none", "given"):
                    flat, indices, res, _ = _case(rng, dtype, size, packed, residual)
                    check_both(xp, "absmax", flat, indices, res)
        flat = _gradient(rng, 1000, dtype)
        for bad in (np.nan, np.inf, -np.inf):
            flat[rng.integers(1000)] = bad
            value = kernels.absmax(xp, xp.asarray(flat), None, None)
            assert not math.isfinite(value)
            assert_same(value, reference.absmax(np, flat, None, None))


def test_absmax_of_nothing_is_zero():
    assert kernels.absmax(np, np.empty(0, np.float32), None, None) == 0.0
    assert kernels.absmax(np, np.ones(5, np.float32), np.empty(0, np.int64), None) == 0.0


# ---------------------------------------------------------------- ternary encode and decode
def _encode_decode_both(xp, rng, dtype, word, ranks, size, packed, residual, scale):
    codec = TernaryCodec(ranks, word)
    flat, indices, res_in, res_out = _case(rng, dtype, size, packed, residual)
    count = size if indices is None else indices.size
    pairs = run_both(xp, "ternary_encode", flat, indices, res_in, res_out, scale, KEY, codec,
                     np.empty(codec.words_for(count), codec.word_dtype))
    for got, want in pairs:
        assert_same(got, want)
    words = pairs[0][1] * codec.word_dtype.type(ranks)  # as if every rank sent the same codes
    for divisor in (None, ranks):
        check_both(xp, "ternary_decode", words, count, codec, ranks, scale, divisor, indices,
                   np.full(size, 9, dtype))


@ON_EVERY_ROUTE
@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ternary_encode_and_decode_match_the_reference(xp, word, dtype):
    if dtype not in _xp_dtypes(xp):
        pytest.skip("this CuPy has no bfloat16 (CuPy >= 14 has)")
    rng = np.random.default_rng(3)
    for ranks in RANKS:
        for size in (0, 1, 7, 1001):
            for packed in (False, True):
                for residual in ("none", "given", "inplace"):
                    for scale in SCALES:
                        _encode_decode_both(xp, rng, dtype, word, ranks, size, packed,
                                            residual, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        for scale in (0.0, -1.0, 1e-50, float("nan")):  # no quantization; 0 in float32
            _encode_decode_both(xp, rng, dtype, word, 4, 257, True, "given", scale)
    for packed in (False, True):
        _encode_decode_both(xp, rng, dtype, word, 7, BIG, packed, "inplace", 4.0)


@ON_EVERY_ROUTE
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # xp keeps no state
@given(size=st.integers(0, 3000), density=st.floats(0.0, 1.0), ranks=st.sampled_from(RANKS),
       word=st.sampled_from(WORDS), dtype=st.sampled_from(DTYPES),
       key=st.integers(0, 2 ** 64 - 1), scale=st.floats(0.5, 8.0),
       index=st.sampled_from(INDEX_DTYPES))
def test_fused_codec_matches_the_reference_on_random_cases(xp, size, density, ranks, word,
                                                           dtype, key, scale, index):
    assume(dtype in _xp_dtypes(xp))
    rng = np.random.default_rng(size)
    codec = TernaryCodec(ranks, word)
    flat = _gradient(rng, size, dtype)
    indices = _survivors(rng, size, density, index) if density < 1 else None
    count = size if indices is None else indices.size
    residual = (rng.standard_normal(count) * 0.5).astype(reference.compute_dtype(dtype))
    pairs = run_both(xp, "ternary_encode", flat, indices, residual, residual, scale, key, codec,
                     np.empty(codec.words_for(count), codec.word_dtype))
    for got, want in pairs:
        assert_same(got, want)
    check_both(xp, "ternary_decode", pairs[0][1], count, codec, 1, scale, None, indices,
               np.empty(size, dtype))


@ON_EVERY_ROUTE
@pytest.mark.parametrize("word", WORDS)
def test_summed_words_of_several_ranks_decode_to_the_code_sums(xp, word):
    _fused_route(xp)
    rng = np.random.default_rng(4)
    for ranks in (1, 3, 16):
        codec = TernaryCodec(ranks, word)
        size, scale = 3 * codec.digits_per_word + 5, 2.0  # a partial last word
        indices = _survivors(rng, size, 0.7)
        total = np.zeros(codec.words_for(indices.size), codec.word_dtype)
        code_sum = np.zeros(indices.size, np.int64)
        for rank in range(ranks):
            flat = _gradient(rng, size, np.float32)
            words = kernels.ternary_encode(xp, xp.asarray(flat), xp.asarray(indices), None, None,
                                           scale, KEY + rank, codec,
                                           xp.empty(codec.words_for(indices.size),
                                                    codec.word_dtype))
            total += asnumpy(words)  # word-wise integer SUM, as the all-reduce does
            code_sum += stochastic_ternary(np, flat[indices], scale, KEY + rank)
        np.testing.assert_array_equal(codec.decode(np, total, indices.size, ranks), code_sum)
        out = kernels.ternary_decode(xp, xp.asarray(total), indices.size, codec, ranks, scale,
                                     ranks, xp.asarray(indices), xp.empty(size, np.float32))
        expected = np.zeros(size, np.float32)
        expected[indices] = code_sum.astype(np.float32) * np.float32(scale) / np.float32(ranks)
        np.testing.assert_array_equal(asnumpy(out), expected)


def test_one_rank_decodes_its_own_codes():
    rng = np.random.default_rng(5)
    values = _gradient(rng, 999, np.float32)
    for word in WORDS:
        codec = TernaryCodec(1, word)
        words = kernels.ternary_encode(np, values, None, None, None, 4.0, KEY, codec,
                                       np.empty(codec.words_for(999), codec.word_dtype))
        decoded = kernels.ternary_decode(np, words, 999, codec, 1, 1.0, None, None,
                                         np.empty(999, np.float32))
        np.testing.assert_array_equal(decoded, stochastic_ternary(np, values, 4.0, KEY))


def test_the_residual_is_the_quantization_error_and_uses_uniform():
    values = np.linspace(-1, 1, 101, dtype=np.float32)
    codec = TernaryCodec(2, "uint64")
    residual = np.zeros_like(values)
    words = kernels.ternary_encode(np, values, None, residual, residual, 1.0, KEY, codec,
                                   np.empty(codec.words_for(101), np.uint64))
    codes = codec.decode(np, words, 101, ranks=1)
    np.testing.assert_array_equal(residual, values - codes.astype(np.float32))
    np.testing.assert_array_equal(np.abs(codes) == 1, uniform(np, 101, KEY) < np.abs(values))


def test_unfusable_arrays_take_the_reference_route():
    rng = np.random.default_rng(6)
    strided = _gradient(rng, 200, np.float32)[::2]
    codec = TernaryCodec(4, "int64")
    got = kernels.ternary_encode(np, strided, None, None, None, 3.0, KEY, codec,
                                 np.empty(codec.words_for(100), np.int64))
    want = reference.ternary_encode(np, strided.copy(), None, None, None, 3.0, KEY, codec,
                                    np.empty(codec.words_for(100), np.int64))
    np.testing.assert_array_equal(got, want)
    wide = _gradient(rng, 50, np.float64)  # float64 -> float16 is not fused: NumPy rounds it
    check_both(np, "gather", wide, np.arange(50), np.empty(50, np.float16))


def test_wrong_sizes_and_dtypes_are_refused_before_any_kernel_runs():
    codec = TernaryCodec(4)
    flat = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="residual_in must be 10 float32 values"):
        kernels.ternary_encode(np, flat, None, np.zeros(10, np.float64), None, 1.0, 0, codec,
                               np.empty(1, np.int64))
    with pytest.raises(ValueError, match="words_out must be 1 int64 words, got 2 int64"):
        kernels.ternary_encode(np, flat, None, None, None, 1.0, 0, codec, np.empty(2, np.int64))
    with pytest.raises(ValueError, match="words must be at least 1 int64 words"):
        kernels.ternary_decode(np, np.empty(1, np.int32), 10, codec, 4, 1.0, None, None, flat)
    with pytest.raises(ValueError, match="scatter: 3 values but 2 indices"):
        kernels.scatter(np, np.ones(3, np.float32), np.arange(2), flat)
    with pytest.raises(ValueError, match="ternary_decode: 11 values do not fit 10 elements"):
        kernels.ternary_decode(np, np.zeros(1, np.int64), 11, codec, 4, 1.0, None, None, flat)
    pytest.importorskip("numba")
    with pytest.raises(IndexError, match=r"sorted positions in \[0, 10\)"):
        kernels.gather(np, flat, np.array([3, 10]), np.empty(2, np.float32))


# ---------------------------------------------------------------- backend choice
def test_backend_follows_the_environment_and_set_backend(monkeypatch):
    monkeypatch.setenv("PACMPI_KERNELS", "numpy")
    assert kernels.backend(np) == "numpy"
    kernels.set_backend("auto")
    assert kernels.backend(np) in ("numba", "numpy")
    kernels.set_backend(None)
    assert kernels.backend(np) == "numpy"
    monkeypatch.setenv("PACMPI_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"PACMPI_KERNELS: kernel backend must be one of"):
        kernels.backend(np)
    with pytest.raises(ValueError, match="set_backend"):
        kernels.set_backend("cuda")


def test_without_numba_auto_falls_back_once_and_numba_is_an_error(monkeypatch):
    monkeypatch.setattr(kernels, "_cpu", lambda: None)
    monkeypatch.setattr(kernels, "_cpu_error", ImportError("No module named 'numba'"))
    monkeypatch.setattr(kernels, "_warned", False)
    with pytest.warns(RuntimeWarning, match="Numba is not available .*pip install numba"):
        assert kernels.backend(np) == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        assert kernels.absmax(np, np.array([-3.0, 2.0]), None, None) == 3.0
    kernels.set_backend("numba")
    with pytest.raises(ImportError, match="PACMPI_KERNELS=numba, but Numba cannot be imported"):
        kernels.backend(np)


def test_warm_up_compiles_every_signature_a_step_needs():
    pytest.importorskip("numba")
    from pacmpi.kernels import cpu
    assert kernels.warm_up() == "numba"
    words = 2  # uint32 and uint64 views
    expected = {"gather": 4, "scatter": 4, "compact": 4, "expand": 4, "absmax": 4,
                "ternary_encode": 4 * words, "ternary_decode": 4 * words,
                "absmax_segments": 4, "absmax_bits": 4, "ternary_encode_segments": 4 * words,
                "ternary_encode_kept": 4 * words,
                "ternary_decode_segments": 4 * words}
    for name, kernel in cpu._KERNELS.items():  # the parallel kernels and their serial twins
        for version in cpu._versions(kernel):
            assert len(version.signatures) >= expected[name], (name, version)


_STEPS_AFTER_WARM_UP = """
import itertools
import numpy as np
from mpi4py import MPI
from pacmpi import MPICollectives, kernels
from pacmpi.arrays import supported_float_dtypes
from pacmpi.engine import BucketSpec, StepEngine
from pacmpi.kernels import cpu
kernels.warm_up()

def compiled():
    return {(name, i): len(version.signatures) for name, kernel in cpu._KERNELS.items()
            for i, version in enumerate(cpu._versions(kernel))}

before = compiled()
rng = np.random.default_rng(3)
for dtype, quantize, density, in_place in itertools.product(
        supported_float_dtypes(), (None, "ternary"), (0.5, 0.2), (True, False)):
    engine = StepEngine(MPICollectives(comm=MPI.COMM_SELF), [BucketSpec("b", dtype, 5000)],
                        quantize=quantize, error_feedback=quantize == "ternary", stable_steps=1)
    mask = rng.random(5000) < density
    for _ in range(3):  # checked dense, then packed
        flat = rng.standard_normal(5000).astype(dtype)
        engine.begin_step(lambda: [mask])
        wire, ctx = engine.encode(0, flat, in_place=in_place)
        engine.decode(wire, ctx, flat)
        engine.end_step()
after = compiled()
print({key: (before[key], n) for key, n in after.items() if n != before[key]})
"""


def test_after_warm_up_the_engines_steps_compile_nothing():
    """A step on each of the engine's routes -- lossless compacted in place, ternary with error
    feedback through the bits (density 0.5) and through positions (0.2), dense while a mask is
    checked, in place (the hooks) and not (Horovod), every dtype -- finds every kernel
    signature it calls compiled by warm_up, in a fresh interpreter (in this one, other tests
    compile signatures too): a training step never waits for Numba. (warm_up once left out the
    in-place ternary segments' signatures, without positions; counting signatures missed it.)"""
    pytest.importorskip("numba")
    done = subprocess.run([sys.executable, "-c", _STEPS_AFTER_WARM_UP], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{}", done.stdout


def test_small_calls_take_the_serial_twins(monkeypatch):
    """Calls below SERIAL_BELOW values run the serial twin (no parallel region), larger ones
    the pool; the comparisons above cover both (sizes on either side, BIG among them)."""
    pytest.importorskip("numba")
    from pacmpi.kernels import cpu
    called, twin = [], cpu._SERIAL[cpu._absmax]
    monkeypatch.setitem(cpu._SERIAL, cpu._absmax,
                        lambda *args: called.append(args[0].size) or twin(*args))
    for count in (1, cpu.SERIAL_BELOW - 1, cpu.SERIAL_BELOW):
        flat = np.arange(count, dtype=np.float32)
        assert kernels.absmax(np, flat, None, None) == reference.absmax(np, flat, None, None)
    assert called == [1, cpu.SERIAL_BELOW - 1]  # the last one ran on the pool


def test_importing_the_kernels_loads_neither_numba_nor_cupy():
    code = ("import sys, pacmpi, pacmpi.kernels; "
            "sys.exit([m for m in ('numba', 'cupy') if m in sys.modules] != [])")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---------------------------------------------------------------- uint64 words
def test_uint64_words_hold_more_digits():
    assert TernaryCodec(4, "uint64").digits_per_word == 20
    assert TernaryCodec(4, "uint64").bits_per_value == pytest.approx(3.2)
    assert TernaryCodec(64, "uint64").digits_per_word == 9
    assert TernaryCodec(64, "uint64").bits_per_value == pytest.approx(64 / 9)
    assert TernaryCodec.max_world_size("uint64") == 2 ** 63 - 1
    assert TernaryCodec(2 ** 63 - 1, "uint64").digits_per_word == 1
    for n in (1, 2, 5, 1000, 2 ** 31):
        codec = TernaryCodec(n, "uint64")
        assert codec.base ** codec.digits_per_word - 1 <= 2 ** 64 - 1
        assert codec.base ** (codec.digits_per_word + 1) - 1 > 2 ** 64 - 1
        assert codec.digits_per_word >= TernaryCodec(n, "int64").digits_per_word


def test_wire_bits_table_has_a_row_per_word_dtype():
    rows = wire_bits_table(word_dtype=("int32", "int64", "uint64"))
    assert [(r["ranks"], r["word_dtype"]) for r in rows[:3]] == [
        (2, "int32"), (2, "int64"), (2, "uint64")]
    assert {r["ranks"] for r in rows} == {2, 4, 8, 16, 64, 256, 1024}
    for row in rows:
        assert row["log2_2n_plus_1"] <= row["bits_per_value"]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_uint64_lane_sums_never_carry_up_to_huge_rank_counts(data):
    """Encoding is linear: n ranks' summed words are counts times the words of constant codes."""
    ranks = data.draw(st.one_of(st.integers(1, 100), st.integers(1, 2 ** 40)))
    codec = TernaryCodec(ranks, "uint64")
    count = codec.digits_per_word
    plus = data.draw(st.lists(st.integers(0, ranks), min_size=count, max_size=count))
    minus = [data.draw(st.integers(0, ranks - p)) for p in plus]
    word = 0
    for j in range(count - 1, -1, -1):
        word = word * codec.base + 2 * plus[j] + (ranks - plus[j] - minus[j])
    words = np.array([word], dtype=np.uint64)
    expected = np.array(plus) - np.array(minus)
    np.testing.assert_array_equal(codec.decode(np, words, count), expected)
    decoded = kernels.ternary_decode(np, words, count, codec, ranks, 1.0, None, None,
                                     np.empty(count, np.float64))
    np.testing.assert_array_equal(decoded, expected.astype(np.float64))


# ---------------------------------------------------------------- the CUDA source, on the host
_NARROW = r"""
template<typename T> __global__ void narrow(const float* x, T* out, i64 n) {
    GRID_STRIDE(i, n) store(out + i, x[i]);
}
"""


@pytest.mark.parametrize("xp", [CUDA_HOST], indirect=True)
@pytest.mark.parametrize("target", [np.float16, "bfloat16"])
def test_cuda_stores_float32_in_16_bits_as_numpy(xp, target):
    """The kernels' store() (ternary_decode's last step) on every tie and boundary: gpu.SOURCE
    plus a kernel that only calls it."""
    target = np.dtype(target) if target != "bfloat16" else BF16
    values = np.concatenate([_float32_rounding_cases(13), _float32_rounding_cases(16)])
    names = [gpu._expression("narrow", t) for t in (np.float16, BF16)]
    module = xp.RawModule(code=gpu.SOURCE + _NARROW, options=gpu.OPTIONS, name_expressions=names)
    out = xp.empty(values.size, target)
    module.get_function(gpu._expression("narrow", target))(
        (64,), (256,), (xp.asarray(values), out, np.int64(values.size)))
    with np.errstate(all="ignore"):
        assert_same(out, values.astype(target))


@pytest.mark.parametrize("xp", [CUDA_HOST], indirect=True)
def test_an_altered_cuda_source_fails_the_host_comparison(xp, monkeypatch):
    """Negative control: one hash constant and the bfloat16 NaN constant changed in a copy
    of gpu.SOURCE make the encoded words and the bfloat16 divisions differ from the reference,
    while float16 (untouched) still matches."""
    altered = gpu.SOURCE
    for constant, other in (("0x846CA68Bu", "0x846CA68Du"), ("0x7FC0u", "0x7FC1u")):
        assert altered.count(constant) == 1, constant
        altered = altered.replace(constant, other)
    monkeypatch.setattr(gpu, "SOURCE", altered)
    codec = TernaryCodec(4, "uint64")
    flat = _gradient(np.random.default_rng(8), 999, np.float32)
    pairs = run_both(xp, "ternary_encode", flat, None, None, None, 2.0, KEY, codec,
                     np.empty(codec.words_for(999), np.uint64))
    assert not np.array_equal(asnumpy(pairs[0][0]), pairs[0][1])
    with np.errstate(all="ignore"):
        for dtype, differs in ((BF16, True), (np.dtype(np.float16), False)):
            every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
            (got, want), _, _ = run_both(xp, "scatter", every, None, np.empty_like(every), 3)
            assert (_bits(got) != _bits(want)).any() == differs, dtype


@pytest.mark.parametrize("xp", [CUDA_HOST], indirect=True)
def test_cuda_grid_stride_loops_cover_more_values_than_threads(xp, monkeypatch):
    """gpu.py caps the grid (at 65536 blocks, beyond the host's reach): capped at 3 blocks
    here, every kernel's threads stride over many values."""
    monkeypatch.setattr(gpu, "_MAX_BLOCKS", 3)
    rng = np.random.default_rng(10)
    for dtype in DTYPES:
        for packed in (False, True):
            _encode_decode_both(xp, rng, dtype, "uint64", 7, BIG, packed, "inplace", 4.0)
            flat, indices, residual, _ = _case(rng, dtype, BIG, packed, "given")
            check_both(xp, "absmax", flat, indices, residual)
            check_both(xp, "scatter", _gradient(rng, residual.size, dtype), indices, flat, 3)


_LANES = r"""
typedef unsigned long long u64;
__global__ void shuffle(const u64* in, u64* out, int delta) {
    unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    out[t] = __shfl_down_sync(0xFFFFFFFFu, in[t], delta);
}
__global__ void maximum(const u64* in, u64* out) {
    atomicMax(out, in[blockIdx.x * blockDim.x + threadIdx.x]);
}
__global__ void exits_early(u64* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_down_sync(0xFFFFFFFFu, out[threadIdx.x], 1);
}
"""


@pytest.fixture(scope="module")
def lanes():
    if host_cuda.compiler() is None:
        pytest.skip("needs a C++ compiler for the host CUDA route")
    return host_cuda.RawModule(code=_LANES, options=gpu.OPTIONS,
                               name_expressions=["shuffle", "maximum", "exits_early"])


def test_host_warps_shuffle_and_atomics_act_as_cuda_says(lanes):
    """__shfl_down_sync: lane l gets lane l + delta's value, its own past lane 31; atomicMax
    across blocks keeps the maximum."""
    values = np.random.default_rng(9).integers(0, 2 ** 63, 3 * 64, dtype=np.uint64)
    lane = np.arange(values.size) % 32
    for delta in (1, 5, 16):
        out = host_cupy.zeros_like(host_cupy.asarray(values))
        lanes.get_function("shuffle")((3,), (64,), (host_cupy.asarray(values), out,
                                                      np.int32(delta)))
        source = np.where(lane + delta < 32, np.arange(values.size) + delta, np.arange(lane.size))
        np.testing.assert_array_equal(asnumpy(out), values[source])
    top = host_cupy.zeros(1, np.uint64)
    lanes.get_function("maximum")((3,), (64,), (host_cupy.asarray(values), top))
    assert asnumpy(top)[0] == values.max()


def test_host_launches_refuse_what_a_gpu_would_get_wrong(lanes):
    """A partial warp or an exited lane in a full-warp shuffle, a scalar of another C type and
    a host array are errors, not garbage."""
    values, out = host_cupy.zeros(64, np.uint64), host_cupy.zeros(64, np.uint64)
    shuffle = lanes.get_function("shuffle")
    with pytest.raises(RuntimeError, match="all 32 lanes of a full warp"):
        shuffle((1,), (48,), (values, out, np.int32(1)))
    with pytest.raises(RuntimeError, match="deadlock"):
        lanes.get_function("exits_early")((1,), (32,), (out,))
    with pytest.raises(TypeError, match="argument 2 is i8 .*the kernel takes i4"):
        shuffle((1,), (32,), (values, out, np.int64(1)))
    with pytest.raises(TypeError, match="argument 0 is a NumPy array, in host memory"):
        shuffle((1,), (32,), (np.zeros(64, np.uint64), out, np.int32(1)))


# ---------------------------------------------------------------- the microbenchmark
def test_codec_benchmark_times_every_op_on_both_routes(tmp_path):
    from pacmpi.bench import codec
    pytest.importorskip("numba")
    out = tmp_path / "codec.json"
    assert codec.main(["--size", "4K", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ops = {(r["op"], r["density"], r["route"]) for r in result["rows"]}
    assert ("gather", 0.5, "numba") in ops and ("gather", 1.0, "numba") not in ops
    for op in ("absmax", "ternary_encode", "ternary_decode", "scatter"):
        assert {(op, d, route) for d in (1.0, 0.5) for route in ("numba", "numpy")} <= ops
    assert all(r["GBps"] > 0 for r in result["rows"])
    assert [r["op"] for r in result["first_calls"]] == ["import", *codec.OPS[1:]]
