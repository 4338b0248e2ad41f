"""Fused codec kernels for NumPy arrays, compiled by Numba: one parallel pass per call; and,
from the same float16/bfloat16 conversions, the MPI sum function :mod:`pacmpi.half_sum`
registers (:func:`half_sum_function`).

Imported only on first use (importing Numba takes a while). Every kernel reproduces
:mod:`pacmpi.kernels.reference` bit for bit: IEEE operations in the same precision and order,
the same counter-based random numbers, and float16/bfloat16 rounding done exactly as NumPy and
ml_dtypes do it. Compiled code is cached on disk (``cache=True``): in ``NUMBA_CACHE_DIR`` when
set, else in ``__pycache__`` beside this file, else (not writable) in ``~/.cache/numba``; one
signature per dtype combination, loaded in milliseconds instead of compiled in about a second.
Small calls run on the calling thread, compiled without a parallel region
(:data:`SERIAL_BELOW`); the pool's size is Numba's
(``NUMBA_NUM_THREADS``, ``numba.set_num_threads``).

Numba cannot type float16 or bfloat16, so their arrays come in as **uint16 (float16) and int16
(bfloat16) views**: the element type alone selects the conversion at compile time. Optional
arguments are fixed-type (an empty array and a flag instead of None), so each kernel is
compiled once per dtype combination, not once per combination of Nones. Arrays are indexed
with unsigned integers (:func:`_at`): Numba then skips its negative-index wraparound, whose
select on every address otherwise keeps LLVM from vectorizing the loops (5x slower).

Why one file of ~950 lines, above the core's ~600: Numba's on-disk cache is invalidated by its
function's own source file only ("changes in symbols defined in a different file" are not
noticed: Numba's caching notes). Split, an edit of the scalar helpers (16-bit conversions,
random numbers, ternary digits) would leave every cached kernel that inlined them stale, and the
kernel-vs-reference tests would then test the old code. The sections below keep the jobs apart.
"""
import functools
import os
import platform
import threading
from types import FunctionType

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.core import config
from numba.extending import intrinsic, overload

from .reference import compute_dtype, digit_powers, division_tables

__all__ = ["gather", "scatter", "compact", "expand", "absmax", "absmax_bits", "ternary_encode",
           "ternary_decode", "absmax_segments", "ternary_encode_segments", "ternary_encode_kept",
           "ternary_decode_segments", "converts",
           "compile_stats", "half_sum_function"]

# Values per parallel work item: small enough to balance threads and stay in L1/L2, big enough
# to amortize the scheduling.
CHUNK = 1 << 14
# Below this many values a call runs on the calling thread alone: waking the pool costs more
# than it saves, and on a busy machine a descheduled worker stalls the call for milliseconds.
SERIAL_BELOW = 1 << 16
_JIT = dict(cache=True, nogil=True)
# Numba's OpenMP layer shares libgomp with PyTorch and, when it starts its pool, sets the
# process's OpenMP thread count: torch's intra-op thread count then changes mid-run (1 -> all
# cores under mpirun's core binding), and with it torch's summation order. The workqueue layer
# has its own threads; it does not take concurrent launches, hence the lock.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
_LAUNCH_LOCK = threading.Lock()
_PARALLEL = dict(parallel=True, **_JIT)

_ONE = np.uint64(1)
_U32 = np.uint32


# ---------------------------------------------------------------- bit-level helpers
@intrinsic
def _float_bits(typingctx, x):
    """The IEEE bits of a float32/float64, zero-extended to uint64."""
    def codegen(context, builder, signature, args):
        raw = builder.bitcast(args[0], ir.IntType(x.bitwidth))
        return builder.zext(raw, ir.IntType(64)) if x.bitwidth < 64 else raw
    return types.uint64(x), codegen


@intrinsic
def _bits_float(typingctx, bits, like):
    """The float of ``like``'s type whose IEEE bits are the low bits of the integer ``bits``."""
    def codegen(context, builder, signature, args):
        raw = args[0]
        width = like.bitwidth
        if bits.bitwidth > width:
            raw = builder.trunc(raw, ir.IntType(width))
        elif bits.bitwidth < width:
            raw = builder.zext(raw, ir.IntType(width))
        return builder.bitcast(raw, context.get_value_type(like))
    return like(bits, like), codegen


@intrinsic
def _mulhi(typingctx, a, b):
    """High 64 bits of the 128-bit product of two uint64 (one x86 ``mul``)."""
    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))
    return types.uint64(types.uint64, types.uint64), codegen


@intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (one x86 ``popcnt``)."""
    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


@njit(**_JIT)
def _quotient(x, magic, shift):
    """``x // divisor`` for any uint64 ``x`` by Granlund-Montgomery multiplication, with
    ``magic, shift`` from :func:`~pacmpi.kernels.reference.division_tables`: a multiply instead
    of a ~15-cycle division."""
    t = _mulhi(magic, x)
    return (t + ((x - t) >> _ONE)) >> shift


@njit(**_JIT)
def _at(indices, packed, j):
    """The unsigned position of value ``j`` in flat: ``indices[j]``, or ``j`` unless packed."""
    return np.uint64(indices[np.uint64(j)]) if packed else np.uint64(j)


# ---------------------------------------------------------------- 16-bit floats
def hardware_half_conversions():
    """Whether Numba's target CPU converts half<->float in hardware (x86 F16C, ARMv8)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    features = config.CPU_FEATURES
    if features is None:
        if config.CPU_NAME is not None:
            return False  # a named generic target: assume nothing
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


# A compile-time constant of every kernel; Numba's on-disk cache is keyed by the CPU's features,
# so a cache written on another CPU is not reused here.
_HARDWARE_HALF = hardware_half_conversions()


@intrinsic
def _half_to_float_hardware(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _float_to_half_hardware(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(**_JIT)
def _half_nan_to_float(h):
    """A float16 NaN's bits (int64) -> float32 NaN with the payload kept unquieted, as NumPy."""
    return _bits_float(((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x03FF) << 13), np.float32(0))


@njit(**_JIT)
def _float_nan_to_half(f):
    """A float32 NaN's bits (int64) -> float16 bits keeping the top payload bits unquieted, as
    NumPy's ``npy_floatbits_to_halfbits`` (a payload that would vanish becomes 1)."""
    payload = 0x7C00 + ((f & 0x007FFFFF) >> 13)
    return np.uint16(((f >> 16) & 0x8000) + (payload + 1 if payload == 0x7C00 else payload))


@njit(**_JIT)
def _half_to_float(h):
    """float16 bits (uint16) -> float32, exactly as NumPy: in hardware where the CPU can (about
    10x faster than the bit manipulation), which quiets signalling NaNs, so NaNs take NumPy's
    bits separately (a select in the vectorized loop)."""
    if _HARDWARE_HALF:
        bits = np.int64(h)
        if (bits & 0x7C00) == 0x7C00 and (bits & 0x03FF) != 0:
            return _half_nan_to_float(bits)
        return _half_to_float_hardware(h)
    return _half_to_float_soft(h)


@njit(**_JIT)
def _float_to_half(x):
    """float32 -> float16 bits (uint16), round half to even, exactly as NumPy; in hardware where
    the CPU can, NaNs apart (see :func:`_half_to_float`)."""
    if _HARDWARE_HALF:
        f = np.int64(_float_bits(x))
        if (f & 0x7FFFFFFF) > 0x7F800000:
            return _float_nan_to_half(f)
        return _float_to_half_hardware(x)
    return _float_to_half_soft(x)


@njit(**_JIT)
def _half_to_float_soft(h):
    """float16 bits (uint16) -> float32, exactly (NaN payloads kept, as NumPy does)."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    exponent = h & 0x7C00
    if exponent == 0x7C00:
        return _half_nan_to_float(h) if h & 0x03FF else _bits_float(sign | 0x7F800000,
                                                                      np.float32(0))
    if exponent != 0:
        return _bits_float(sign | (((h & 0x7FFF) << 13) + ((127 - 15) << 23)), np.float32(0))
    magnitude = np.float32(h & 0x03FF) * np.float32(2.0 ** -24)  # subnormal or zero: exact
    return -magnitude if sign else magnitude


@njit(**_JIT)
def _float_to_half_soft(x):
    """float32 -> float16 bits (uint16), round half to even, as NumPy's
    ``npy_floatbits_to_halfbits``, by bit manipulation."""
    f = np.int64(_float_bits(x))
    sign = (f >> 16) & 0x8000
    exponent = f & 0x7F800000
    significand = f & 0x007FFFFF
    if exponent >= 0x47800000:  # overflow, Inf or NaN
        if exponent == 0x7F800000 and significand != 0:
            return _float_nan_to_half(f)
        return np.uint16(sign + 0x7C00)
    if exponent <= 0x38000000:  # a half subnormal or zero
        if exponent < 0x33000000:
            return np.uint16(sign)
        significand = (significand + 0x00800000) >> (113 - (exponent >> 23))
        # Ties go to even; the bits shifted out above decide whether it is a tie.
        if (significand & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            significand += 0x1000
        return np.uint16(sign + (significand >> 13))
    if (significand & 0x3FFF) != 0x1000:
        significand += 0x1000
    # A rounding carry spills into the exponent, up to Inf: the right result.
    return np.uint16(sign + ((exponent - 0x38000000) >> 13) + (significand >> 13))


@njit(**_JIT)
def _bf16_to_float(b):
    """bfloat16 bits (int16) -> float32, exactly."""
    return _bits_float((np.int64(b) & 0xFFFF) << 16, np.float32(0))


@njit(**_JIT)
def _float_to_bf16(x):
    """float32 -> bfloat16 bits (int16), round half to even; NaN -> quiet NaN, as ml_dtypes."""
    f = np.int64(_float_bits(x))
    if x != x:
        return np.int16(((f >> 16) & 0x8000) | 0x7FC0)
    return np.int16((f + 0x7FFF + ((f >> 16) & 1)) >> 16)


# ---------------------------------------------------------------- element conversions
# Typed by the @overload implementations below, by the element and dtype types they get.
def _to_float(x):
    """An element (uint16 = float16 bits, int16 = bfloat16 bits, float32/64) -> compute float."""


def _from_float(value, dtype):
    """A compute float -> an element of ``dtype`` (an array's ``.dtype``), rounded."""


def _convert(x, dtype):
    """An element of one kind -> an element of ``dtype``: bits unchanged for the same kind."""


def _divide(x, divisor):
    """``x / divisor`` computed in x's own dtype (16-bit: in float32, rounded back), as NumPy."""


def _as_float(value, like):
    """``value`` (an integer) as a float of ``like``'s type."""


@overload(_to_float)
def _to_float_impl(x):
    if x == types.uint16:
        return lambda x: _half_to_float(x)
    if x == types.int16:
        return lambda x: _bf16_to_float(x)
    return lambda x: x


@overload(_from_float)
def _from_float_impl(value, dtype):
    if dtype.dtype == types.uint16:
        return lambda value, dtype: _float_to_half(np.float32(value))
    if dtype.dtype == types.int16:
        return lambda value, dtype: _float_to_bf16(np.float32(value))
    return lambda value, dtype: dtype.type(value)


@overload(_convert)
def _convert_impl(x, dtype):
    if x == dtype.dtype:
        return lambda x, dtype: x
    return lambda x, dtype: _from_float(_to_float(x), dtype)


@overload(_divide)
def _divide_impl(x, divisor):
    if x == types.uint16:
        return lambda x, divisor: _float_to_half(_half_to_float(x) / divisor)
    if x == types.int16:
        return lambda x, divisor: _float_to_bf16(_bf16_to_float(x) / divisor)
    return lambda x, divisor: x / divisor


def _divide_bits(x, divisor):
    """:func:`_divide` of an element's integer view (:func:`_bit_view`), as that view."""


def _kept(x, bit):
    """``x`` (an integer) when ``bit`` is 1, else 0, without a branch."""


@overload(_divide_bits)
def _divide_bits_impl(x, divisor):
    if x == types.uint32:
        return lambda x, divisor: _U32(_float_bits(_bits_float(x, np.float32(0)) / divisor))
    if x == types.uint64:
        return lambda x, divisor: _float_bits(_bits_float(x, np.float64(0)) / divisor)
    return lambda x, divisor: _divide(x, divisor)


@overload(_kept)
def _kept_impl(x, bit):
    kind = numba.np.numpy_support.as_dtype(x).type
    return lambda x, bit: kind(x * kind(bit))


@overload(_as_float)
def _as_float_impl(value, like):
    if like == types.float32:
        return lambda value, like: np.float32(value)
    return lambda value, like: np.float64(value)


# Numba widens uint32 arithmetic to uint64; truncating every step keeps LLVM on 32-bit vector
# lanes (twice as many, and cheaper multiplies) with wrapping uint32 results.
@njit(**_JIT)
def _lowbias32(x):
    """Chris Wellons' lowbias32 on a uint32 (as pacmpi.hashing._lowbias32)."""
    x = _U32(x ^ (x >> _U32(16)))
    x = _U32(x * _U32(0x7FEB352D))
    x = _U32(x ^ (x >> _U32(15)))
    x = _U32(x * _U32(0x846CA68B))
    return _U32(x ^ (x >> _U32(16)))


@njit(**_JIT)
def _uniform(j, key_lo, key_hi):
    """Number ``j`` of :func:`pacmpi.hashing.uniform` for the key ``key_hi:key_lo`` (uint32)."""
    bits = _lowbias32(_U32(_lowbias32(_U32(_U32(j) + key_lo)) ^ key_hi))
    return np.float32(bits >> _U32(8)) * np.float32(2.0 ** -24)


@njit(**_JIT)
def _ternary_digit(v, u, positive, scale32):
    """Value ``v``'s ternary digit (-1, 0 or 1): kept with probability ``|v| / scale`` (``u``
    uniform), branch-free: the signs and draws are random, and in the segment kernels, whose
    loops LLVM does not vectorize, a branch on them mispredicted (2x their time). The
    one-tensor kernel writes it as a conditional, which LLVM vectorizes there with selects
    (this form is 1.3-2x slower in that loop)."""
    keep = positive & (u < np.float32(abs(v)) / scale32)
    return np.int64(keep) * (np.int64(v > 0) * 2 - 1)


@njit(**_JIT)
def _zero_span(flat, indices, packed, first, stop, count):
    """Zero the span of ``flat`` that values ``first..stop-1`` own before they are written into
    it: from just after the previous value's position to their last position (packed), plus
    the tail after the last value. Disjoint value ranges own disjoint spans, so parallel
    chunks zero and scatter, in cache, without a separate zeroing pass over flat."""
    if packed:
        start = indices[first - 1] + 1 if first > 0 else 0
    else:
        start = stop
    end = flat.size if stop == count else (indices[stop - 1] + 1 if packed else stop)
    flat[start:end].fill(0)


# ---------------------------------------------------------------- kernels
@njit(**_PARALLEL)
def _gather(flat, indices, packed, out):
    for j in prange(out.size):
        out[np.uint64(j)] = _convert(flat[_at(indices, packed, j)], out.dtype)


@njit(**_PARALLEL)
def _scatter(payload, indices, packed, flat, divisor, divide):
    count = payload.size
    if count == 0:
        flat.fill(0)
    for chunk in prange((count + CHUNK - 1) // CHUNK):
        first = chunk * CHUNK
        stop = min(first + CHUNK, count)
        _zero_span(flat, indices, packed, first, stop, count)
        for j in range(first, stop):
            x = _convert(payload[np.uint64(j)], flat.dtype)
            if divide:
                x = _divide(x, divisor)
            flat[_at(indices, packed, j)] = x


# In place, one thread: a parallel chunk would overwrite values another chunk has yet to read.
# Driven by the mask's bits (``packbits`` order: the first coordinate is bit 7 of byte 0),
# so the survivors need no position array.
@njit(**_JIT)
def _count_bits(bits):
    """How many bits of ``bits`` (uint8) are set, 8 bytes at a time."""
    whole = bits.size // 8
    total = np.uint64(0)
    for word in bits[:whole * 8].view(np.uint64):
        total += _popcount(word)
    for k in range(whole * 8, bits.size):
        total += _popcount(np.uint64(bits[k]))
    return total


@njit(**_JIT)
def _compact(flat, bits, count):
    """Survivors move forward, first first, from coordinate i to their rank j <= i among the
    ``count`` survivors (as many as ``bits`` has set): nothing unread is overwritten.

    Branch-free within a byte (a random mask's bits are unpredictable): every coordinate is
    copied to ``flat[j]``, which only a survivor then claims by advancing j; until then
    ``flat[j]`` is a place already read. So after the last survivor ``flat[count]`` may take
    a pruned value: it is put back (it was read at i = count, before any such copy). The last,
    partial byte is not read past the end."""
    held = flat[min(count, flat.size - 1)] if flat.size else flat.dtype.type(0)
    j = np.uint64(0)
    full = flat.size // 8
    for byte in range(full):
        b = np.uint64(bits[byte])
        if b == 0:
            continue
        i = np.uint64(byte) * np.uint64(8)
        for t in range(8):
            flat[j] = flat[i + np.uint64(t)]
            j += (b >> np.uint64(7 - t)) & _ONE
    if full < bits.size:
        b = np.uint64(bits[full])
        i = np.uint64(full) * np.uint64(8)
        for t in range(flat.size - full * 8):
            if (b >> np.uint64(7 - t)) & _ONE:
                flat[j] = flat[i + np.uint64(t)]
                j += _ONE
    if count < flat.size:
        flat[count] = held


@njit(**_JIT)
def _expand(flat, bits, count, divisor, divide):
    """Survivors move back, last first, from their rank j to coordinate i >= j; every
    coordinate from the end down is written once (its survivor or 0) after every payload value
    at or above it was read. ``flat`` is the values' integer view (:func:`_bit_view`).

    Branch-free within a byte, as :func:`_compact`: each coordinate reads ``flat[j - bit]``
    (in range: a pruned coordinate's j is at most its own place) and keeps it times its bit,
    an integer product, so a pruned coordinate gets +0 whatever the value read (NaN
    included). The last, partial byte, done first, is not read past the end."""
    j = np.uint64(count)
    size = flat.size
    full = size // 8
    if full < bits.size:
        b = np.uint64(bits[full])
        i = full * 8
        for t in range(size - i - 1, -1, -1):
            if (b >> np.uint64(7 - t)) & _ONE:
                j -= _ONE
                x = flat[j]
                flat[i + t] = _divide_bits(x, divisor) if divide else x
            else:
                flat[i + t] = 0
    for k in range(full):
        byte = full - 1 - k
        b = np.uint64(bits[byte])
        i = np.uint64(byte) * np.uint64(8)
        if b == 0:
            for t in range(8):
                flat[i + np.uint64(t)] = 0
            continue
        for t in range(7, -1, -1):
            bit = (b >> np.uint64(7 - t)) & _ONE
            j -= bit
            x = flat[j]
            if divide:
                x = _divide_bits(x, divisor)
            flat[i + np.uint64(t)] = _kept(x, bit)


@njit(**_PARALLEL)
def _absmax(flat, indices, packed, residual, add_residual, count):
    # The maximum is taken over the IEEE bits of |v|: for non-negative floats their order is
    # the integer order, NaN above Inf, so one integer max reduction also reports non-finite
    # values (and vectorizes, unlike a NaN-propagating float max).
    chunks = (count + CHUNK - 1) // CHUNK
    partial = np.zeros(max(chunks, 1), dtype=np.uint64)
    for chunk in prange(chunks):
        top = np.uint64(0)
        for j in range(chunk * CHUNK, min(chunk * CHUNK + CHUNK, count)):
            v = _to_float(flat[_at(indices, packed, j)])
            if add_residual:
                v += residual[np.uint64(j)]
            top = max(top, _float_bits(abs(v)))
        partial[chunk] = top
    return np.float64(_bits_float(partial.max(), _to_float(flat.dtype.type(0))))


@njit(**_PARALLEL)
def _ternary_encode(flat, indices, packed, residual_in, add_residual, residual_out,
                    keep_residual, positive, scale, scale32, key_lo, key_hi, powers, words,
                    count):
    # One prange iteration per word, so a word's digits never cross threads. ``positive`` is
    # decided on the caller's scale: a tiny one rounds to 0 in float32 but still quantizes.
    k = powers.size
    for w in prange(words.size):
        first = w * k
        word = np.uint64(0)
        for j in range(first, min(first + k, count)):
            v = _to_float(flat[_at(indices, packed, j)])
            if add_residual:
                v += residual_in[np.uint64(j)]
            keep = positive & (_uniform(j, key_lo, key_hi) < np.float32(abs(v)) / scale32)
            q = (1 if v > 0 else -1) if keep else 0  # _ternary_digit, as LLVM vectorizes it here
            if keep_residual:
                residual_out[np.uint64(j)] = v - _as_float(q, v) * scale
            word += np.uint64(q + 1) * powers[np.uint64(j - first)]
        words[np.uint64(w)] = word


@njit(**_PARALLEL)
def _ternary_decode(words, count, k, base, magics, shifts, ranks, scale, divisor, divide,
                    indices, packed, flat):
    # Digit d of a word is (word // base**d) - base * (word // base**(d+1)): every quotient
    # comes from the word itself, not from the previous digit, so the digits of a word are
    # independent (no serial chain of divisions) and the CPU overlaps them.
    if count == 0:
        flat.fill(0)
    nwords = (count + k - 1) // k
    chunk_words = max(1, CHUNK // k)
    for chunk in prange((nwords + chunk_words - 1) // chunk_words):
        w_first = chunk * chunk_words
        w_stop = min(w_first + chunk_words, nwords)
        _zero_span(flat, indices, packed, w_first * k, min(w_stop * k, count), count)
        for w in range(w_first, w_stop):
            word = np.uint64(words[np.uint64(w)])
            above = word
            for j in range(w * k, min(w * k + k, count)):
                d = np.uint64(j - w * k)
                below = above
                above = _quotient(word, magics[d], shifts[d])
                digit = np.int64(below - above * base)
                value = _as_float(digit - ranks, scale) * scale
                if divide:
                    value = value / divisor
                flat[_at(indices, packed, j)] = _from_float(value, flat.dtype)


# ---------------------------------------------------------------- many small segments
# A bucket's tensors (segments of its payload, each with its own ternary scale, starting on a
# word boundary) quantized in one serial call: the per-tensor kernels' operations in the same
# order per value, without a call per tensor. Segment s is payload values starts[s] up to
# starts[s + 1] (their positions in flat: indices, or the values themselves when not packed),
# its words word_starts[s] up to word_starts[s + 1]; ``which`` lists the segments to do. IEEE
# division, as in the parallel kernels (a zero scale gives Inf, not ZeroDivisionError).
@njit(error_model="numpy", **_JIT)
def _absmax_segments(flat, indices, packed, residual, add_residual, starts, which, out):
    zero = _to_float(flat.dtype.type(0))
    for i in range(which.size):
        s = which[i]
        top = np.uint64(0)
        for j in range(starts[s], starts[s + 1]):
            v = _to_float(flat[_at(indices, packed, j)])
            if add_residual:
                v += residual[np.uint64(j)]
            top = max(top, _float_bits(abs(v)))
        out[s] = np.float64(_bits_float(top, zero))


@njit(**_JIT)
def _bit_at(bits, i):
    """Bit of coordinate ``i`` in ``packbits`` order (the first coordinate the high bit)."""
    return (np.uint64(bits[i >> np.uint64(3)]) >> (np.uint64(7) - (i & np.uint64(7)))) & _ONE


@njit(error_model="numpy", **_JIT)
def _absmax_bits(flat, bits, residual, has_residual, offsets, starts, which, out):
    # Driven by the mask's bits, 64 coordinates (a block) at a time: their survivors are first
    # moved to a small buffer branch-free (as _compact does in place: every value copied to
    # buf[k], which only a survivor claims by advancing k; a random mask's bits are
    # unpredictable, and a branch per bit costs more than the copy), then the buffer and the
    # next k residual values are read side by side in a loop that vectorizes. A segment's
    # partial blocks at its ends go the same way, bit by bit (many small tensors are mostly
    # such ends). A pruned value (NaN included) is never read.
    zero = _to_float(flat.dtype.type(0))
    buf = np.empty(64, flat.dtype)
    for w in range(which.size):
        s = which[w]
        i, hi = np.uint64(offsets[s]), np.uint64(offsets[s + 1])
        j = np.uint64(starts[s])
        top = np.uint64(0)
        while i < hi:
            stop = min(hi, ((i >> np.uint64(6)) + _ONE) << np.uint64(6))
            k = np.uint64(0)
            if stop - i == np.uint64(64):
                for byte in range(8):
                    b = np.uint64(bits[(i >> np.uint64(3)) + np.uint64(byte)])
                    at = i + np.uint64(byte * 8)
                    for t in range(8):
                        buf[k] = flat[at + np.uint64(t)]
                        k += (b >> np.uint64(7 - t)) & _ONE
            else:
                for c in range(i, stop):
                    buf[k] = flat[c]
                    k += _bit_at(bits, c)
            if has_residual:
                for q in range(k):
                    v = _to_float(buf[q]) + residual[j + np.uint64(q)]
                    top = max(top, np.uint64(_float_bits(abs(v))))
            else:
                for q in range(k):
                    top = max(top, np.uint64(_float_bits(abs(_to_float(buf[q])))))
            j += k
            i = stop
        out[s] = np.float64(_bits_float(top, zero))


@njit(error_model="numpy", **_JIT)
def _ternary_encode_segments(flat, indices, packed, residual_in, add_residual, residual_out,
                             keep_residual, starts, word_starts, which, positive, scales,
                             scales32, keys_lo, keys_hi, powers, words):
    # A word's digits first, then the word: no value waits on the word's running sum (in the
    # hook's 400-tensor bucket 170 -> 150 us per step against one loop doing both).
    k = powers.size
    digits = np.empty(k, np.uint64)
    for i in range(which.size):
        s = which[i]
        first, stop = starts[s], starts[s + 1]
        positive_s, scale, scale32 = positive[s], scales[s], scales32[s]
        key_lo, key_hi = keys_lo[s], keys_hi[s]
        for w in range(word_starts[s], word_starts[s + 1]):
            j0 = first + (w - word_starts[s]) * k
            n = min(j0 + k, stop) - j0
            for d in range(n):
                j = j0 + d
                v = _to_float(flat[_at(indices, packed, j)])
                if add_residual:
                    v += residual_in[np.uint64(j)]
                q = _ternary_digit(v, _uniform(j - first, key_lo, key_hi), positive_s, scale32)
                if keep_residual:
                    residual_out[np.uint64(j)] = v - _as_float(q, v) * scale
                digits[d] = np.uint64(q + 1)
            word = np.uint64(0)
            for d in range(n):
                word += digits[d] * powers[d]
            words[np.uint64(w)] = word


@njit(error_model="numpy", **_JIT)
def _ternary_encode_kept(flat, bits, residual_in, residual_out, keep_residual, offsets, starts,
                         word_starts, which, positive, scales, scales32, keys_lo, keys_hi,
                         powers, words):
    # As _ternary_encode_segments over every coordinate (dense), the residual read and written
    # through the bits: coordinate j's is residual number r, the bits set before it; the others
    # add 0.0, as a full-length residual that is 0 there would.
    k = powers.size
    zero = _to_float(flat.dtype.type(0))
    for i in range(which.size):
        s = which[i]
        first, stop = offsets[s], offsets[s + 1]
        r = np.uint64(starts[s])
        for w in range(word_starts[s], word_starts[s + 1]):
            j0 = first + (w - word_starts[s]) * k
            word = np.uint64(0)
            for j in range(j0, min(j0 + k, stop)):
                bit = _bit_at(bits, np.uint64(j))
                v = _to_float(flat[np.uint64(j)])
                v += residual_in[r] if bit else zero
                q = _ternary_digit(v, _uniform(j - first, keys_lo[s], keys_hi[s]), positive[s],
                                   scales32[s])
                if keep_residual and bit:
                    residual_out[r] = v - _as_float(q, v) * scales[s]
                r += bit
                word += np.uint64(q + 1) * powers[np.uint64(j - j0)]
            words[np.uint64(w)] = word


@njit(error_model="numpy", **_JIT)
def _ternary_decode_segments(words, k, base, magics, shifts, ranks, scales, divisor, divide,
                             indices, packed, offsets, starts, word_starts, which, flat):
    for i in range(which.size):
        s = which[i]
        flat[offsets[s]:offsets[s + 1]].fill(0)
        first, stop = starts[s], starts[s + 1]
        for w in range(word_starts[s], word_starts[s + 1]):
            word = np.uint64(words[np.uint64(w)])
            above = word
            j0 = first + (w - word_starts[s]) * k
            for j in range(j0, min(j0 + k, stop)):
                d = np.uint64(j - j0)
                below = above
                above = _quotient(word, magics[d], shifts[d])
                digit = np.int64(below - above * base)
                value = _as_float(digit - ranks, scales[s]) * scales[s]
                if divide:
                    value = value / divisor
                flat[_at(indices, packed, j)] = _from_float(value, flat.dtype)


# ---------------------------------------------------------------- half-precision MPI sums
# An MPI_User_function: void(void *in, void *inout, int *len, MPI_Datatype *type).
_USER_FUNCTION = types.void(types.voidptr, types.voidptr, types.CPointer(types.int32),
                            types.voidptr)
# dtype name -> (the Numba-typable view, widening, narrowing conversion). float16 converts in
# hardware without the kernels' NaN fix-ups: an add quiets a NaN whatever its payload, so they
# would change no sum's bits, and they keep LLVM from vectorizing the loop (5x slower).
_HALF_SUM_CONVERSIONS = {
    "float16": (np.uint16, _half_to_float_hardware, _float_to_half_hardware),
    "float16 soft": (np.uint16, _half_to_float_soft, _float_to_half_soft),
    "bfloat16": (np.int16, _bf16_to_float, _float_to_bf16)}


@functools.lru_cache(maxsize=None)
def half_sum_function(name, soft=False):
    """A compiled MPI_User_function that sums ``len`` values of the dtype called ``name``
    (``"float16"`` or ``"bfloat16"``): ``inout[i] = round(float32(inout[i]) + float32(in[i]))``,
    which is NumPy's (ml_dtypes') addition bit for bit but for NaN payloads, through the
    kernels' own conversions. float16 converts in hardware where the CPU can, else (or with
    ``soft``, for tests) by bit manipulation. Compiled on the first call for each dtype, in
    memory only: Numba's disk cache does not take a cfunc built in a function.
    """
    soft = name == "float16" and (soft or not _HARDWARE_HALF)
    view, widen, narrow = _HALF_SUM_CONVERSIONS["float16 soft" if soft else name]

    @cfunc(_USER_FUNCTION)
    def half_sum(invec, inoutvec, length, datatype):
        n = length[0]
        src, acc = carray(invec, n, dtype=view), carray(inoutvec, n, dtype=view)
        for i in range(n):
            acc[i] = narrow(widen(acc[i]) + widen(src[i]))

    return half_sum


# ---------------------------------------------------------------- Python side
_NO_INDICES = np.empty(0, dtype=np.int64)
_KERNELS = {"gather": _gather, "scatter": _scatter, "compact": _compact, "expand": _expand,
            "absmax": _absmax,
            "ternary_encode": _ternary_encode, "ternary_decode": _ternary_decode,
            "absmax_segments": _absmax_segments, "absmax_bits": _absmax_bits,
            "ternary_encode_segments": _ternary_encode_segments,
            "ternary_encode_kept": _ternary_encode_kept,
            "ternary_decode_segments": _ternary_decode_segments}


def _serial_twin(kernel):
    """The same kernel compiled without ``parallel=True`` (its prange a plain loop: the same
    operations in the same order per value), for calls below :data:`SERIAL_BELOW` values:
    entering a parallel region costs about 0.1 ms even on one thread, which a model of a few
    hundred small tensors pays several times per tensor and step. Named apart, so Numba's
    disk cache keeps its own entries."""
    py = kernel.py_func
    twin = FunctionType(py.__code__, py.__globals__, py.__name__ + "_serial", py.__defaults__,
                        py.__closure__)
    twin.__qualname__ = twin.__name__
    twin.__doc__ = py.__doc__
    # IEEE division (x / 0 is Inf or NaN), as parallel loop bodies compute it; Numba's
    # default for plain functions raises ZeroDivisionError instead.
    return njit(error_model="numpy", **_JIT)(twin)


_SERIAL = {kernel: _serial_twin(kernel) for kernel in (_gather, _scatter, _absmax,
                                                       _ternary_encode, _ternary_decode)}


def compile_stats():
    """Per kernel (its parallel and serial versions together): signatures loaded from Numba's
    on-disk cache (hits) and compiled in this process (misses), and the cache directory."""
    return {name: {"cache_hits": sum(sum(d.stats.cache_hits.values()) for d in _versions(k)),
                   "compiled": sum(sum(d.stats.cache_misses.values()) for d in _versions(k)),
                   "cache_dir": k.stats.cache_path}
            for name, k in _KERNELS.items()}


def _versions(kernel):
    return (kernel, _SERIAL[kernel]) if kernel in _SERIAL else (kernel,)


def _view(array):
    """The Numba-typable view of a float array (float16 -> uint16, bfloat16 -> int16). Read
    from the dtype's kind and size, not its name: ``dtype.name`` costs microseconds, paid
    several times per tensor and step."""
    dtype = array.dtype
    if dtype.itemsize != 2:
        return array
    return array.view(np.uint16 if dtype.kind == "f" else np.int16)  # bfloat16's kind is V


def _optional(array, dtype):
    """``(array, True)``, or an empty stand-in and False for None."""
    return (np.empty(0, dtype=dtype), False) if array is None else (array, True)


def _indices(indices, size):
    """``(indices, packed)``; sorted positions are in range when their ends are (the kernels
    do not check bounds)."""
    if indices is None:
        return _NO_INDICES, False
    if indices.size and (indices[0] < 0 or indices[-1] >= size):
        raise IndexError(f"indices must be sorted positions in [0, {size})")
    return indices, True


def converts(source, target):
    """Whether the kernels convert ``source`` elements to ``target`` exactly as NumPy: always
    to float32/float64 and to the same dtype; to float16/bfloat16 only from float32 (a float64
    source would need its own rounding)."""
    return source == target or target.itemsize > 2 or source == np.float32


def _launch(kernel, count, *args):
    """``kernel(*args)`` on the pool, or its serial twin on this thread for small ``count``."""
    if count < SERIAL_BELOW:
        return _SERIAL[kernel](*args)
    with _LAUNCH_LOCK:
        return kernel(*args)


def _unsigned(words):
    return words.view(np.dtype(f"u{words.dtype.itemsize}"))


def gather(flat, indices, out):
    _launch(_gather, out.size, _view(flat), *_indices(indices, flat.size), _view(out))
    return out


def scatter(payload, indices, flat, divisor=None):
    divide = divisor is not None
    value = compute_dtype(flat.dtype).type(flat.dtype.type(divisor if divide else 1))
    _launch(_scatter, flat.size, _view(payload), *_indices(indices, flat.size), _view(flat),
            value, divide)
    return flat


def _check_count(name, bits, count):
    """The kernels index by ``count`` unchecked: it must be the bits' (the engine's counts
    come from the same bits, so this is a caller's error)."""
    found = _count_bits(bits)
    if found != count:
        raise ValueError(f"{name}: the bits hold {found} survivors, not {count}")


def compact(flat, bits, count):
    _check_count("compact", bits, count)
    _compact(_view(flat), bits, count)
    return flat[:count]


def _bit_view(array):
    """The array's elements as unsigned integers of their width (bfloat16: int16, as
    :func:`_view`)."""
    return array if array.dtype.itemsize == 2 else array.view(f"u{array.dtype.itemsize}")


def expand(flat, bits, count, divisor=None):
    _check_count("expand", bits, count)
    divide = divisor is not None
    value = compute_dtype(flat.dtype).type(flat.dtype.type(divisor if divide else 1))
    _expand(_bit_view(_view(flat)), bits, count, value, divide)
    return flat


def absmax(flat, indices, residual):
    count = flat.size if indices is None else indices.size
    return float(_launch(_absmax, count, _view(flat), *_indices(indices, flat.size),
                         *_optional(residual, compute_dtype(flat.dtype)), count))


def ternary_encode(flat, indices, residual_in, residual_out, scale, key, codec, words_out):
    compute = compute_dtype(flat.dtype)
    count = flat.size if indices is None else indices.size
    _launch(_ternary_encode, count, _view(flat), *_indices(indices, flat.size),
            *_optional(residual_in, compute), *_optional(residual_out, compute),
            bool(scale > 0), compute.type(scale), np.float32(scale), _U32(key & 0xFFFFFFFF),
            _U32((key >> 32) & 0xFFFFFFFF), digit_powers(codec.base, codec.digits_per_word),
            _unsigned(words_out), count)
    return words_out


def ternary_decode(words, count, codec, ranks, scale, divisor, indices, flat):
    compute = compute_dtype(flat.dtype).type
    divide = divisor is not None
    _launch(_ternary_decode, flat.size, _unsigned(words), count, codec.digits_per_word,
            np.uint64(codec.base), *division_tables(codec.base, codec.digits_per_word),
            np.int64(ranks), compute(scale), compute(divisor if divide else 1), divide,
            *_indices(indices, flat.size), _view(flat))
    return flat


def _keys(keys):
    """Per-segment 64-bit keys as their (low, high) uint32 words."""
    keys = np.asarray(keys, dtype=np.uint64)
    return ((keys & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            (keys >> np.uint64(32)).astype(np.uint32))


def absmax_segments(flat, indices, residual, starts, which, out):
    """``out[s]`` = :func:`absmax` of segment ``s`` for each ``s`` in ``which``."""
    _absmax_segments(_view(flat), *_indices(indices, flat.size),
                     *_optional(residual, compute_dtype(flat.dtype)), starts, which, out)
    return out


def absmax_bits(flat, bits, residual, offsets, starts, which, out):
    """``out[s]`` = the absmax of segment ``s``'s coordinates set in ``bits`` (plus their
    residual) for each ``s`` in ``which`` (segments with at least one survivor)."""
    _absmax_bits(_view(flat), bits, *_optional(residual, compute_dtype(flat.dtype)), offsets,
                 starts, which, out)
    return out


def ternary_encode_segments(flat, indices, residual_in, residual_out, scales, keys, codec,
                            words_out, starts, word_starts, which):
    """:func:`ternary_encode` of each segment in ``which`` with its scale and key into its
    words; ``scales`` float64 and ``keys`` per segment."""
    compute = compute_dtype(flat.dtype)
    _ternary_encode_segments(
        _view(flat), *_indices(indices, flat.size), *_optional(residual_in, compute),
        *_optional(residual_out, compute), starts, word_starts, which, scales > 0,
        scales.astype(compute), scales.astype(np.float32), *_keys(keys),
        digit_powers(codec.base, codec.digits_per_word), _unsigned(words_out))
    return words_out


def ternary_encode_kept(flat, bits, residual_in, residual_out, offsets, starts, word_starts,
                        which, scales, keys, codec, words_out):
    """:func:`pacmpi.kernels.reference.ternary_encode_kept`, one serial call for every segment
    in ``which``."""
    compute = compute_dtype(flat.dtype)
    _ternary_encode_kept(
        _view(flat), bits, residual_in, *_optional(residual_out, compute), offsets, starts,
        word_starts, which, scales > 0, scales.astype(compute), scales.astype(np.float32),
        *_keys(keys), digit_powers(codec.base, codec.digits_per_word), _unsigned(words_out))
    return words_out


def ternary_decode_segments(words, codec, ranks, scales, divisor, indices, flat, offsets,
                            starts, word_starts, which):
    """:func:`ternary_decode` of each segment in ``which`` into ``flat[offsets[s]:offsets[s +
    1]]`` (its coordinates without a value exactly 0)."""
    compute = compute_dtype(flat.dtype)
    divide = divisor is not None
    _ternary_decode_segments(
        _unsigned(words), codec.digits_per_word, np.uint64(codec.base),
        *division_tables(codec.base, codec.digits_per_word), np.int64(ranks),
        scales.astype(compute), compute.type(divisor if divide else 1), divide,
        *_indices(indices, flat.size), offsets, starts, word_starts, which, _view(flat))
    return flat
