"""Fused codec kernels for CuPy arrays: CUDA source compiled by CuPy (NVRTC) on first use.

CuPy is never imported here: the arrays are CuPy arrays, so the caller already imported it and
it is found in ``sys.modules``. Each call is one kernel launch (after a memset where flat must
be zeroed first) with no full-size temporaries; absmax also reads back one word. A thread owns
a ternary word, so a word's digits never cross threads. The arithmetic follows
:mod:`pacmpi.kernels.cpu` step for step (IEEE division, no FMA contraction, float16 and
bfloat16 rounded bit by bit as NumPy and ml_dtypes do), so every route matches the reference bit
for bit. The kernels take pointers and the array's dtype only selects the instantiation, so
16-bit floats are stored as 16-bit structs: bfloat16 arrays (``ml_dtypes.bfloat16``) need
CuPy >= 14, which accepts that dtype. CuPy compiles every module with ``-ftz=true`` (it appends
it to any options), which would flush float32 subnormals to zero in the compiler's own
instructions: the float32 arithmetic here is written as PTX without ``.ftz``
(tests/test_cuda_compile.py checks the PTX). One exception to "bit for bit": a GPU's
single-precision arithmetic with a NaN operand returns the canonical NaN 0x7fffffff, where x86
carries the operand's payload and sign, so a NaN stays a NaN in the same place but its bits may
differ.
"""
import functools
import sys

import numpy as np

from ..bitmaps import POPCOUNT
from .reference import compute_dtype, digit_powers, division_tables

__all__ = ["gather", "scatter", "compact", "expand", "absmax", "absmax_bits",
           "ternary_encode", "ternary_encode_kept", "ternary_decode", "converts"]

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

// 16-bit float elements as stored, converted by hand exactly as NumPy's npy_half and ml_dtypes
// do, so NaN payloads and rounding agree with the host reference.
struct half_bits { unsigned short bits; };  // float16
struct bf16_bits { unsigned short bits; };  // bfloat16: the high half of a float32

// float32 operations that keep subnormals, as NumPy does, whatever -ftz CuPy compiles with:
// PTX without .ftz on the device (rounded to nearest, never contracted into an FMA); plain
// operators where this source is built for the host (the tests' g++ route).
#ifdef __CUDA_ARCH__
#define F32_OP(name, instruction) \
    __device__ __forceinline__ float name(float a, float b) { \
        float r; asm(instruction " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
F32_OP(add_rn, "add.rn.f32")
F32_OP(sub_rn, "sub.rn.f32")
F32_OP(mul_rn, "mul.rn.f32")
F32_OP(div_rn, "div.rn.f32")
__device__ __forceinline__ bool less(float a, float b) {
    u32 r;
    asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ float narrow(double x) {
    float r; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x)); return r;
}
#else
__device__ __forceinline__ float add_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float sub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float div_rn(float a, float b) { return a / b; }
__device__ __forceinline__ bool less(float a, float b) { return a < b; }
__device__ __forceinline__ float narrow(double x) { return (float)x; }
#endif
// float64 has no flush-to-zero mode: its operators keep subnormals.
__device__ __forceinline__ double add_rn(double a, double b) { return a + b; }
__device__ __forceinline__ double sub_rn(double a, double b) { return a - b; }
__device__ __forceinline__ double mul_rn(double a, double b) { return a * b; }
__device__ __forceinline__ double div_rn(double a, double b) { return a / b; }
__device__ __forceinline__ float narrow(float x) { return x; }
// |x| and the sign from the bits (abs.f32 and comparisons would flush subnormals).
__device__ __forceinline__ float magnitude(float x) {
    return __uint_as_float(__float_as_uint(x) & 0x7FFFFFFFu);
}
__device__ __forceinline__ double magnitude(double x) { return fabs(x); }
__device__ __forceinline__ bool negative(float x) { return (__float_as_uint(x) >> 31) != 0; }
__device__ __forceinline__ bool negative(double x) { return __double_as_longlong(x) < 0; }

__device__ __forceinline__ float to_float(half_bits x) {
    u32 h = x.bits;
    u32 sign = (h & 0x8000u) << 16;
    u32 exponent = h & 0x7C00u;
    if (exponent == 0x7C00u) return __uint_as_float(sign | 0x7F800000u | ((h & 0x3FFu) << 13));
    if (exponent != 0) return __uint_as_float(sign | (((h & 0x7FFFu) << 13) + (112u << 23)));
    float magnitude = mul_rn((float)(h & 0x3FFu), 5.9604644775390625e-08f);  // m * 2**-24
    return __uint_as_float(sign | __float_as_uint(magnitude));
}
__device__ __forceinline__ float to_float(bf16_bits x) {
    return __uint_as_float((u32)x.bits << 16);
}
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_float(double x) { return x; }

// float32 -> float16 bits, round half to even (npy_floatbits_to_halfbits).
__device__ __forceinline__ half_bits to_half(float x) {
    u32 f = __float_as_uint(x);
    u32 sign = (f >> 16) & 0x8000u;
    u32 exponent = f & 0x7F800000u;
    u32 significand = f & 0x007FFFFFu;
    half_bits h;
    if (exponent >= 0x47800000u) {  // overflow, Inf or NaN
        u32 payload = 0x7C00u + (significand >> 13);
        bool nan = exponent == 0x7F800000u && significand != 0;
        h.bits = (unsigned short)(sign + (!nan ? 0x7C00u : payload == 0x7C00u ? payload + 1
                                                                                 : payload));
        return h;
    }
    if (exponent <= 0x38000000u) {  // a half subnormal or zero
        if (exponent < 0x33000000u) { h.bits = (unsigned short)sign; return h; }
        significand = (significand + 0x00800000u) >> (113u - (exponent >> 23));
        if ((significand & 0x3FFFu) != 0x1000u || (f & 0x7FFu) != 0) significand += 0x1000u;
        h.bits = (unsigned short)(sign + (significand >> 13));
        return h;
    }
    if ((significand & 0x3FFFu) != 0x1000u) significand += 0x1000u;
    h.bits = (unsigned short)(sign + ((exponent - 0x38000000u) >> 13) + (significand >> 13));
    return h;
}

// float32 -> bfloat16 bits, round half to even; NaN -> the quiet NaN of its sign (ml_dtypes).
__device__ __forceinline__ bf16_bits to_bf16(float x) {
    u32 f = __float_as_uint(x);
    bf16_bits b;
    b.bits = (unsigned short)(x != x ? ((f >> 16) & 0x8000u) | 0x7FC0u
                                     : (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
    return b;
}

__device__ __forceinline__ void store(half_bits* p, float v) { *p = to_half(v); }
__device__ __forceinline__ void store(bf16_bits* p, float v) { *p = to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }

// x / d in x's own dtype, as NumPy: 16-bit floats divide in float32 and round back.
__device__ __forceinline__ half_bits divided(half_bits x, float d) {
    return to_half(div_rn(to_float(x), d));
}
__device__ __forceinline__ bf16_bits divided(bf16_bits x, float d) {
    return to_bf16(div_rn(to_float(x), d));
}
__device__ __forceinline__ float divided(float x, float d) { return div_rn(x, d); }
__device__ __forceinline__ double divided(double x, double d) { return x / d; }

__device__ __forceinline__ u64 magnitude_bits(float v) { return __float_as_uint(magnitude(v)); }
__device__ __forceinline__ u64 magnitude_bits(double v) {
    return (u64)__double_as_longlong(fabs(v));
}

__device__ __forceinline__ u32 lowbias32(u32 x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

// Number j of pacmpi.hashing.uniform for the key key_hi:key_lo.
__device__ __forceinline__ float uniform(i64 j, u32 key_lo, u32 key_hi) {
    u32 bits = lowbias32(lowbias32((u32)j + key_lo) ^ key_hi);
    return mul_rn((float)(bits >> 8), 5.9604644775390625e-08f);
}

#define GRID_STRIDE(i, n) \
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); \
         i += (i64)blockDim.x * gridDim.x)

template<typename T, typename D, typename I>
__global__ void scatter(const T* payload, const I* indices, int packed, T* flat,
                        D divisor, int divide, i64 count) {
    GRID_STRIDE(j, count) {
        T x = payload[j];
        flat[packed ? indices[j] : j] = divide ? divided(x, divisor) : x;
    }
}

// Driven by a mask's bits (packbits order: coordinate i is bit 7 - i % 8 of byte i / 8), 64
// coordinates a thread: its survivors are payload values firsts[b] on (the bits set before
// coordinate 64 b). Out of place: a GPU's threads cannot move survivors within one array.
__device__ __forceinline__ int kept_bit(const unsigned char* bits, i64 i) {
    return (bits[i >> 3] >> (7 - (i & 7))) & 1;
}

template<typename T>
__global__ void gather_bits(const T* flat, const unsigned char* bits, const i64* firsts,
                            i64 size, T* out) {
    GRID_STRIDE(b, (size + 63) / 64) {
        i64 j = firsts[b];
        i64 stop = min(64 * b + 64, size);
        for (i64 i = 64 * b; i < stop; ++i)
            if (kept_bit(bits, i)) out[j++] = flat[i];
    }
}

// Every coordinate written once: its survivor's payload value (divided as scatter does) or 0.
template<typename T, typename D>
__global__ void scatter_bits(const T* payload, const unsigned char* bits, const i64* firsts,
                             i64 size, T* flat, D divisor, int divide) {
    GRID_STRIDE(b, (size + 63) / 64) {
        i64 j = firsts[b];
        i64 stop = min(64 * b + 64, size);
        for (i64 i = 64 * b; i < stop; ++i) {
            if (kept_bit(bits, i)) {
                T x = payload[j++];
                flat[i] = divide ? divided(x, divisor) : x;
            } else {
                flat[i] = T();
            }
        }
    }
}

// Per segment s (coordinates offsets[s] up to offsets[s + 1]) the largest |value + residual|
// over its survivors, as IEEE bits into tops[s] (atomicMax, as absmax below); a thread per 64
// coordinates, the segment found by bisection, the residual of survivor number j (firsts).
template<typename T, typename C>
__global__ void absmax_bits(const T* flat, const unsigned char* bits, const i64* firsts,
                            const C* residual, int add_residual, const i64* offsets,
                            i64 segments, i64 size, u64* tops) {
    GRID_STRIDE(b, (size + 63) / 64) {
        i64 i = 64 * b, stop = min(min(64 * b + 64, size), offsets[segments]), j = firsts[b];
        i64 lo = 0, hi = segments;  // the last segment starting at or before i
        while (hi - lo > 1) {
            i64 mid = (lo + hi) / 2;
            if (offsets[mid] <= i) lo = mid; else hi = mid;
        }
        i64 s = lo;
        u64 top = 0;
        for (; i < stop; ++i) {
            while (i >= offsets[s + 1]) {  // the next segment (empty ones skipped)
                if (top) atomicMax(tops + s, top);
                top = 0;
                ++s;
            }
            if (kept_bit(bits, i)) {
                C v = to_float(flat[i]);
                if (add_residual) v = add_rn(v, residual[j]);
                top = max(top, magnitude_bits(v));
                ++j;
            }
        }
        if (top) atomicMax(tops + s, top);
    }
}

// The maximum of |v| over the IEEE bits: for non-negative floats their order is the integer
// order, NaN above Inf, so an integer atomicMax also reports non-finite values.
template<typename T, typename C, typename I>
__global__ void absmax(const T* flat, const I* indices, int packed, const C* residual,
                       int add_residual, i64 count, u64* result) {
    u64 top = 0;
    GRID_STRIDE(j, count) {
        C v = to_float(flat[packed ? indices[j] : j]);
        if (add_residual) v = add_rn(v, residual[j]);
        top = max(top, magnitude_bits(v));
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        top = max(top, __shfl_down_sync(0xFFFFFFFFu, top, offset));
    if ((threadIdx.x & 31) == 0) atomicMax(result, top);
}

template<typename T, typename C, typename W, typename I>
__global__ void ternary_encode(const T* flat, const I* indices, int packed,
                               const C* residual_in, int add_residual, C* residual_out,
                               int keep_residual, int positive, C scale, float scale32,
                               u32 key_lo, u32 key_hi, const u64* powers, int k, W* words,
                               i64 nwords, i64 count) {
    GRID_STRIDE(w, nwords) {
        u64 word = 0;
        i64 stop = min(w * k + k, count);
        for (i64 j = w * k; j < stop; ++j) {
            C v = to_float(flat[packed ? indices[j] : j]);
            if (add_residual) v = add_rn(v, residual_in[j]);
            int q = 0;
            if (positive && less(uniform(j, key_lo, key_hi),
                                 div_rn(narrow(magnitude(v)), scale32)))
                q = negative(v) ? -1 : 1;
            if (keep_residual) residual_out[j] = sub_rn(v, mul_rn((C)q, scale));
            word += (u64)(q + 1) * powers[j - w * k];
        }
        words[w] = (W)word;
    }
}

// ternary_encode of every coordinate of segment s (offsets[s] up to offsets[s + 1], dense, its
// words from word_starts[s]) whose residual is kept for the coordinates set in bits only:
// survivor number r's (firsts: the bits set before every 64th coordinate); the others add 0.
template<typename T, typename C, typename W>
__global__ void ternary_encode_kept(const T* flat, const unsigned char* bits, const i64* firsts,
                                    const C* residual_in, C* residual_out, int keep_residual,
                                    const i64* offsets, const i64* word_starts, i64 segments,
                                    const int* positive, const C* scales, const float* scales32,
                                    const u32* keys_lo, const u32* keys_hi, const u64* powers,
                                    int k, W* words, i64 nwords) {
    GRID_STRIDE(w, nwords) {
        i64 lo = 0, hi = segments;  // the segment whose words hold word w
        while (hi - lo > 1) {
            i64 mid = (lo + hi) / 2;
            if (word_starts[mid] <= w) lo = mid; else hi = mid;
        }
        i64 s = lo, first = offsets[s];
        i64 j0 = first + (w - word_starts[s]) * k, stop = min(j0 + k, offsets[s + 1]);
        i64 r = firsts[j0 / 64];
        for (i64 i = j0 / 64 * 64; i < j0; ++i) r += kept_bit(bits, i);
        u64 word = 0;
        for (i64 j = j0; j < stop; ++j) {
            int bit = kept_bit(bits, j);
            C v = add_rn((C)to_float(flat[j]), bit ? residual_in[r] : (C)0);
            int q = 0;
            if (positive[s] && less(uniform(j - first, keys_lo[s], keys_hi[s]),
                                    div_rn(narrow(magnitude(v)), scales32[s])))
                q = negative(v) ? -1 : 1;
            if (keep_residual && bit) residual_out[r] = sub_rn(v, mul_rn((C)q, scales[s]));
            r += bit;
            word += (u64)(q + 1) * powers[j - j0];
        }
        words[w] = (W)word;
    }
}

// Digit d of a word is (word // base**d) - base * (word // base**(d+1)); each quotient is a
// Granlund-Montgomery multiply (magics[d], shifts[d] divide by base**(d+1)).
template<typename T, typename C, typename W, typename I>
__global__ void ternary_decode(const W* words, i64 count, int k, u64 base, const u64* magics,
                               const u64* shifts, i64 ranks, C scale, C divisor, int divide,
                               const I* indices, int packed, T* flat) {
    GRID_STRIDE(w, (count + k - 1) / k) {
        u64 word = words[w];
        u64 above = word;
        i64 stop = min(w * k + k, count);
        for (i64 j = w * k; j < stop; ++j) {
            u64 below = above;
            u64 t = __umul64hi(magics[j - w * k], word);
            above = (t + ((word - t) >> 1)) >> shifts[j - w * k];
            C value = mul_rn((C)((i64)(below - above * base) - ranks), scale);
            if (divide) value = div_rn(value, divisor);
            store(flat + (packed ? indices[j] : j), value);
        }
    }
}
"""

OPTIONS = ("--std=c++14", "--fmad=false")  # NVRTC's; no FMA contraction: as the reference
_BLOCK = 256
_MAX_BLOCKS = 1 << 16  # grid-stride loops cover the rest
_CTYPES = {"float16": "half_bits", "bfloat16": "bf16_bits", "float32": "float",
           "float64": "double", "uint32": "unsigned int", "uint64": "unsigned long long",
           "int32": "int", "int64": "long long"}
# Survivor positions come as int32 (buckets under 2**31 elements) or int64; unpacked calls
# take the int64 instantiation with an empty stand-in.
INDEX_DTYPES = ("int32", "int64")


def _cupy():
    return sys.modules["cupy"]


def _expression(name, *dtypes):
    """``name<ctypes>`` for dtypes or dtype names (bfloat16 by name: ml_dtypes may be absent)."""
    names = (d if isinstance(d, str) else np.dtype(d).name for d in dtypes)
    return f"{name}<{', '.join(_CTYPES[n] for n in names)}>"


def expressions():
    """Every kernel instantiation the wrappers below launch."""
    for storage in ("float16", "bfloat16", "float32", "float64"):
        compute = "float64" if storage == "float64" else "float32"
        yield _expression("gather_bits", storage)
        yield _expression("absmax_bits", storage, compute)
        yield _expression("scatter_bits", storage, compute)
        for index in INDEX_DTYPES:
            yield _expression("scatter", storage, compute, index)
            yield _expression("absmax", storage, compute, index)
            for word in ("uint32", "uint64"):
                yield _expression("ternary_encode", storage, compute, word, index)
                if index == "int64":  # no positions: one instantiation per word type
                    yield _expression("ternary_encode_kept", storage, compute, word)
                yield _expression("ternary_decode", storage, compute, word, index)


@functools.lru_cache(maxsize=None)
def _module():
    """All kernels in one NVRTC compilation (CuPy also caches it on disk)."""
    return _cupy().RawModule(code=SOURCE, options=OPTIONS, name_expressions=list(expressions()))


def _kernel(name, *dtypes):
    return _module().get_function(_expression(name, *dtypes))


def _launch(kernel, items, *args):
    if items:
        blocks = min(-(-items // _BLOCK), _MAX_BLOCKS)
        kernel((blocks,), (_BLOCK,), args)


@functools.lru_cache(maxsize=None)
def _device_table(device, table, base, digits):
    """Codec tables (uint64) on one GPU."""
    if table == "powers":
        return _cupy().asarray(digit_powers(base, digits))
    return tuple(_cupy().asarray(t) for t in division_tables(base, digits))


def _table(table, codec):
    return _device_table(_cupy().cuda.Device().id, table, codec.base, codec.digits_per_word)


def _optional(array, dtype):
    """``(array, 1)``, or an empty stand-in and 0 for None."""
    return (_cupy().empty(0, dtype=dtype), np.int32(0)) if array is None else (array, np.int32(1))


def _indices(indices):
    """``(indices, packed)`` and the index dtype that picks the instantiation."""
    return (*_optional(indices, np.int64), np.int64 if indices is None else indices.dtype)


def _unsigned(words):
    return words.view(np.dtype(f"u{words.dtype.itemsize}"))


def _zero_unwritten(flat, indices, count):
    """A memset of what the scattering kernel will not write: all of flat when packed (it
    writes the survivors afterwards), else the tail after ``count`` values."""
    if indices is not None or count < flat.size:
        flat[count if indices is None else 0:].fill(0)


def converts(source, target):
    """Only same-dtype gathers and scatters are fused on the GPU."""
    return source == target


def gather(flat, indices, out):
    if indices is None:
        out[...] = flat[:out.size]
        return out
    return _cupy().take(flat, indices, out=out)


def scatter(payload, indices, flat, divisor=None):
    count = payload.size
    _zero_unwritten(flat, indices, count)
    divide = divisor is not None
    value = compute_dtype(payload.dtype).type(payload.dtype.type(divisor if divide else 1))
    *index, index_dtype = _indices(indices)
    _launch(_kernel("scatter", payload.dtype, value.dtype, index_dtype), count, payload, *index,
            flat, value, np.int32(divide), np.int64(count))
    return flat


def _firsts(name, bits, size, count=None):
    """The bits set before every 64th coordinate (int64 on the device, one more entry than
    blocks: the total last), checked against ``count`` when given (one read back)."""
    cupy = _cupy()
    blocks = (size + 63) // 64
    per_byte = cupy.zeros(blocks * 8, dtype=np.uint8)  # 1/32 of float32 gradients' bytes
    per_byte[:bits.size] = cupy.asarray(POPCOUNT)[bits]
    firsts = cupy.zeros(blocks + 1, dtype=np.int64)
    cupy.cumsum(per_byte.reshape(blocks, 8).sum(axis=1, dtype=np.int64), out=firsts[1:])
    del per_byte
    found = count if count is None else int(firsts[-1])
    if found != count:
        raise ValueError(f"{name}: the bits hold {found} survivors, not {count}")
    return firsts


def compact(flat, bits, count):
    """``flat[:count] = flat[mask]`` through a payload-sized buffer (threads cannot move
    values within one array safely); returns ``flat[:count]``."""
    firsts = _firsts("compact", bits, flat.size, count)
    survivors = _cupy().empty(count, dtype=flat.dtype)
    _launch(_kernel("gather_bits", flat.dtype), (flat.size + 63) // 64, flat, bits, firsts,
            np.int64(flat.size), survivors)
    flat[:count] = survivors
    return flat[:count]


def expand(flat, bits, count, divisor=None):
    """The inverse of :func:`compact`: ``flat[:count]`` scattered to the mask's coordinates
    (divided as :func:`scatter` does), 0 elsewhere, through a payload-sized copy."""
    firsts = _firsts("expand", bits, flat.size, count)
    payload = flat[:count].copy()
    divide = divisor is not None
    value = compute_dtype(flat.dtype).type(flat.dtype.type(divisor if divide else 1))
    _launch(_kernel("scatter_bits", flat.dtype, value.dtype), (flat.size + 63) // 64, payload,
            bits, firsts, np.int64(flat.size), flat, value, np.int32(divide))
    return flat


def absmax_bits(flat, bits, residual, offsets, starts, which, out):
    """``out[s]`` (a host float64 array) for each ``s`` in ``which``: the largest
    |value + residual| of segment ``s``'s survivors, every segment in one launch and one read
    back. Segments from coordinate 0, each one's residual where the bits put it (``starts``)."""
    cupy = _cupy()
    compute = compute_dtype(flat.dtype)
    segments = len(offsets) - 1
    firsts = _firsts("absmax_bits", bits, flat.size)
    tops = cupy.zeros(max(segments, 1), dtype=np.uint64)
    _launch(_kernel("absmax_bits", flat.dtype, compute), (flat.size + 63) // 64, flat, bits,
            firsts, *_optional(residual, compute), cupy.asarray(np.asarray(offsets, np.int64)),
            np.int64(segments), np.int64(flat.size), tops)
    found = cupy.asnumpy(tops)
    found = found.view(np.float64) if compute == np.float64 else \
        found.astype(np.uint32).view(np.float32).astype(np.float64)
    out[which] = found[which]
    return out


def absmax(flat, indices, residual):
    compute = compute_dtype(flat.dtype)
    count = flat.size if indices is None else indices.size
    result = _cupy().zeros(1, dtype=np.uint64)
    *index, index_dtype = _indices(indices)
    _launch(_kernel("absmax", flat.dtype, compute, index_dtype), count, flat, *index,
            *_optional(residual, compute), np.int64(count), result)
    bits = _cupy().asnumpy(result)
    return float(bits.view(np.float64)[0] if compute == np.float64
                 else bits.astype(np.uint32).view(np.float32)[0])


def ternary_encode(flat, indices, residual_in, residual_out, scale, key, codec, words_out):
    compute = compute_dtype(flat.dtype)
    count = flat.size if indices is None else indices.size
    words = _unsigned(words_out)
    *index, index_dtype = _indices(indices)
    _launch(_kernel("ternary_encode", flat.dtype, compute, words.dtype, index_dtype),
            words.size, flat, *index, *_optional(residual_in, compute),
            *_optional(residual_out, compute), np.int32(scale > 0), compute.type(scale),
            np.float32(scale), np.uint32(key & 0xFFFFFFFF), np.uint32((key >> 32) & 0xFFFFFFFF),
            _table("powers", codec), np.int32(codec.digits_per_word), words,
            np.int64(words.size), np.int64(count))
    return words_out


def ternary_encode_kept(flat, bits, residual_in, residual_out, offsets, starts, word_starts,
                        which, scales, keys, codec, words_out):
    """:func:`pacmpi.kernels.reference.ternary_encode_kept` of every segment with words, in one
    launch (a thread per word); segments from coordinate 0."""
    cupy = _cupy()
    compute = compute_dtype(flat.dtype)
    words = _unsigned(words_out)
    segments = len(offsets) - 1
    firsts = _firsts("ternary_encode_kept", bits, flat.size)
    keys = np.asarray(keys, np.uint64)
    device = [cupy.asarray(a) for a in (
        np.asarray(offsets, np.int64), np.asarray(word_starts, np.int64),
        (scales > 0).astype(np.int32), scales.astype(compute), scales.astype(np.float32),
        (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32),
        (keys >> np.uint64(32)).astype(np.uint32))]
    nwords = int(word_starts[-1])
    _launch(_kernel("ternary_encode_kept", flat.dtype, compute, words.dtype), nwords, flat,
            bits, firsts, residual_in, *_optional(residual_out, compute), device[0], device[1],
            np.int64(segments), *device[2:], _table("powers", codec),
            np.int32(codec.digits_per_word), words, np.int64(nwords))
    return words_out


def ternary_decode(words, count, codec, ranks, scale, divisor, indices, flat):
    compute = compute_dtype(flat.dtype).type
    _zero_unwritten(flat, indices, count)
    words = _unsigned(words)
    divide = divisor is not None
    *index, index_dtype = _indices(indices)
    _launch(_kernel("ternary_decode", flat.dtype, compute, words.dtype, index_dtype),
            codec.words_for(count), words, np.int64(count), np.int32(codec.digits_per_word),
            np.uint64(codec.base), *_table("division", codec), np.int64(ranks),
            compute(scale), compute(divisor if divide else 1), np.int32(divide), *index, flat)
    return flat
